"""The ``prometheus`` sink: its endpoint, its worker metrics, promtool, Prometheus and the
Pushgateway, all real."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from prometheus_fixtures import (
    LABELS,
    RUN,
    Pushgateway,
    create_sink,
    emit_every_event,
    end_worker,
    fetch,
    start_worker,
)
from test_prometheus_rules import GOODPUT

from rallypoint import sdk
from rallypoint.sdk import Event
from rallypoint_prometheus.sink import PrometheusSink
from servers import require_binary, start_prometheus, wait_until


def value(text: str, series: str) -> float | None:
    """The value of ``series`` (name{labels} as exposed) in ``text``, or None."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_endpoint_serves_the_events(populated_sink: PrometheusSink) -> None:
    text = fetch(f"http://127.0.0.1:{populated_sink.port}/metrics")
    expected = {
        f"rallypoint_rendezvous_rounds_total{{{LABELS}}}": 2,
        f"rallypoint_rendezvous_duration_seconds_sum{{{LABELS}}}": 0.75,
        f'rallypoint_rendezvous_duration_seconds_bucket{{le="0.25",{LABELS}}}': 1,
        f"rallypoint_rendezvous_round{{{LABELS}}}": 1,
        f"rallypoint_world_size{{{LABELS}}}": 8,
        f"rallypoint_nodes{{{LABELS}}}": 2,
        f"rallypoint_nodes_min{{{LABELS}}}": 2,
        f"rallypoint_nodes_max{{{LABELS}}}": 3,
        f"rallypoint_local_world_size{{{LABELS}}}": 4,
        f"rallypoint_nodes_waiting{{{LABELS}}}": 0,  # the round after they asked
        f"rallypoint_agent_state{{{LABELS}}}": 2,
        f'rallypoint_worker_failures_total{{exit_reason="SIGKILL",{LABELS}}}': 1,
        f'rallypoint_restarts_total{{cause="failure",{LABELS}}}': 1,
        f'rallypoint_restarts_total{{cause="membership",{LABELS}}}': 0,
        f"rallypoint_checkpoint_save_seconds_sum{{{LABELS}}}": 3.0,
        f"rallypoint_checkpoint_blocked_seconds_sum{{{LABELS}}}": 0.5,
        f"rallypoint_checkpoint_load_seconds_sum{{{LABELS}}}": 1.5,
        f"rallypoint_checkpoint_bytes{{{LABELS}}}": 2048,
        f"rallypoint_checkpoint_step{{{LABELS}}}": 100,
        f"rallypoint_checkpoints_skipped_total{{{LABELS}}}": 1,
    }
    assert {series: value(text, series) for series in expected} == expected


def test_nodes_waiting_until_the_next_round(tmp_path: Path) -> None:
    sink = create_sink({"port": 0, "addr": "127.0.0.1"})
    try:
        sink.emit(Event(sdk.NODES_WAITING, RUN, {"nodes_waiting": 2}))
        url = f"http://127.0.0.1:{sink.port}/metrics"
        assert value(fetch(url), f"rallypoint_nodes_waiting{{{LABELS}}}") == 2
        sink.emit(Event(sdk.RENDEZVOUS_COMPLETED, RUN, {"world_size": 3}))
        assert value(fetch(url), f"rallypoint_nodes_waiting{{{LABELS}}}") == 0
    finally:
        sink.close()


def test_worker_metrics_are_served_with_the_agents_labels(
    populated_sink: PrometheusSink,
) -> None:
    text = fetch(f"http://127.0.0.1:{populated_sink.port}/metrics")
    worker = 'node="node-a",rank="0",role="trainer",run_id="job-7"'
    expected = {
        f"rallypoint_training_step{{{worker}}}": 41,
        f"rallypoint_training_loss{{{worker}}}": 0.5,
        f"rallypoint_training_samples_total{{{worker}}}": 64,
        f"rallypoint_training_samples_per_second{{{worker}}}": 1200,
        f"rallypoint_training_step_seconds_count{{{worker}}}": 1,
        'app_batches_total{node="node-a",rank="0",role="trainer",run_id="job-7",split="train"}': 3,
        f"app_queue{{{worker}}}": 2,
        f'app_load_seconds_bucket{{le="0.005",{worker}}}': 1,
    }
    assert {series: value(text, series) for series in expected} == expected


def test_endpoint_text_passes_promtool(populated_sink: PrometheusSink) -> None:
    promtool = require_binary("promtool", "prometheus")
    straggler = {"node": RUN.node_id, "pace": 0.3, "median": 0.1, "ratio": 3.0}
    populated_sink.emit(Event(sdk.STRAGGLER, RUN, straggler))
    text = fetch(f"http://127.0.0.1:{populated_sink.port}/metrics")
    served = {line.split("{")[0] for line in text.splitlines() if line[:1] != "#"}
    wanted = {"rallypoint_training_step", "rallypoint_world_size", "rallypoint_straggler_ratio"}
    assert wanted | GOODPUT <= served
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    # promtool prints lint problems (naming, units, missing HELP) and exits non-zero.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_restarted_workers_are_not_counted_twice(tmp_path: Path) -> None:
    """A worker's gauges go with it, its counts stay; its successor's add to the counts
    and replace the gauges."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    sink = create_sink({"port": 0, "addr": "127.0.0.1"}, metrics_dir)
    url = f"http://127.0.0.1:{sink.port}/metrics"
    worker = 'node="node-a",rank="1",role="trainer",run_id="job-7"'
    queue, samples = f"app_queue{{{worker}}}", f"rallypoint_training_samples_total{{{worker}}}"
    try:
        first = start_worker(metrics_dir, rank=1)
        sink.emit(Event(sdk.WORKERS_STARTED, RUN, {"pids": [first.pid]}))
        text = fetch(url)
        assert (value(text, queue), value(text, samples)) == (2, 64)

        end_worker(first)  # the worker dies; nothing has told the sink yet
        text = fetch(url)
        assert (value(text, queue), value(text, samples)) == (None, 64)
        assert not list(metrics_dir.glob(f"gauge_live*_{first.pid}.db"))

        second = start_worker(metrics_dir, rank=1)  # its successor, same rank
        sink.emit(Event(sdk.WORKERS_STARTED, RUN, {"pids": [second.pid]}))
        try:
            text = fetch(url)
            assert (value(text, queue), value(text, samples)) == (2, 128)
        finally:
            end_worker(second)
    finally:
        sink.close()


def test_prometheus_scrapes_the_sink(populated_sink: PrometheusSink, tmp_path: Path) -> None:
    server = start_prometheus(tmp_path, scrape_targets=[f"127.0.0.1:{populated_sink.port}"])
    try:
        # Prometheus 2.42 scrapes its targets for the first time ~5 s after starting.
        result = server.wait_for_query('rallypoint_world_size{run_id="job-7"}', timeout=30)
        assert result[0]["metric"]["node"] == "node-a"
        assert result[0]["value"][1] == "8"
        restarts = server.query('rallypoint_restarts_total{cause="failure"}')
        assert restarts[0]["value"][1] == "1"
        step = server.query('rallypoint_training_step{run_id="job-7"}')
        assert [(s["metric"]["rank"], s["value"][1]) for s in step] == [("0", "41")]
    finally:
        server.stop()


def test_pushgateway_receives_the_metrics(pushgateway: Pushgateway) -> None:
    sink = create_sink(
        {"port": 0, "addr": "127.0.0.1", "pushgateway": pushgateway.url, "push_interval": 0.2}
    )
    group = 'instance="",job="rallypoint",node="node-a",role="trainer",run_id="job-7"'
    world = f"rallypoint_world_size{{{group}}}"
    state = f"rallypoint_agent_state{{{group}}}"
    try:
        emit_every_event(sink)
        # Pushed every 0.2 s while the run goes on.
        assert wait_until(lambda: value(fetch(f"{pushgateway.url}/metrics"), world) == 8, 15)
        sink.emit(Event(sdk.AGENT_STOPPING, RUN, {"exit_code": 0, "reason": "done"}))
    finally:
        sink.close()
    # close() pushed the final state: it stays in the gateway after the run.
    text = fetch(f"{pushgateway.url}/metrics")
    assert value(text, state) == 4
    assert value(text, f'rallypoint_restarts_total{{cause="failure",{group}}}') == 1
    assert sink.pusher is not None and not sink.pusher.failing


def test_an_unreachable_pushgateway_does_not_stop_the_sink() -> None:
    sink = create_sink(
        {"port": 0, "addr": "127.0.0.1", "pushgateway": "127.0.0.1:1", "push_interval": 60}
    )
    try:
        emit_every_event(sink)
        assert sink.pusher is not None and not sink.pusher.push()
        assert sink.pusher.failing
        text = fetch(f"http://127.0.0.1:{sink.port}/metrics")
        assert re.search(r"^rallypoint_world_size\{.*\} 8\.0$", text, re.M)
    finally:
        sink.close()  # its last push fails too, and is only logged


def test_a_metric_file_being_created_does_not_fail_the_scrape(tmp_path: Path) -> None:
    """A worker creating its file leaves it empty for a moment: the scrape serves the rest
    (prometheus_client alone answers 500)."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    sink = create_sink({"port": 0, "addr": "127.0.0.1"}, metrics_dir)
    worker = 'node="node-a",rank="0",role="trainer",run_id="job-7"'
    try:
        running = start_worker(metrics_dir, rank=0)
        (metrics_dir / "counter_999999.db").touch()
        try:
            text = fetch(f"http://127.0.0.1:{sink.port}/metrics")
            assert value(text, f"rallypoint_training_samples_total{{{worker}}}") == 64
        finally:
            end_worker(running)
    finally:
        sink.close()


def test_a_hang_is_counted_by_kind_and_its_worker_failure_as_a_hang() -> None:
    sink = create_sink({"port": 0, "addr": "127.0.0.1"})
    try:
        sink.emit(Event(sdk.HANG_DETECTED, RUN, {"kind": "stuck", "ranks": [3]}))
        failure = {"rank": 3, "signal": "SIGKILL", "hang": "rank 3 made no progress for 61 s"}
        sink.emit(Event(sdk.WORKER_FAILED, RUN, failure))
        text = fetch(f"http://127.0.0.1:{sink.port}/metrics")
        assert value(text, f'rallypoint_hangs_total{{kind="stuck",{LABELS}}}') == 1
        assert value(text, f'rallypoint_worker_failures_total{{exit_reason="hang",{LABELS}}}') == 1
    finally:
        sink.close()

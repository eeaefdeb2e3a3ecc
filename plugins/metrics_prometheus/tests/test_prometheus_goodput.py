"""The goodput metrics: this node's goodput account, served on ``/metrics``."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from prometheus_fixtures import LABELS, RUN, create_sink, fetch
from test_prometheus_sink import value

from rallypoint import sdk
from rallypoint.sdk import Event
from rallypoint_prometheus.sink import PrometheusSink


def long_run() -> list[dict[str, Any]]:
    """Event-log records of one node: 120 steps, a SIGKILL, a restart from a checkpoint 20
    steps back, 150 steps, a membership change, 30 steps resumed by the script itself (no
    load reported: redone until the first step); two ranks save every step (their stalls
    overlap) and progress comes every 2 s."""
    records: list[dict[str, Any]] = []

    def event(name: str, at: float, **data: Any) -> None:
        records.append({"event": name, "wall_time": at, "node": RUN.node_id, **data})

    def train(first: int, last: int, at: float) -> float:
        reported = -1.0
        for step in range(first, last):
            at += 0.5
            for rank in (0, 1):
                stall = {"seconds": 0.2, "blocked_seconds": 0.05 + 0.01 * rank}
                event(sdk.CHECKPOINT_SAVED, at + 0.01 * rank, step=step, rank=rank, **stall)
            if at - reported >= 2:
                event(sdk.PROGRESS, at + 0.02, step=step, step_seconds=0.5)
                reported = at
        return at

    event(sdk.AGENT_STARTED, 1000.0)
    event(sdk.RENDEZVOUS_STARTED, 1000.1)
    event(sdk.RENDEZVOUS_COMPLETED, 1000.2, round=0)
    event(sdk.WORKERS_STARTED, 1003.0, round=0, world_size=2)
    at = train(0, 120, 1004.0)
    event(sdk.WORKER_FAILED, at + 0.4, timestamp=at + 0.3, detected=at + 0.35, signal="SIGKILL")
    event(sdk.RENDEZVOUS_STARTED, at + 0.5)
    event(sdk.RENDEZVOUS_COMPLETED, at + 0.6, round=1)
    event(sdk.WORKERS_RESTARTED, at + 0.61, cause="failure")
    event(sdk.WORKERS_STARTED, at + 2, round=1, world_size=2)
    event(sdk.CHECKPOINT_LOADED, at + 3.5, step=99, seconds=1.0, source="memory")
    at = train(100, 250, at + 3.5)
    event(sdk.WORKERS_RESTARTED, at + 0.4, cause="membership")
    event(sdk.RENDEZVOUS_STARTED, at + 0.5)
    event(sdk.RENDEZVOUS_COMPLETED, at + 0.6, round=2)
    event(sdk.WORKERS_STARTED, at + 2, round=2, world_size=2)
    train(250, 280, at + 2.5)
    return records


def test_the_accountant_gives_at_any_moment_the_account_of_every_event() -> None:
    """The sink's accountant, fed the events one at a time as the sink gets them, gives at
    any moment of the run the sums of the whole account of the events so far: same phases,
    same incidents, however many saves and steps came."""
    records = long_run()
    accountant = sdk.GoodputAccountant(timelines=False)  # as the sink has it
    for index, record in enumerate(records):
        accountant.add(as_event(record))
        now = record["wall_time"] + 0.3
        whole = sdk.goodput_account(records[: index + 1], now=now)
        snapshot = accountant.snapshot(now)
        assert snapshot.phases == pytest.approx(whole.phases, abs=1e-6), index
        assert (list(snapshot.incidents), snapshot.steps_redone) == (
            whole.incidents, whole.steps_redone,
        )  # fmt: skip
        assert snapshot.total == pytest.approx(whole.total) and snapshot.stragglers == 0
    assert whole.phases["checkpoint"] > 15 and whole.phases["redone"] > 5
    assert [i.cause for i in whole.incidents] == ["SIGKILL", "membership"]


def as_event(record: dict[str, Any]) -> Event:
    """An event-log record as the sink gets its event."""
    data = {k: v for k, v in record.items() if k not in ("event", "wall_time", "node")}
    return Event(record["event"], RUN, data, record["wall_time"])


def scrape(sink: PrometheusSink) -> str:
    return fetch(f"http://127.0.0.1:{sink.port}/metrics")


def phase(text: str, name: str) -> float:
    labels = f'node="node-a",phase="{name}",role="trainer",run_id="job-7"'
    seconds = value(text, f"rallypoint_phase_seconds_total{{{labels}}}")
    assert seconds is not None, name
    return seconds


def test_the_endpoint_serves_the_account_of_the_run(populated_sink: PrometheusSink) -> None:
    text = scrape(populated_sink)
    goodput = value(text, f"rallypoint_goodput_ratio{{{LABELS}}}")
    assert goodput is not None and 0 < goodput < 1
    assert sum(phase(text, name) for name in sdk.goodput_account(()).phases) > 0
    expected = {
        f'rallypoint_failures_total{{cause="SIGKILL",{LABELS}}}': 1,
        f"rallypoint_failure_detect_seconds_count{{{LABELS}}}": 1,
        f"rallypoint_recovery_seconds_count{{{LABELS}}}": 0,  # no step since the restart
        f"rallypoint_steps_redone_total{{{LABELS}}}": 0,
        f"rallypoint_stragglers_total{{{LABELS}}}": 0,
    }
    assert {series: value(text, series) for series in expected} == expected

    # The first step after the restart ends the recovery: observed once, however often
    # the endpoint is scraped.
    populated_sink.emit(Event(sdk.PROGRESS, RUN, {"step": 101}))
    for _ in range(2):
        text = scrape(populated_sink)
        assert value(text, f"rallypoint_recovery_seconds_count{{{LABELS}}}") == 1
        assert value(text, f"rallypoint_failure_detect_seconds_count{{{LABELS}}}") == 1


def test_phase_counters_never_go_down_when_the_account_moves_time() -> None:
    """Workers started 8 s ago count as training until their checkpoint load says that
    6 s of it were loading: the account moves the time, the counters do not go back."""
    sink = create_sink({"port": 0, "addr": "127.0.0.1"})
    started = time.time() - 8
    events = [
        Event(sdk.AGENT_STARTED, RUN, {}, started - 2),
        Event(sdk.RENDEZVOUS_STARTED, RUN, {}, started - 1.5),
        Event(sdk.RENDEZVOUS_COMPLETED, RUN, {"round": 0}, started - 1),
        Event(sdk.WORKERS_STARTED, RUN, {"round": 0}, started),
    ]
    try:
        for event in events:
            sink.emit(event)
        before = scrape(sink)
        assert phase(before, "training") >= 8

        loaded = time.time()
        events += [
            Event(sdk.CHECKPOINT_LOADED, RUN, {"step": 50, "seconds": 6.0}, loaded),
            Event(sdk.PROGRESS, RUN, {"step": 51}, loaded),
        ]
        for event in events[-2:]:
            sink.emit(event)
        after = scrape(sink)
        # The account now gives training only the time since the load...
        records = [json.loads(event.to_json()) for event in events]
        account = sdk.goodput_account(records, now=time.time())
        assert account.phases["training"] < 1
        assert phase(after, "loading") == pytest.approx(6.0)
        # ... but the counter keeps the 8 s it served, until training catches up.
        assert phase(after, "training") == phase(before, "training")
        assert all(phase(after, name) >= phase(before, name) for name in account.phases)
    finally:
        sink.close()


def test_a_straggler_is_counted_and_its_ratio_served_for_its_round() -> None:
    sink = create_sink({"port": 0, "addr": "127.0.0.1"})
    ratio = f"rallypoint_straggler_ratio{{{LABELS}}}"
    try:
        sink.emit(Event(sdk.WORKERS_STARTED, RUN, {"round": 0}))
        straggler = {"node": RUN.node_id, "pace": 0.5, "median": 0.2, "ratio": 2.5}
        sink.emit(Event(sdk.STRAGGLER, RUN, straggler))
        text = scrape(sink)
        assert value(text, f"rallypoint_stragglers_total{{{LABELS}}}") == 1
        assert value(text, ratio) == 2.5

        sink.emit(Event(sdk.WORKERS_STARTED, RUN, {"round": 1}))  # a new round
        text = scrape(sink)
        assert value(text, f"rallypoint_stragglers_total{{{LABELS}}}") == 1
        assert value(text, ratio) is None
    finally:
        sink.close()

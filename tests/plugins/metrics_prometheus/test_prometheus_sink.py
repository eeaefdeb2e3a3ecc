"""The ``prometheus`` sink, scraped by a real Prometheus server."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rallypoint import events
from rallypoint.events import Event, RunInfo
from rallypoint.extensions import SinkContext
from rallypoint.plugins import get_plugin_manager
from rallypoint.registry import METRICS_SINKS
from rallypoint_prometheus.sink import PrometheusSink
from servers import start_prometheus

RUN = RunInfo(run_id="job-7", node_id="node-a", hostname="host-a", role="trainer")


@pytest.fixture
def sink() -> Iterator[PrometheusSink]:
    registration = get_plugin_manager().registry.get(METRICS_SINKS, "prometheus")
    created = registration.create(SinkContext(RUN, {"port": 0, "addr": "127.0.0.1"}))
    assert isinstance(created, PrometheusSink)
    yield created
    created.close()


def emit_a_run(sink: PrometheusSink) -> None:
    sink.emit(Event(events.AGENT_STARTED, RUN))
    sink.emit(
        Event(
            events.RENDEZVOUS_COMPLETED,
            RUN,
            {"round": 0, "duration_seconds": 0.25, "world_size": 8, "group_world_size": 2},
        )
    )
    sink.emit(Event(events.WORKER_FAILED, RUN, {"exit_code": None, "signal": "SIGKILL"}))
    sink.emit(Event(events.WORKERS_RESTARTED, RUN, {"cause": "failure"}))
    sink.emit(Event(events.WORKERS_STARTED, RUN))


def test_metrics_endpoint_serves_the_events(sink: PrometheusSink) -> None:
    emit_a_run(sink)
    with urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    labels = 'node="node-a",role="trainer",run_id="job-7"'
    assert f"rallypoint_rendezvous_rounds_total{{{labels}}} 1.0" in text
    assert f"rallypoint_rendezvous_duration_seconds_sum{{{labels}}} 0.25" in text
    assert f"rallypoint_world_size{{{labels}}} 8.0" in text
    assert f'rallypoint_worker_failures_total{{exit_reason="SIGKILL",{labels}}} 1.0' in text
    assert f'rallypoint_restarts_total{{cause="failure",{labels}}} 1.0' in text
    assert f"rallypoint_agent_state{{{labels}}} 2.0" in text


def test_prometheus_scrapes_the_sink(sink: PrometheusSink, tmp_path: Path) -> None:
    emit_a_run(sink)
    server = start_prometheus(tmp_path, scrape_targets=[f"127.0.0.1:{sink.port}"])
    try:
        # Prometheus 2.42 scrapes its targets for the first time ~5 s after starting.
        result = server.wait_for_query('rallypoint_world_size{run_id="job-7"}', timeout=30)
        assert result[0]["metric"]["node"] == "node-a"
        assert result[0]["value"][1] == "8"
        restarts = server.query('rallypoint_restarts_total{cause="failure"}')
        assert restarts[0]["value"][1] == "1"
    finally:
        server.stop()

"""Helpers and fixtures of the Prometheus sink's tests: a real Pushgateway, and a sink fed with every
event and with metrics from a real worker process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rallypoint import sdk
from rallypoint.sdk import Event, MetricsSink, RunInfo, SinkContext
from rallypoint.testing.helpers import registered
from rallypoint_prometheus.sink import PrometheusSink
from servers import ServerProcess, free_port, require_binary, wait_until

RUN = RunInfo(run_id="job-7", node_id="node-a", hostname="host-a", role="trainer")
LABELS = 'node="node-a",role="trainer",run_id="job-7"'

# A proxy from the environment can never reach loopback servers.
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch(url: str) -> str:
    with HTTP.open(url, timeout=5) as reply:
        text: str = reply.read().decode()
    return text


def create_sink(options: dict[str, object], metrics_dir: Path | None = None) -> PrometheusSink:
    """The sink as the agent creates it: from its registration, every option present."""
    registration = registered(MetricsSink, "prometheus")
    values = {option.name: option.default for option in registration.options}
    values.update(options)
    created = registration.create(
        SinkContext(RUN, values, None if metrics_dir is None else str(metrics_dir))
    )
    assert isinstance(created, PrometheusSink)
    return created


def emit_every_event(sink: PrometheusSink) -> None:
    """One run with a failure and a restart, as the agent reports it."""
    round_info: dict[str, Any] = {
        "round": 0, "group_rank": 0, "group_world_size": 2, "world_size": 8,
        "master_addr": "host-a", "master_port": 29500, "members": ["node-a", "node-b"],
    }  # fmt: skip
    timeline: list[tuple[str, dict[str, Any]]] = [
        (sdk.AGENT_STARTED, {"nproc_per_node": 4, "min_nodes": 2, "max_nodes": 3}),
        (sdk.RENDEZVOUS_STARTED, {"restart_count": 0}),
        (sdk.RENDEZVOUS_COMPLETED, {**round_info, "duration_seconds": 0.25}),
        (sdk.WORKERS_STARTED, {**round_info, "pids": [11, 12, 13, 14]}),
        (sdk.CHECKPOINT_LOADED, {"step": 0, "seconds": 1.5, "bytes": 10, "skipped": 1}),
        (sdk.CHECKPOINT_SAVED, {"step": 100, "seconds": 3.0, "bytes": 2048,
                                   "blocked_seconds": 0.5, "asynchronous": True}),
        (sdk.NODES_WAITING, {"nodes_waiting": 1}),
        (sdk.WORKER_FAILED, {"local_rank": 1, "rank": 1, "pid": 12, "exit_code": None,
                                "signal": "SIGKILL", "message": "", "timestamp": 0.0}),
        (sdk.WORKERS_RESTARTED, {"restart_count": 1, "cause": "failure"}),
        (sdk.RENDEZVOUS_STARTED, {"restart_count": 1}),
        (sdk.RENDEZVOUS_COMPLETED, {**round_info, "round": 1, "duration_seconds": 0.5}),
        (sdk.WORKERS_STARTED, {**round_info, "round": 1, "pids": [21, 22, 23, 24]}),
    ]  # fmt: skip
    for name, data in timeline:
        sink.emit(Event(name, RUN, data))


#: A worker recording every kind of metric rallypoint.metrics has.
WORKER = textwrap.dedent(
    """
    import sys
    from rallypoint import metrics

    metrics.step(41)
    metrics.loss(0.5)
    metrics.samples(64)
    metrics.samples_per_second(1200.0)
    metrics.step_time(0.02)
    metrics.counter("app_batches", "Batches.", ["split"]).inc(3, split="train")
    metrics.gauge("app_queue", "Queue length.", aggregate="sum").set(2)
    metrics.histogram("app_load_seconds", "Data loading time.").observe(0.003)
    print(metrics.enabled(), flush=True)
    sys.stdin.read()  # stay alive until the test closes stdin
    """
)


def start_worker(metrics_dir: Path, rank: int, source: str = WORKER) -> subprocess.Popen[str]:
    """A worker process recording metrics into ``metrics_dir``; it has recorded them all
    when this returns, and exits once its stdin is closed."""
    env = {"RALLYPOINT_METRICS_DIR": str(metrics_dir), "RANK": str(rank), "PATH": "/usr/bin"}
    process = subprocess.Popen(
        [sys.executable, "-c", source],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "True"  # bounded by the test timeout
    return process


def end_worker(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.close()
    assert process.wait(timeout=10) == 0


@pytest.fixture
def populated_sink(tmp_path: Path) -> Iterator[PrometheusSink]:
    """A sink on a free loopback port after a whole run, with a live worker's metrics."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    sink = create_sink({"port": 0, "addr": "127.0.0.1"}, metrics_dir)
    worker = start_worker(metrics_dir, rank=0)
    try:
        emit_every_event(sink)
        yield sink
    finally:
        end_worker(worker)
        sink.close()


class Pushgateway(ServerProcess):
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['web']}"


def start_pushgateway(tmp_path: Path, timeout: float = 30.0) -> Pushgateway:
    """A Prometheus Pushgateway on a free loopback port, ready when this returns."""
    binary = require_binary("prometheus-pushgateway", "prometheus-pushgateway")
    for _ in range(4):  # a port taken between free_port() and the bind: try another
        port = free_port()
        argv = [binary, f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
        log_path = tmp_path / f"pushgateway-{port}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True
            )
        server = Pushgateway(
            "pushgateway", binary, argv, tmp_path, {"web": port}, log_path, process
        )

        def ready(server: Pushgateway = server) -> bool:
            try:
                return server.is_running() and "pushgateway" in fetch(f"{server.url}/metrics")
            except OSError:
                return False

        if wait_until(ready, timeout):
            return server
        server.stop()
        if server.process.returncode in (None, 0):  # alive but not answering: give up
            break
    raise RuntimeError(f"the Pushgateway did not start:\n{server.log_tail()}")


@pytest.fixture
def pushgateway(tmp_path: Path) -> Iterator[Pushgateway]:
    server = start_pushgateway(tmp_path)
    yield server
    server.stop()

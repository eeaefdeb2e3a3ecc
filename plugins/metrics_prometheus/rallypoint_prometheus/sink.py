"""The Prometheus sink: rallypoint events and the workers' metrics, served on ``/metrics``.

The agent's own metrics live in a registry of the sink's own (never prometheus_client's
global one). The workers' metrics (``rallypoint.metrics``) are files in the directory the
agent gives the sink, read on every scrape by prometheus_client's multiprocess collector
and labelled like the agent's. Before each read, and at every change of the worker group,
the gauges of workers that are no longer running are removed
(``prometheus_client.multiprocess.mark_process_dead``): a restarted worker's gauges never
add up with its predecessor's. Counters and histograms of dead workers stay, so that their
totals never go down.

Goodput, the time of each phase, failures, recoveries and stragglers come from this node's
goodput account, the one ``rallypoint report`` prints (``goodput.py``).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import push_to_gateway
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from rallypoint import sdk
from rallypoint.sdk import Event, SinkContext
from rallypoint_prometheus.goodput import GoodputMetrics

logger = logging.getLogger(__name__)

LABELS = ("run_id", "node", "role")

#: What the agent is doing after each event, as the value of ``rallypoint_agent_state``.
STATES = {
    sdk.AGENT_STARTED: 0,  # starting
    sdk.RENDEZVOUS_STARTED: 1,  # in rendezvous
    sdk.RENDEZVOUS_COMPLETED: 1,
    sdk.WORKERS_STARTED: 2,  # running workers
    sdk.WORKER_FAILED: 3,  # handling a failure
    sdk.WORKERS_RESTARTED: 3,
    sdk.AGENT_STOPPING: 4,  # stopping
}

#: Rendezvous rounds take milliseconds on a warm store and up to ``join_timeout`` when nodes
#: are missing.
RENDEZVOUS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: Checkpoint saves and loads: a fraction of a second to half an hour.
CHECKPOINT_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

#: Events after which every worker of the previous group has ended.
_GROUP_CHANGES = frozenset(
    {sdk.WORKERS_STARTED, sdk.WORKER_FAILED, sdk.WORKERS_RESTARTED, sdk.AGENT_STOPPING}
)
_LIVE_GAUGE_FILE = re.compile(r"^gauge_live[a-z]+_(\d+)\.db$")


class PrometheusSink:
    """Metrics of one agent and its workers, served from a registry of its own."""

    def __init__(self, context: SinkContext) -> None:
        run = context.run
        self.labels = {"run_id": run.run_id, "node": run.node_id, "role": run.role}
        self.registry = CollectorRegistry()
        registry = self.registry

        def gauge(name: str, help_text: str) -> Gauge:
            return Gauge(name, help_text, LABELS, registry=registry)

        # --- rendezvous and membership
        self.rendezvous_duration = Histogram(
            "rallypoint_rendezvous_duration_seconds",
            "Time from joining a rendezvous to the round completing.",
            LABELS,
            buckets=RENDEZVOUS_BUCKETS,
            registry=registry,
        )
        self.rounds = Counter(
            "rallypoint_rendezvous_rounds",
            "Completed rendezvous rounds.",
            LABELS,
            registry=registry,
        )
        self.round = gauge("rallypoint_rendezvous_round", "Number of the current round, from 0.")
        self.world_size = gauge("rallypoint_world_size", "Workers in the current round.")
        self.nodes = gauge("rallypoint_nodes", "Nodes in the current round.")
        self.nodes_min = gauge("rallypoint_nodes_min", "MIN of --nnodes MIN:MAX.")
        self.nodes_max = gauge("rallypoint_nodes_max", "MAX of --nnodes MIN:MAX.")
        self.local_world_size = gauge(
            "rallypoint_local_world_size", "Workers per node (--nproc-per-node)."
        )
        self.nodes_waiting = gauge(
            "rallypoint_nodes_waiting", "Nodes waiting to join the next rendezvous round."
        )
        self.state = gauge(
            "rallypoint_agent_state",
            "0 starting, 1 rendezvous, 2 running, 3 recovering, 4 stopping.",
        )
        # --- failures and restarts
        self.failures = Counter(
            "rallypoint_worker_failures",
            "Worker processes that failed, by exit reason.",
            (*LABELS, "exit_reason"),
            registry=registry,
        )
        self.hangs = Counter(
            "rallypoint_hangs",
            "Hangs this node's agent found and killed, by kind (stuck, collective, silent, "
            "watchdog).",
            (*LABELS, "kind"),
            registry=registry,
        )
        self.restarts = Counter(
            "rallypoint_restarts",
            "Worker group restarts, by cause (failure or membership).",
            (*LABELS, "cause"),
            registry=registry,
        )
        # --- checkpoints, reported by the workers through their agent
        self.checkpoint_save = Histogram(
            "rallypoint_checkpoint_save_seconds",
            "Time to write a checkpoint.",
            LABELS,
            buckets=CHECKPOINT_BUCKETS,
            registry=registry,
        )
        self.checkpoint_blocked = Histogram(
            "rallypoint_checkpoint_blocked_seconds",
            "Time training was blocked by a checkpoint save (less than the save when asynchronous).",
            LABELS,
            buckets=CHECKPOINT_BUCKETS,
            registry=registry,
        )
        self.checkpoint_load = Histogram(
            "rallypoint_checkpoint_load_seconds",
            "Time to find, verify and load a checkpoint.",
            LABELS,
            buckets=CHECKPOINT_BUCKETS,
            registry=registry,
        )
        self.checkpoint_bytes = gauge(
            "rallypoint_checkpoint_bytes", "Size of the newest checkpoint saved."
        )
        self.checkpoint_step = gauge(
            "rallypoint_checkpoint_step", "Training step of the newest checkpoint saved."
        )
        self.checkpoints_skipped = Counter(
            "rallypoint_checkpoints_skipped",
            "Damaged or unfinished checkpoints passed over when loading.",
            LABELS,
            registry=registry,
        )
        self.peer_refused = Counter(
            "rallypoint_peer_transfers_refused",
            "Checkpoint transfers refused for want of the job's token (--rdzv-conf token_file).",
            LABELS,
            registry=registry,
        )
        # Series that exist from the start, so that increase() sees their first change.
        self.rounds.labels(**self.labels)
        self.checkpoints_skipped.labels(**self.labels)
        self.peer_refused.labels(**self.labels)
        for cause in ("failure", "membership"):
            self.restarts.labels(**self.labels, cause=cause)
        self.state.labels(**self.labels).set(0)
        self.nodes_waiting.labels(**self.labels).set(0)

        # Goodput, time per phase, failures and recoveries: this node's goodput account.
        self.goodput = GoodputMetrics(self.labels, LABELS)
        registry.register(self.goodput)

        self.workers: WorkerMetrics | None = None
        if context.worker_metrics_dir:
            taken = {m.name for m in registry.collect()}
            self.workers = WorkerMetrics(Path(context.worker_metrics_dir), self.labels, taken)
            registry.register(self.workers)

        addr = str(context.options.get("addr") or "0.0.0.0")
        port = int(context.options.get("port") or 0)
        self.server, self.thread = start_http_server(port, addr, registry=registry)
        self.port = int(self.server.server_address[1])
        shown = socket.gethostname() if addr in ("0.0.0.0", "::", "") else addr
        logger.info("serving Prometheus metrics on http://%s:%d/metrics", shown, self.port)

        self.pusher: Pusher | None = None
        gateway = str(context.options.get("pushgateway") or "")
        if gateway:
            self.pusher = Pusher(
                gateway,
                str(context.options.get("push_job") or "rallypoint"),
                registry,
                {"run_id": run.run_id, "node": run.node_id},
                float(context.options.get("push_interval") or 15.0),
            )

    def emit(self, event: Event) -> None:
        self.goodput.emit(event)
        data = event.data
        labels = self.labels
        name = event.name
        if name in STATES:
            self.state.labels(**labels).set(STATES[name])
        if name in _GROUP_CHANGES and self.workers is not None:
            self.workers.forget_dead()
        if name == sdk.AGENT_STARTED:
            for gauge, key in (
                (self.nodes_min, "min_nodes"),
                (self.nodes_max, "max_nodes"),
                (self.local_world_size, "nproc_per_node"),
            ):
                if key in data:
                    gauge.labels(**labels).set(float(data[key]))
        elif name == sdk.RENDEZVOUS_COMPLETED:
            self.rounds.labels(**labels).inc()
            self.nodes_waiting.labels(**labels).set(0)
            if "duration_seconds" in data:
                self.rendezvous_duration.labels(**labels).observe(float(data["duration_seconds"]))
            for gauge, key in (
                (self.world_size, "world_size"),
                (self.nodes, "group_world_size"),
                (self.round, "round"),
            ):
                if key in data:
                    gauge.labels(**labels).set(float(data[key]))
        elif name == sdk.NODES_WAITING:
            self.nodes_waiting.labels(**labels).set(float(data.get("nodes_waiting", 0)))
        elif name == sdk.WORKER_FAILED:
            reason = data.get("signal") or f"exit_code_{data.get('exit_code')}"
            if data.get("out_of_memory"):
                reason = "out_of_memory"
            elif data.get("hang"):
                reason = "hang"
            self.failures.labels(**labels, exit_reason=str(reason)).inc()
        elif name == sdk.HANG_DETECTED:
            self.hangs.labels(**labels, kind=str(data.get("kind", "stuck"))).inc()
        elif name == sdk.WORKERS_RESTARTED:
            self.restarts.labels(**labels, cause=str(data.get("cause", "failure"))).inc()
        elif name == sdk.CHECKPOINT_SAVED:
            self.checkpoint_save.labels(**labels).observe(float(data.get("seconds", 0.0)))
            blocked = data.get("blocked_seconds", data.get("seconds", 0.0))
            self.checkpoint_blocked.labels(**labels).observe(float(blocked))
            if "bytes" in data:
                self.checkpoint_bytes.labels(**labels).set(float(data["bytes"]))
            if "step" in data:
                self.checkpoint_step.labels(**labels).set(float(data["step"]))
        elif name == sdk.CHECKPOINT_LOADED:
            self.checkpoint_load.labels(**labels).observe(float(data.get("seconds", 0.0)))
            self.checkpoints_skipped.labels(**labels).inc(int(data.get("skipped", 0)))
        elif name == sdk.PEER_REFUSED:
            self.peer_refused.labels(**labels).inc()

    def close(self) -> None:
        # The last push carries the final state (stopping, restarts, failures): for a short
        # job it is what stays in the Pushgateway.
        if self.pusher is not None:
            self.pusher.close()
        self.server.shutdown()
        self.server.server_close()


class WorkerMetrics:
    """A collector of the workers' metrics files, labelled like the agent's metrics."""

    def __init__(self, directory: Path, labels: Mapping[str, str], taken: Iterable[str]) -> None:
        self.directory = directory
        self.labels = dict(labels)
        self.taken = frozenset(taken)
        self._lock = threading.Lock()
        self._refused: set[str] = set()

    def forget_dead(self) -> list[int]:
        """Remove the gauges of processes that have ended; return their pids."""
        with self._lock:
            return self._forget_dead()

    def _forget_dead(self) -> list[int]:
        dead: list[int] = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:  # the agent has removed it: the run is over
            return dead
        for name in names:
            match = _LIVE_GAUGE_FILE.match(name)
            if match and not _running(int(match.group(1))):
                dead.append(int(match.group(1)))
        for pid in set(dead):
            mark_process_dead(pid, str(self.directory))  # type: ignore[no-untyped-call]
        return dead

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._forget_dead()
            if not self.directory.is_dir():
                return
            families: list[Metric] = list(MultiProcessCollector.merge(_readable(self.directory)))  # type: ignore[no-untyped-call]
        for family in families:
            if family.name in self.taken:
                if family.name not in self._refused:
                    self._refused.add(family.name)
                    logger.warning(
                        "a worker metric is named %r like one of the agent's: not exported",
                        family.name,
                    )
                continue
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labelled.add_sample(
                    sample.name, {**sample.labels, **self.labels}, sample.value, sample.timestamp
                )
            yield labelled


def _readable(directory: Path) -> list[str]:
    """The metric files in ``directory`` that hold their header: a worker creating one
    leaves it empty for a moment, and prometheus_client fails the whole scrape on it."""
    files = []
    for path in directory.glob("*.db"):
        try:
            if path.stat().st_size >= _HEADER:
                files.append(str(path))
        except FileNotFoundError:  # a dead worker's gauges, just removed
            continue
    return files


#: The bytes at the head of a metric file: how much of it is used.
_HEADER = 8


def _running(pid: int) -> bool:
    """Whether ``pid`` is a running process; a zombie (exited, not yet reaped) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: trust kill()


class Pusher:
    """Pushes the registry to a Pushgateway every ``interval`` seconds and once at the end.

    Each push replaces the group ``job/run_id/node``: the gateway keeps the latest values
    of every agent after the job ends (delete the group when they are no longer wanted).
    A failed push is logged and retried at the next interval; it never stops the run.
    """

    def __init__(
        self,
        gateway: str,
        job: str,
        registry: CollectorRegistry,
        grouping_key: Mapping[str, str],
        interval: float,
    ) -> None:
        self.gateway = gateway
        self.job = job
        self.registry = registry
        self.grouping_key = dict(grouping_key)
        self.interval = max(interval, 0.05)
        self.failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pushgateway", daemon=True)
        self._thread.start()
        logger.info("pushing metrics to %s every %g s", gateway, self.interval)

    def push(self) -> bool:
        try:
            push_to_gateway(
                self.gateway,
                job=self.job,
                registry=self.registry,
                grouping_key=self.grouping_key,
                timeout=5.0,
            )
        except Exception as error:  # network, HTTP or a gateway refusing the metrics
            if not self.failing:
                logger.warning("pushing metrics to %s failed: %s", self.gateway, error)
            self.failing = True
            return False
        if self.failing:
            logger.info("pushing metrics to %s works again", self.gateway)
        self.failing = False
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.push()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.push()

"""The Prometheus sink: turns rallypoint events into metrics served on ``/metrics``."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rallypoint import events
from rallypoint.events import Event
from rallypoint.extensions import SinkContext

logger = logging.getLogger(__name__)

LABELS = ("run_id", "node", "role")

#: What the agent is doing after each event, as the value of ``rallypoint_agent_state``.
STATES = {
    events.AGENT_STARTED: 0,  # starting
    events.RENDEZVOUS_STARTED: 1,  # in rendezvous
    events.RENDEZVOUS_COMPLETED: 1,
    events.WORKERS_STARTED: 2,  # running workers
    events.WORKER_FAILED: 3,  # handling a failure
    events.WORKERS_RESTARTED: 3,
    events.AGENT_STOPPING: 4,  # stopping
}


class PrometheusSink:
    """Metrics of one agent, served from a registry of its own."""

    def __init__(self, context: SinkContext) -> None:
        self.labels = {
            "run_id": context.run.run_id,
            "node": context.run.node_id,
            "role": context.run.role,
        }
        self.registry = CollectorRegistry()
        self.rendezvous_duration = Histogram(
            "rallypoint_rendezvous_duration_seconds",
            "Time from joining a rendezvous to the round completing.",
            LABELS,
            registry=self.registry,
        )
        self.rounds = Counter(
            "rallypoint_rendezvous_rounds",
            "Completed rendezvous rounds.",
            LABELS,
            registry=self.registry,
        )
        self.failures = Counter(
            "rallypoint_worker_failures",
            "Worker processes that failed, by exit reason.",
            (*LABELS, "exit_reason"),
            registry=self.registry,
        )
        self.restarts = Counter(
            "rallypoint_restarts",
            "Worker group restarts, by cause (failure or membership).",
            (*LABELS, "cause"),
            registry=self.registry,
        )
        self.world_size = Gauge(
            "rallypoint_world_size", "Workers in the current round.", LABELS, registry=self.registry
        )
        self.nodes = Gauge(
            "rallypoint_nodes", "Nodes in the current round.", LABELS, registry=self.registry
        )
        self.state = Gauge(
            "rallypoint_agent_state",
            "0 starting, 1 rendezvous, 2 running, 3 recovering, 4 stopping.",
            LABELS,
            registry=self.registry,
        )
        port = int(context.options.get("port") or 0)
        addr = str(context.options.get("addr") or "0.0.0.0")
        self.server, self.thread = start_http_server(port, addr, registry=self.registry)
        self.port = int(self.server.server_address[1])
        logger.info("serving Prometheus metrics on http://%s:%d/metrics", addr, self.port)

    def emit(self, event: Event) -> None:
        data = event.data
        if event.name in STATES:
            self.state.labels(**self.labels).set(STATES[event.name])
        if event.name == events.RENDEZVOUS_COMPLETED:
            self.rounds.labels(**self.labels).inc()
            if "duration_seconds" in data:
                self.rendezvous_duration.labels(**self.labels).observe(
                    float(data["duration_seconds"])
                )
            if "world_size" in data:
                self.world_size.labels(**self.labels).set(float(data["world_size"]))
            if "group_world_size" in data:
                self.nodes.labels(**self.labels).set(float(data["group_world_size"]))
        elif event.name == events.WORKER_FAILED:
            reason = data.get("signal") or f"exit_code_{data.get('exit_code')}"
            self.failures.labels(**self.labels, exit_reason=str(reason)).inc()
        elif event.name == events.WORKERS_RESTARTED:
            self.restarts.labels(**self.labels, cause=str(data.get("cause", "failure"))).inc()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

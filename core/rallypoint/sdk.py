"""The plugin API: everything a rendezvous backend, restart policy, rank assigner, checkpoint
backend or metrics sink may import from rallypoint, and the only module it should.

What is here is stable across minor versions (``docs/plugins/api.md`` lists it; a test keeps
the page and this list the same); the modules these names come from are not, and
``make lint`` refuses a plugin that imports them. The testing kit for a plugin's own tests is
``rallypoint.testing`` (it imports pytest, so it is not re-exported here).

    from rallypoint.sdk import ConfigOption, RestartDecision, RestartPolicy, hookimpl
"""

from __future__ import annotations

from rallypoint.checkpoint.storage import CheckpointError, CheckpointStorage
from rallypoint.errors import RallypointError, UsageError
from rallypoint.events import Event, RoundInfo, RunInfo, WorkerFailure
from rallypoint.extensions import (
    COMMON_RENDEZVOUS_OPTIONS,
    CheckpointBackend,
    ConfigOption,
    EventSink,
    MetricsSink,
    NodeSpec,
    RankAssigner,
    RendezvousBackend,
    RendezvousRequest,
    RestartDecision,
    RestartPolicy,
    RestartRequest,
    SinkContext,
)
from rallypoint.hookspecs import hookimpl
from rallypoint.redact import redact_endpoint, redact_urls
from rallypoint.rendezvous.endpoints import parse_endpoint
from rallypoint.rendezvous.handler import Assignment, RendezvousHandler
from rallypoint.rendezvous.protocol import DEFAULT_PREFIX
from rallypoint.rendezvous.store import (
    CoordinationStore,
    CounterLiveness,
    StoreError,
    StoreUnavailable,
)

__all__ = [
    "COMMON_RENDEZVOUS_OPTIONS",
    "DEFAULT_PREFIX",
    "Assignment",
    "CheckpointBackend",
    "CheckpointError",
    "CheckpointStorage",
    "ConfigOption",
    "CoordinationStore",
    "CounterLiveness",
    "Event",
    "EventSink",
    "MetricsSink",
    "NodeSpec",
    "RallypointError",
    "RankAssigner",
    "RendezvousBackend",
    "RendezvousHandler",
    "RendezvousRequest",
    "RestartDecision",
    "RestartPolicy",
    "RestartRequest",
    "RoundInfo",
    "RunInfo",
    "SinkContext",
    "StoreError",
    "StoreUnavailable",
    "UsageError",
    "WorkerFailure",
    "hookimpl",
    "parse_endpoint",
    "redact_endpoint",
    "redact_urls",
]

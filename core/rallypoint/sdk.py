"""The plugin API: everything a rendezvous backend, restart policy, rank assigner, checkpoint
backend or metrics sink may import from rallypoint, and the only module it should.

What is here is stable across minor versions (``docs/plugins/api.md`` lists it; a test keeps
the page and this list the same); the modules these names come from are not, and
``make lint`` refuses a plugin that imports them. The testing kit for a plugin's own tests is
``rallypoint.testing`` (it imports pytest, so it is not re-exported here).

The upper-case strings (``AGENT_STARTED``...) are the names an ``Event`` may have, one per
phase of a run, for a metrics sink to tell them apart.

Example::

    from rallypoint.sdk import ConfigOption, RestartDecision, RestartPolicy, hookimpl
"""

from __future__ import annotations

from rallypoint.errors import RallypointError, UsageError
from rallypoint.events import (
    AGENT_STARTED,
    AGENT_STOPPING,
    CHECKPOINT_LOADED,
    CHECKPOINT_SAVED,
    HANG_DETECTED,
    NODES_WAITING,
    PEER_REFUSED,
    PROGRESS,
    RENDEZVOUS_COMPLETED,
    RENDEZVOUS_STARTED,
    SCALE_CHANGED,
    STRAGGLER,
    WORKER_FAILED,
    WORKERS_RESTARTED,
    WORKERS_STARTED,
    Event,
    RoundInfo,
    RunInfo,
    WorkerFailure,
)
from rallypoint.extensions import (
    COMMON_RENDEZVOUS_OPTIONS,
    DEFAULT_PREFIX,
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
    Validate,
    WaitSource,
    check_liveness_ttl,
    liveness_ttl,
)
from rallypoint.goodput import Accountant as GoodputAccountant
from rallypoint.goodput import account as goodput_account
from rallypoint.goodput import stall as goodput_stall
from rallypoint.hookspecs import hookimpl
from rallypoint.interfaces import (
    Assignment,
    CheckpointError,
    CheckpointStorage,
    CoordinationStore,
    RendezvousFailed,
    RendezvousHandler,
    RendezvousTimeout,
    StoreError,
    StoreUnavailable,
)
from rallypoint.redact import redact_endpoint, redact_urls
from rallypoint.rendezvous.endpoints import parse_endpoint
from rallypoint.rendezvous.liveness import CounterLiveness
from rallypoint.rendezvous.memory_store import MemoryStore

__all__ = [
    "AGENT_STARTED",
    "AGENT_STOPPING",
    "CHECKPOINT_LOADED",
    "CHECKPOINT_SAVED",
    "COMMON_RENDEZVOUS_OPTIONS",
    "DEFAULT_PREFIX",
    "HANG_DETECTED",
    "NODES_WAITING",
    "PEER_REFUSED",
    "PROGRESS",
    "RENDEZVOUS_COMPLETED",
    "RENDEZVOUS_STARTED",
    "SCALE_CHANGED",
    "STRAGGLER",
    "WORKERS_RESTARTED",
    "WORKERS_STARTED",
    "WORKER_FAILED",
    "Assignment",
    "CheckpointBackend",
    "CheckpointError",
    "CheckpointStorage",
    "ConfigOption",
    "CoordinationStore",
    "CounterLiveness",
    "Event",
    "EventSink",
    "GoodputAccountant",
    "MemoryStore",
    "MetricsSink",
    "NodeSpec",
    "RallypointError",
    "RankAssigner",
    "RendezvousBackend",
    "RendezvousFailed",
    "RendezvousHandler",
    "RendezvousRequest",
    "RendezvousTimeout",
    "RestartDecision",
    "RestartPolicy",
    "RestartRequest",
    "RoundInfo",
    "RunInfo",
    "SinkContext",
    "StoreError",
    "StoreUnavailable",
    "UsageError",
    "Validate",
    "WaitSource",
    "WorkerFailure",
    "check_liveness_ttl",
    "goodput_account",
    "goodput_stall",
    "hookimpl",
    "liveness_ttl",
    "parse_endpoint",
    "redact_endpoint",
    "redact_urls",
]

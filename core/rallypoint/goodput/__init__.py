"""Goodput: where every second of a job went, from its agents' events.

Each node's time, from its agent's first event to its last, is split into the phases of
``phases.TABLE`` (startup, rendezvous, training, checkpoint, detection, restart, loading,
redone, stopping); goodput is training's share. Training is what stayed done: the steps
a restart did again are ``redone``, counted lost.

Steps come from the workers' progress (``progress`` events, checkpoint saves and loads;
see ``rallypoint.progress``). A script that reports none is accounted at phase level only:
its redone time is counted as training, and ``Account.steps_known`` says so.

One ``Accountant`` (``accountant.py``) serves every reader: ``rallypoint report`` over the
event logs (``event_logs.py``), the Prometheus sink live (``Accountant.snapshot``) and the
goodput benchmark.
"""

from rallypoint.goodput.account import (
    MEMBERSHIP,
    Account,
    Attempt,
    Incident,
    Node,
    Segment,
    Snapshot,
)
from rallypoint.goodput.accountant import Accountant, account
from rallypoint.goodput.event_logs import load, read
from rallypoint.goodput.phases import (
    CHECKPOINT,
    DETECTION,
    LOADING,
    PHASES,
    REDONE,
    RENDEZVOUS,
    RESTART,
    STARTUP,
    STOPPING,
    TABLE,
    TRAINING,
    Phase,
)
from rallypoint.goodput.stalls import stall
from rallypoint.goodput.summary import (
    NO_STEPS,
    recovery_facts,
    skipped_line,
    straggler_line,
    summary,
)

__all__ = [
    "CHECKPOINT",
    "DETECTION",
    "LOADING",
    "MEMBERSHIP",
    "NO_STEPS",
    "PHASES",
    "REDONE",
    "RENDEZVOUS",
    "RESTART",
    "STARTUP",
    "STOPPING",
    "TABLE",
    "TRAINING",
    "Account",
    "Accountant",
    "Attempt",
    "Incident",
    "Node",
    "Phase",
    "Segment",
    "Snapshot",
    "account",
    "load",
    "read",
    "recovery_facts",
    "skipped_line",
    "stall",
    "straggler_line",
    "summary",
]

"""The phases a node's time is split into: one table of their names, what each is and its
colour, for every reader of the account (the report's text and page, the metrics, the
docs: docs/report.md says more of each)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """One phase: its ``name`` (the key of every account), what it is in a few words, and
    its colour on the report's timeline and tables."""

    name: str
    meaning: str
    colour: str


STARTUP = "startup"
RENDEZVOUS = "rendezvous"
TRAINING = "training"
CHECKPOINT = "checkpoint"
DETECTION = "detection"
RESTART = "restart"
LOADING = "loading"
REDONE = "redone"
STOPPING = "stopping"

#: Every phase, in the order a job goes through them.
TABLE = (
    Phase(STARTUP, "the agent and its first workers starting, up to their first step", "#9aa5b1"),
    Phase(RENDEZVOUS, "waiting for nodes and forming a round", "#845ef7"),
    Phase(TRAINING, "steps that stayed done: the productive time", "#2f9e44"),
    Phase(CHECKPOINT, "training held up by a checkpoint save", "#1c7ed6"),
    Phase(DETECTION, "from a worker's failure to its agent noticing it", "#e8590c"),
    Phase(RESTART, "stopping the workers and starting new ones, up to their first step", "#fab005"),
    Phase(LOADING, "the new workers loading the checkpoint they resume from", "#15aabf"),
    Phase(REDONE, "steps done again after a restart (lost work)", "#e64980"),
    Phase(STOPPING, "the workers done, the agent leaving", "#ced4da"),
)
#: The names of ``TABLE``, in its order.
PHASES = tuple(phase.name for phase in TABLE)

"""The account of a job: every node's timeline in phases, its rounds, saves and loads, and the
failures of the job with the time each took to detect and to recover from."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rallypoint.goodput.phases import PHASES, TRAINING

#: The cause of a round ended by the job's nodes changing (a node lost, or one joining).
MEMBERSHIP = "membership"


@dataclass(frozen=True)
class Segment:
    """``start`` to ``end`` (wall time) of one node, spent in ``phase``."""

    start: float
    end: float
    phase: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Attempt:
    """One round's workers on one node: when they ran, and how they ended."""

    round: int
    start: float
    world_size: int = 0
    end: float | None = None
    loaded: int | None = None  # the step it resumed from (a checkpoint load)
    load: tuple[float, float] | None = None  # when it loaded (start, end)
    #: (cause, failed at, noticed at: None when only the round's end was seen)
    failure: tuple[str, float, float | None] | None = None
    succeeded: bool = False


@dataclass
class Node:
    """One agent's account: its segments, rounds, saves and loads."""

    node: str
    host: str
    segments: list[Segment]
    attempts: list[Attempt]
    saves: list[tuple[float, int]]  # (wall time, step)
    loads: list[tuple[float, int, str]]  # (wall time, step, source)
    start: float
    end: float

    def seconds(self, phase: str) -> float:
        return sum(s.seconds for s in self.segments if s.phase == phase)


@dataclass(frozen=True)
class Incident:
    """A round the job left for a failure: the first failure of it, on any node."""

    round: int
    at: float
    node: str
    cause: str
    detect_seconds: float | None  # from the failure to its agent noticing it
    recover_seconds: float | None  # from the failure to the workers' first step after it
    steps_redone: int | None


@dataclass
class Account:
    """The job's account: every node's, and the sums."""

    nodes: list[Node]
    incidents: list[Incident]
    stragglers: list[dict[str, Any]]
    steps_known: bool
    skipped_lines: int = 0

    @property
    def phases(self) -> dict[str, float]:
        """Node-seconds per phase, every phase named."""
        return {phase: sum(node.seconds(phase) for node in self.nodes) for phase in PHASES}

    @property
    def total(self) -> float:
        return sum(node.end - node.start for node in self.nodes)

    @property
    def wall(self) -> float:
        """Seconds from the job's first event to its last."""
        if not self.nodes:
            return 0.0
        return max(n.end for n in self.nodes) - min(n.start for n in self.nodes)

    @property
    def goodput(self) -> float | None:
        """Productive training over all node-time (None without any)."""
        total = self.total
        return self.phases[TRAINING] / total if total > 0 else None

    @property
    def steps_redone(self) -> int:
        return steps_redone(self.incidents)

    def recoveries(self) -> list[float]:
        """Each failure's time to recover, where the workers stepped again after it."""
        return [i.recover_seconds for i in self.incidents if i.recover_seconds is not None]

    def detections(self) -> list[float]:
        """Each failure's time to detect, where a worker's failure timed it."""
        return [i.detect_seconds for i in self.incidents if i.detect_seconds is not None]

    def to_json(self) -> dict[str, Any]:
        """What ``rallypoint report --json`` prints."""
        recover = self.recoveries()
        return {
            "goodput": self.goodput,
            "wall_seconds": self.wall,
            "node_seconds": self.total,
            "phases": self.phases,
            "steps_known": self.steps_known,
            "steps_redone": self.steps_redone,
            "failures": len(self.incidents),
            "failures_by_cause": self.causes(),
            "mean_time_between_failures": self.mtbf(),
            "recover_seconds": {
                "mean": statistics.fmean(recover) if recover else None,
                "worst": max(recover) if recover else None,
            },
            "incidents": [vars(i) for i in self.incidents],
            "stragglers": self.stragglers,
            "nodes": [_node_json(n) for n in self.nodes],
            "skipped_lines": self.skipped_lines,
        }

    def causes(self) -> dict[str, int]:
        return causes(self.incidents)

    def mtbf(self) -> float | None:
        """Mean time between failures: the job's wall time over its failures."""
        return self.wall / len(self.incidents) if self.incidents else None


@dataclass(frozen=True)
class Snapshot:
    """The account's sums at one moment, without the timelines: what a live reader serves
    (the Prometheus sink, at every scrape)."""

    phases: dict[str, float]  # node-seconds per phase, every phase named
    total: float  # node-seconds
    incidents: tuple[Incident, ...] = ()
    stragglers: int = 0  # straggler events
    steps_known: bool = False

    @property
    def goodput(self) -> float | None:
        """Productive training over all node-time (None without any)."""
        return self.phases[TRAINING] / self.total if self.total > 0 else None

    @property
    def steps_redone(self) -> int:
        return steps_redone(self.incidents)

    def causes(self) -> dict[str, int]:
        return causes(self.incidents)


def causes(incidents: Iterable[Incident]) -> dict[str, int]:
    """Failures by cause, the most frequent first."""
    counts: dict[str, int] = {}
    for incident in incidents:
        counts[incident.cause] = counts.get(incident.cause, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def steps_redone(incidents: Iterable[Incident]) -> int:
    return sum(i.steps_redone or 0 for i in incidents)


def _node_json(node: Node) -> dict[str, Any]:
    return {
        "node": node.node,
        "host": node.host,
        "start": node.start,
        "end": node.end,
        "phases": {phase: node.seconds(phase) for phase in PHASES},
        "rounds": [
            {"round": a.round, "start": a.start, "end": a.end, "world_size": a.world_size}
            for a in node.attempts
        ],
        "segments": [[s.start, s.end, s.phase] for s in node.segments],
        "saves": node.saves,
        "loads": node.loads,
    }

"""Goodput: where every second of a job went, from its agents' event logs.

Each node's time, from its agent's first event to its last, is split into phases:

- ``startup``: the agent and its first workers starting, up to their first step;
- ``rendezvous``: waiting for nodes and forming a round;
- ``training``: steps that stayed done (the productive time: goodput is its share);
- ``checkpoint``: training held up by a save (its ``blocked_seconds``, on every node);
- ``detection``: from a worker's failure to the agent noticing it;
- ``restart``: stopping the workers and starting new ones, up to their first step;
- ``loading``: the workers loading the checkpoint they resume from;
- ``redone``: training after a restart up to the step the job had reached before it
  (counted lost: those steps were done already);
- ``stopping``: the workers done, the agent leaving.

Steps come from the workers' progress (``progress`` events, checkpoint saves and loads;
see ``rallypoint.heartbeat``). A script that reports none is accounted at phase level only:
its redone time is counted as training, and ``Account.steps_known`` says so.

One ``account`` serves every reader: ``rallypoint report``, the Prometheus sink (live:
``now`` ends the open phase) and the goodput benchmark.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rallypoint import events as ev
from rallypoint.errors import UsageError

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
PHASES = (STARTUP, RENDEZVOUS, TRAINING, CHECKPOINT, DETECTION, RESTART, LOADING, REDONE, STOPPING)
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
    """One round's workers on one node: when they ran, and the steps they reported."""

    round: int
    start: float
    world_size: int = 0
    end: float | None = None
    marks: list[tuple[float, int]] = field(default_factory=list)  # (wall time, step)
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
        return sum(i.steps_redone or 0 for i in self.incidents)

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
            "nodes": [
                {
                    "node": n.node,
                    "host": n.host,
                    "start": n.start,
                    "end": n.end,
                    "phases": {phase: n.seconds(phase) for phase in PHASES},
                    "rounds": [
                        {
                            "round": a.round,
                            "start": a.start,
                            "end": a.end,
                            "world_size": a.world_size,
                        }
                        for a in n.attempts
                    ],
                    "segments": [[s.start, s.end, s.phase] for s in n.segments],
                    "saves": n.saves,
                    "loads": n.loads,
                }
                for n in self.nodes
            ],
            "skipped_lines": self.skipped_lines,
        }

    def causes(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for incident in self.incidents:
            counts[incident.cause] = counts.get(incident.cause, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def mtbf(self) -> float | None:
        """Mean time between failures: the job's wall time over its failures."""
        return self.wall / len(self.incidents) if self.incidents else None


# --- reading ------------------------------------------------------------------------------


def read(paths: Sequence[str | Path]) -> tuple[list[dict[str, Any]], int]:
    """The events of the logs at ``paths`` (files, or directories of ``*.jsonl``), and how
    many lines were not events (a line cut short when an agent was killed, say).

    Raises:
        UsageError: a path that does not exist, or holds no event at all, in one sentence.
    """
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = sorted(path.rglob("*.jsonl"))
            if not found:
                raise UsageError(f"{path} holds no event log (*.jsonl)")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{path}: no such event log")
    records: list[dict[str, Any]] = []
    skipped = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            raise UsageError(f"cannot read {path}: {error.strerror or error}") from None
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                skipped += bool(line.strip())
                continue
            if isinstance(record, dict) and _event(record):
                records.append(record)
            else:
                skipped += 1
    if not records:
        raise UsageError(
            f"{', '.join(map(str, paths))}: no rallypoint event in it "
            "(write one with rallypoint run --event-log FILE)"
        )
    return records, skipped


def _event(record: Mapping[str, Any]) -> bool:
    return (
        isinstance(record.get("event"), str)
        and isinstance(record.get("node"), str)
        and _number(record.get("wall_time"))
    )


# --- accounting ---------------------------------------------------------------------------


def account(records: Iterable[Mapping[str, Any]], now: float | None = None) -> Account:
    """The account of the events ``records`` (any nodes, any order). ``now``: the wall time
    a live account ends at (the open phase of each node lasts until then); else each node
    ends at its last event."""
    by_node: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        if _event(record):
            by_node.setdefault(str(record["node"]), []).append(record)
    nodes = [
        _timeline(sorted(rs, key=lambda r: float(r["wall_time"])), now) for rs in by_node.values()
    ]
    nodes.sort(key=lambda n: (n.start, n.node))
    marks = sorted((t, step) for n in nodes for a in n.attempts for t, step in a.marks)
    steps_known = bool(marks)
    times = [t for t, _ in marks]
    highest = list(itertools.accumulate((step for _, step in marks), max))

    def reached_before(at: float) -> int | None:
        """The job's newest step reported before ``at``, on any node."""
        index = bisect.bisect_left(times, at)
        return highest[index - 1] if index else None

    stalls = _stalls(r for rs in by_node.values() for r in rs)
    redone: dict[int, int] = {}  # round -> steps redone in it
    for node in nodes:
        for attempt in node.attempts:
            _paint_attempt(node, attempt, steps_known, reached_before, redone)
        node.segments = _merged(_painted(node.segments, stalls, CHECKPOINT))
    incidents = _incidents(nodes, redone)
    stragglers = [dict(r) for rs in by_node.values() for r in rs if r.get("event") == ev.STRAGGLER]
    return Account(nodes, incidents, stragglers, steps_known)


def _timeline(records: list[Mapping[str, Any]], now: float | None) -> Node:
    """One node's base segments (training not yet split) and attempts."""
    node = _Builder(float(records[0]["wall_time"]))
    for record in records:
        if node.add(record):
            break  # the agent stopped: nothing of it comes after
    last = float(records[-1]["wall_time"])
    end = last if node.stopped or now is None else max(last, now)
    node.close(end, node.state)
    host = str(records[0].get("host") or "")
    return Node(
        str(records[0]["node"]), host, node.segments, node.attempts, node.saves, node.loads,
        node.first, end,
    )  # fmt: skip


class _Builder:
    """One node's segments, attempts, saves and loads, event by event."""

    def __init__(self, first: float) -> None:
        self.first = first
        self.segments: list[Segment] = []
        self.attempts: list[Attempt] = []
        self.saves: list[tuple[float, int]] = []
        self.loads: list[tuple[float, int, str]] = []
        self.state, self.since = STARTUP, first
        self.attempt: Attempt | None = None
        self.stopped = False

    def close(self, at: float, next_state: str) -> None:
        """The current phase ends at ``at`` (never before it began); ``next_state`` begins."""
        at = max(at, self.since)
        if at > self.since:
            self.segments.append(Segment(self.since, at, self.state))
        self.state, self.since = next_state, at

    def add(self, record: Mapping[str, Any]) -> bool:
        """Take one event; whether it was the agent's last (``agent_stopping``)."""
        name, at, attempt = record["event"], float(record["wall_time"]), self.attempt
        if name == ev.RENDEZVOUS_STARTED:
            self._end_attempt(at)
            self.close(at, RENDEZVOUS)
        elif name == ev.RENDEZVOUS_COMPLETED:
            self.close(at, RESTART if self.attempts else STARTUP)
        elif name == ev.WORKERS_STARTED:
            self.close(at, TRAINING)
            self.attempt = Attempt(_int(record.get("round")), at, _int(record.get("world_size")))
            self.attempts.append(self.attempt)
        elif attempt is None:
            pass  # a worker's event before any workers: nothing to account it to
        elif name in (ev.PROGRESS, ev.CHECKPOINT_SAVED):
            step = _get(record, "step")
            if step is not None and attempt.end is None:
                attempt.marks.append((at, int(step)))
            if name == ev.CHECKPOINT_SAVED and step is not None:
                self.saves.append((at, int(step)))
        elif name == ev.CHECKPOINT_LOADED:
            self._loaded(attempt, record, at)
        elif name == ev.WORKER_FAILED and attempt.failure is None:
            failed = min(max(_get(record, "timestamp") or at, attempt.start), at)
            noticed = min(max(_get(record, "detected") or at, failed), at)
            attempt.failure, attempt.end = (_cause(record), failed, noticed), failed
            if self.state == TRAINING:
                self.close(failed, DETECTION)
                self.close(noticed, RESTART)
        elif name == ev.WORKERS_RESTARTED:
            ended = self._end_attempt(at)
            if record.get("cause") == MEMBERSHIP and (ended or attempt.failure is not None):
                # A node was lost (or came): that, not the error it caused here, is the cause.
                _, lost_at, seen_at = attempt.failure or (MEMBERSHIP, at, None)
                attempt.failure = (MEMBERSHIP, lost_at, seen_at)
            self.close(at, RESTART)
        if name == ev.AGENT_STOPPING:
            if self._end_attempt(at) and attempt is not None:
                attempt.succeeded = record.get("exit_code") == 0
            self.close(at, STOPPING)
            self.stopped = True
        return self.stopped

    def _end_attempt(self, at: float) -> bool:
        """End the running attempt at ``at``; whether there was one."""
        if self.attempt is None or self.attempt.end is not None:
            return False
        self.attempt.end = at
        return True

    def _loaded(self, attempt: Attempt, record: Mapping[str, Any], at: float) -> None:
        step = _get(record, "step")
        if step is None:
            return
        attempt.loaded = int(step)
        self.loads.append((at, int(step), str(record.get("source") or "durable")))
        start = max(attempt.start, at - (_get(record, "seconds") or 0.0))
        attempt.load = (min(start, attempt.load[0]) if attempt.load else start, at)


def _paint_attempt(
    node: Node,
    attempt: Attempt,
    steps_known: bool,
    reached_before: Callable[[float], int | None],
    redone: dict[int, int],
) -> None:
    """Split one attempt's training: start-up (or restart) until its first step, the load,
    then steps redone until the job's step before this attempt is reached again."""
    end = attempt.end if attempt.end is not None else node.end
    # A node's first workers start up (a node joining a running job included); later
    # ones restart.
    getting_ready = STARTUP if attempt is node.attempts[0] else RESTART
    if not attempt.marks:
        if steps_known:  # the job reports steps, and these workers made none: never got going
            _paint(node.segments, attempt.start, end, getting_ready)
        return  # else no steps anywhere: all training, as far as anyone can tell
    # Training begins when the checkpoint is loaded, or one step before the first step.
    first_at = attempt.marks[0][0]
    if attempt.load is not None:
        _paint(node.segments, attempt.start, attempt.load[0], getting_ready)
        _paint(node.segments, attempt.load[0], attempt.load[1], LOADING)
        began = attempt.load[1]
    else:
        began = max(attempt.start, first_at - _step_seconds(attempt.marks))
        _paint(node.segments, attempt.start, began, getting_ready)
    target = reached_before(attempt.start)
    if target is None:
        return
    # Without a load (a script that checkpoints its own way), the step before its first.
    resumed = attempt.loaded if attempt.loaded is not None else attempt.marks[0][1] - 1
    redone[attempt.round] = max(redone.get(attempt.round, 0), target - resumed, 0)
    if resumed >= target:
        return
    _paint(node.segments, began, min(end, _time_of(attempt.marks, target, end)), REDONE)


def _time_of(marks: list[tuple[float, int]], step: int, default: float) -> float:
    """When ``step`` was reached, from the marks either side of it."""
    previous: tuple[float, int] | None = None
    for at, reached in marks:
        if reached >= step:
            if previous is None or reached == previous[1]:
                return at
            share = (step - previous[1]) / (reached - previous[1])
            return previous[0] + share * (at - previous[0])
        previous = (at, reached)
    return default


def _step_seconds(marks: list[tuple[float, int]]) -> float:
    if len(marks) < 2 or marks[-1][1] == marks[0][1]:
        return 0.0
    return (marks[-1][0] - marks[0][0]) / (marks[-1][1] - marks[0][1])


def stall(record: Mapping[str, Any]) -> tuple[float, float] | None:
    """When a ``checkpoint_saved`` record's save held training up (start, end): its
    ``blocked_seconds`` from the save's start (``wall_time`` is its end); None if not."""
    seconds, blocked = _get(record, "seconds"), _get(record, "blocked_seconds")
    if seconds is None or blocked is None or blocked <= 0:
        return None
    start = float(record["wall_time"]) - seconds
    return start, start + blocked


def _stalls(records: Iterable[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """When saves held training up."""
    found = (stall(r) for r in records if r.get("event") == ev.CHECKPOINT_SAVED)
    return sorted(s for s in found if s is not None)


def _paint(segments: list[Segment], start: float, end: float, phase: str) -> None:
    """Give ``phase`` to the training time of ``segments`` between ``start`` and ``end``."""
    segments[:] = _painted(segments, [(start, end)], phase)


def _painted(
    segments: list[Segment], spans: list[tuple[float, float]], phase: str
) -> list[Segment]:
    """``segments`` (in time order) with their training time inside ``spans`` given to
    ``phase``: one pass over both, so that a save every step of a long job stays cheap."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out: list[Segment] = []
    first = 0  # the first span that may still overlap a segment
    for segment in segments:
        if segment.phase != TRAINING:
            out.append(segment)
            continue
        while first < len(merged) and merged[first][1] <= segment.start:
            first += 1
        cursor = segment.start
        index = first
        while index < len(merged) and merged[index][0] < segment.end:
            start, end = max(merged[index][0], cursor), min(merged[index][1], segment.end)
            if start > cursor:
                out.append(Segment(cursor, start, TRAINING))
            out.append(Segment(start, end, phase))
            cursor = end
            if merged[index][1] > segment.end:
                break  # it goes on into a later segment
            index += 1
        if cursor < segment.end:
            out.append(Segment(cursor, segment.end, TRAINING))
    return out


def _merged(segments: list[Segment]) -> list[Segment]:
    """Neighbours in the same phase made one."""
    merged: list[Segment] = []
    for segment in segments:
        if merged and merged[-1].phase == segment.phase and merged[-1].end >= segment.start:
            merged[-1] = Segment(merged[-1].start, segment.end, segment.phase)
        else:
            merged.append(segment)
    return merged


def _incidents(nodes: list[Node], redone: dict[int, int]) -> list[Incident]:
    """One per round left for a failure: its earliest failure over the nodes."""
    by_round: dict[int, list[tuple[Node, Attempt]]] = {}
    for node in nodes:
        for attempt in node.attempts:
            by_round.setdefault(attempt.round, []).append((node, attempt))
    rounds = sorted(by_round)
    incidents = []
    for position, round_ in enumerate(rounds):
        failed = [(n, a) for n, a in by_round[round_] if a.failure is not None]
        if not failed or _grew(by_round, rounds, position):
            continue  # no failure, or only a node joining: no failure either
        # A worker's failure is the cause; a membership change only when no worker failed.
        node, attempt = min(
            failed,
            key=lambda na: (na[1].failure[0] == MEMBERSHIP, na[1].failure[1]),  # type: ignore[index]
        )
        assert attempt.failure is not None
        cause, at, noticed = attempt.failure
        later = [a for r in rounds[position + 1 :] for _, a in by_round[r]]
        resumed = [a.marks[0][0] for a in later if a.marks and a.marks[0][0] > at]
        incidents.append(
            Incident(
                round=round_,
                at=at,
                node=node.node,
                cause=cause,
                detect_seconds=None if noticed is None else noticed - at,
                recover_seconds=min(resumed) - at if resumed else None,
                steps_redone=redone.get(rounds[position + 1])
                if position + 1 < len(rounds)
                else None,
            )
        )
    return incidents


def _grew(by_round: Mapping[int, list[tuple[Node, Attempt]]], rounds: list[int], at: int) -> bool:
    """Whether round ``rounds[at]`` ended only for the job's nodes changing (no worker
    failed on any node) and the next round is larger: a node joined, nothing failed."""
    attempts = [a for _, a in by_round[rounds[at]]]
    if at + 1 >= len(rounds) or any(a.failure and a.failure[2] is not None for a in attempts):
        return False
    size = max(a.world_size for a in attempts)
    return max(a.world_size for _, a in by_round[rounds[at + 1]]) > size


def _cause(record: Mapping[str, Any]) -> str:
    """A failure's cause in a word or two: ``SIGKILL``, ``exit code 1``, ``out of memory``,
    ``watchdog``."""
    if record.get("out_of_memory"):
        return "out of memory"
    if record.get("stalled_seconds") is not None:
        return "watchdog"
    if record.get("signal"):
        return str(record["signal"])
    code = record.get("exit_code")
    return f"exit code {code}" if code is not None else "unknown"


def _get(record: Mapping[str, Any], key: str) -> float | None:
    """``record[key]`` when it is a finite number, else None."""
    value: Any = record.get(key)
    return float(value) if _number(value) else None


def _int(value: Any) -> int:
    return int(value) if _number(value) else 0


def _number(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


# --- the terminal summary ------------------------------------------------------------------


def summary(account: Account) -> str:
    """The report a terminal shows: goodput, time per phase, failures and recoveries."""
    lines = []
    goodput = account.goodput
    nodes = len(account.nodes)
    head = "goodput unknown (no time accounted)" if goodput is None else f"goodput {goodput:.1%}"
    lines.append(
        f"{head}: {nodes} node{'s' if nodes != 1 else ''}, {account.wall:.0f} s of wall time "
        f"({account.total:.0f} node-seconds)"
    )
    if not account.steps_known:
        lines.append(f"  {NO_STEPS}")
    total = account.total or 1.0
    lines.append("")
    lines.append(f"  {'phase':<12}{'seconds':>10}{'share':>8}")
    for phase, seconds in account.phases.items():
        if seconds > 0 or phase == TRAINING:
            lines.append(f"  {phase:<12}{seconds:>10.1f}{seconds / total:>8.1%}")
    lines.append("")
    incidents = account.incidents
    if not incidents:
        lines.append("no failures")
    else:
        causes = ", ".join(f"{cause} {count}" for cause, count in account.causes().items())
        mtbf = account.mtbf()
        lines.append(
            f"failures: {len(incidents)} ({causes}); mean time between failures {mtbf:.0f} s"
            if mtbf is not None
            else f"failures: {len(incidents)} ({causes})"
        )
        lines += recovery_facts(account)
    lines += [straggler_line(s) for s in account.stragglers]
    if account.skipped_lines:
        lines.append(f"({skipped_line(account)})")
    return "\n".join(lines)


#: What a report says of a job whose workers reported no steps.
NO_STEPS = (
    "the workers reported no steps (rallypoint.heartbeat(step=...), a checkpoint save, the "
    "ElasticSampler or rallypoint.metrics.step): steps redone after a restart count as training"
)


def straggler_line(straggler: Mapping[str, Any]) -> str:
    """A ``straggler`` event as a report says it."""
    return (
        f"straggler: node {straggler.get('node')} worked "
        f"{_float(straggler.get('pace')):.3f} s per step, "
        f"{_float(straggler.get('ratio')):.1f}x the median of the others"
    )


def skipped_line(account: Account) -> str:
    return f"{account.skipped_lines} lines of the logs were not events: skipped"


def recovery_facts(account: Account) -> list[str]:
    """Time to recover and to detect, and the steps redone, as the report says them."""
    facts = []
    recover = account.recoveries()
    if recover:
        facts.append(
            f"time to recover: mean {statistics.fmean(recover):.1f} s, worst {max(recover):.1f} s"
        )
    detect = account.detections()
    if detect:
        facts.append(f"time to detect: mean {statistics.fmean(detect):.2f} s")
    if account.steps_known:
        facts.append(f"steps redone: {account.steps_redone}")
    return facts


def _float(value: Any) -> float:
    return float(value) if _number(value) else math.nan

"""One node's timeline, event by event: the phases of its agent (a state machine over its
events, training not yet split), its attempts (one per round's workers) and its saves and
loads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rallypoint import events as ev
from rallypoint.goodput.account import MEMBERSHIP, Attempt, Segment
from rallypoint.goodput.attempts import Run, Steps
from rallypoint.goodput.fields import get, integer
from rallypoint.goodput.phases import (
    DETECTION,
    PHASES,
    RENDEZVOUS,
    RESTART,
    STARTUP,
    STOPPING,
    TRAINING,
)

#: Events whose step marks the workers' progress.
_MARKS = (ev.PROGRESS, ev.CHECKPOINT_SAVED)


class NodeTimeline:
    """One agent's phases, attempts, saves and loads, event by event. ``keep``: keep its
    segments, saves and loads (what a whole account shows), not only their seconds."""

    def __init__(self, node: str, host: str, first: float, keep: bool = True) -> None:
        self.node, self.host, self.keep = node, host, keep
        self.first = self.last = first
        self.segments: list[Segment] = []  # those ended, training not yet split
        self.spent = dict.fromkeys(PHASES, 0.0)  # their seconds, but training's
        self.runs: list[Run] = []
        self.saves: list[tuple[float, int]] = []
        self.loads: list[tuple[float, int, str]] = []
        self.state, self.since = STARTUP, first
        self.stopped = False

    @property
    def run(self) -> Run | None:
        return self.runs[-1] if self.runs else None

    def end(self, now: float | None) -> float:
        """Where the node's account ends: its last event, or ``now`` while it runs."""
        return self.last if self.stopped or now is None else max(self.last, now)

    def close(self, at: float, next_state: str) -> None:
        """The current phase ends at ``at`` (never before it began); ``next_state`` begins."""
        at = max(at, self.since)
        if self.state == TRAINING and self.run is not None and self.run.trained_to is None:
            self.run.trained_to = at
            self.run.segment = len(self.segments) if at > self.since else None
        if at > self.since:
            if self.keep:
                self.segments.append(Segment(self.since, at, self.state))
            if self.state != TRAINING:
                self.spent[self.state] += at - self.since
        self.state, self.since = next_state, at

    def add(self, name: str, at: float, data: Mapping[str, Any], steps: Steps) -> bool:
        """Take one event of this node; whether the job's incidents may have changed."""
        self.last = max(self.last, at)
        if self.stopped:
            return False  # nothing of the agent comes after its stop
        run = self.run
        if name == ev.RENDEZVOUS_STARTED:
            self._end_attempt(at)
            self.close(at, RENDEZVOUS)
        elif name == ev.RENDEZVOUS_COMPLETED:
            self.close(at, RESTART if self.runs else STARTUP)
        elif name == ev.WORKERS_STARTED:
            self.close(at, TRAINING)
            attempt = Attempt(integer(data.get("round")), at, integer(data.get("world_size")))
            self.runs.append(Run(attempt, not self.runs, steps.before(at), self.since))
            return True
        elif run is None:
            pass  # a worker's event before any workers: nothing to account it to
        elif name in _MARKS:
            return self._marked(run, name, at, data, steps)
        elif name == ev.CHECKPOINT_LOADED:
            return self._loaded(run.attempt, data, at)
        elif name == ev.WORKER_FAILED and run.attempt.failure is None:
            self._failed(run.attempt, data, at)
            return True
        elif name == ev.WORKERS_RESTARTED:
            self._restarted(run.attempt, data, at)
            return True
        if name == ev.AGENT_STOPPING:
            if self._end_attempt(at) and run is not None:
                run.attempt.succeeded = data.get("exit_code") == 0
            self.close(at, STOPPING)
            self.stopped = True
        return False

    def _marked(
        self, run: Run, name: str, at: float, data: Mapping[str, Any], steps: Steps
    ) -> bool:
        """A step reached; whether it was the attempt's first (it ends a recovery)."""
        step = get(data, "step")
        if step is None:
            return False
        if name == ev.CHECKPOINT_SAVED and self.keep:
            self.saves.append((at, int(step)))
        if run.attempt.end is not None:
            return False
        first = run.first_mark is None
        run.mark(at, int(step))
        steps.mark(at, int(step))
        return first

    def _loaded(self, attempt: Attempt, data: Mapping[str, Any], at: float) -> bool:
        step = get(data, "step")
        if step is None:
            return False
        attempt.loaded = int(step)
        if self.keep:
            self.loads.append((at, int(step), str(data.get("source") or "durable")))
        start = max(attempt.start, at - (get(data, "seconds") or 0.0))
        attempt.load = (min(start, attempt.load[0]) if attempt.load else start, at)
        return True

    def _failed(self, attempt: Attempt, data: Mapping[str, Any], at: float) -> None:
        failed = min(max(get(data, "timestamp") or at, attempt.start), at)
        noticed = min(max(get(data, "detected") or at, failed), at)
        attempt.failure, attempt.end = (cause(data), failed, noticed), failed
        if self.state == TRAINING:
            self.close(failed, DETECTION)
            self.close(noticed, RESTART)

    def _restarted(self, attempt: Attempt, data: Mapping[str, Any], at: float) -> None:
        ended = self._end_attempt(at)
        if data.get("cause") == MEMBERSHIP and (ended or attempt.failure is not None):
            # A node was lost (or came): that, not the error it caused here, is the cause.
            _, lost_at, seen_at = attempt.failure or (MEMBERSHIP, at, None)
            attempt.failure = (MEMBERSHIP, lost_at, seen_at)
        self.close(at, RESTART)

    def _end_attempt(self, at: float) -> bool:
        """End the running attempt at ``at``; whether there was one."""
        run = self.run
        if run is None or run.attempt.end is not None:
            return False
        run.attempt.end = at
        return True


def cause(data: Mapping[str, Any]) -> str:
    """A failure's cause in a word or two: ``SIGKILL``, ``exit code 1``, ``out of memory``,
    ``hang``, ``watchdog``."""
    if data.get("out_of_memory"):
        return "out of memory"
    if data.get("hang"):
        return "hang"
    if data.get("stalled_seconds") is not None:
        return "watchdog"
    if data.get("signal"):
        return str(data["signal"])
    code = data.get("exit_code")
    return f"exit code {code}" if code is not None else "unknown"

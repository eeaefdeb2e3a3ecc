"""The steps this node's workers reached, from their progress reports (the step each
gave last: ``rallypoint.progress(step=N)``, a checkpoint save, the ``ElasticSampler``).

The agent reports them as ``progress`` events: at most one every PROGRESS_INTERVAL while
the step moves, and one more when the attempt ends, so that the event log says which step
each attempt reached, when, and how long a step took here (``step_seconds``: the median
over the last STEP_WINDOW steps of every rank). ``rallypoint.goodput`` reads them to tell
redone training from progress; straggler detection compares ``step_seconds`` across
nodes.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

#: The shortest time between two progress events of one attempt (seconds).
PROGRESS_INTERVAL = 2.0
#: Steps per rank whose durations make up ``step_seconds``.
STEP_WINDOW = 20


class Progress:
    """The current attempt's steps, by local rank."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since = math.inf  # no attempt yet: every report is stale
        self._steps: dict[int, tuple[int, float]] = {}  # local rank -> (step, when)
        self._durations: dict[int, deque[float]] = {}
        self._reported: int | None = None  # the step of the last progress event
        self._reported_at = -math.inf

    def watch(self, started: float) -> None:
        """A new attempt's workers start at ``started`` (monotonic); forget the old ones."""
        with self._lock:
            self._since = started
            self._steps.clear()
            self._durations.clear()
            self._reported, self._reported_at = None, -math.inf

    def report(self, data: Mapping[str, Any]) -> None:
        """One progress report from the worker channel: ``local_rank``, ``step`` and
        ``step_at`` (when the worker reached it, on the host's monotonic clock)."""
        values: list[Any] = [data.get("local_rank"), data.get("step_at"), data.get("step")]
        if not all(finite(v) for v in values):
            return
        local_rank, sent, step = int(values[0]), float(values[1]), int(values[2])
        with self._lock:
            if sent < self._since:
                return  # an attempt already replaced
            before = self._steps.get(local_rank)
            if before is not None and step <= before[0]:
                return
            if before is not None:
                per_step = (sent - before[1]) / (step - before[0])
                self._durations.setdefault(local_rank, deque(maxlen=STEP_WINDOW)).append(per_step)
            self._steps[local_rank] = (step, sent)

    def step(self) -> int | None:
        """The newest step any worker of the attempt reported."""
        with self._lock:
            return max((s for s, _ in self._steps.values()), default=None)

    def step_seconds(self) -> float | None:
        """The median time of a step over the last STEP_WINDOW steps of every rank."""
        with self._lock:
            durations = [d for window in self._durations.values() for d in window]
        return statistics.median(durations) if durations else None

    def due(self, now: float, *, final: bool = False) -> dict[str, Any] | None:
        """The ``progress`` event's data when one is due: the step moved and
        PROGRESS_INTERVAL passed since the last (``final``: at the attempt's end, as soon as
        the step moved); else None."""
        step = self.step()
        if step is None or step == self._reported:
            return None
        if not final and now - self._reported_at < PROGRESS_INTERVAL:
            return None
        self._reported, self._reported_at = step, now
        seconds = self.step_seconds()
        return {"step": step} if seconds is None else {"step": step, "step_seconds": seconds}


def finite(value: object) -> bool:
    """A finite number that a float holds: what a worker's report may carry where a
    number goes (JSON's integers have no bound, and its floats may be inf or nan)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False

"""When checkpoint saves held training up: each save's stall, and their union over the job,
kept so that the stalled seconds of any stretch of time take two lookups."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from typing import Any

from rallypoint.goodput.fields import get


def stall(record: Mapping[str, Any]) -> tuple[float, float] | None:
    """When a ``checkpoint_saved`` record's save held training up (start, end): its
    ``blocked_seconds`` from the save's start (``wall_time`` is its end); None if not."""
    return stall_at(float(record["wall_time"]), record)


def stall_at(at: float, data: Mapping[str, Any]) -> tuple[float, float] | None:
    """``stall`` of a save that ended at ``at``, with the fields ``data``."""
    seconds, blocked = get(data, "seconds"), get(data, "blocked_seconds")
    if seconds is None or blocked is None or blocked <= 0:
        return None
    start = at - seconds
    return start, start + blocked


class Stalls:
    """The union of the job's stalls (every rank of every node holds the others up at the
    next collective): disjoint spans in time order, and the seconds of those up to each.

    A save is reported when it ends, so its stall goes in behind the newest ones: the spans
    after it are shifted, few in practice (the saves of the last few seconds)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.upto: list[float] = []  # seconds of the spans up to each, itself included

    def add(self, start: float, end: float) -> None:
        if end <= start:
            return
        # The spans it overlaps or touches become one with it.
        first = bisect.bisect_left(self.ends, start)
        after = bisect.bisect_right(self.starts, end)
        if first < after:
            start, end = min(start, self.starts[first]), max(end, self.ends[after - 1])
        self.starts[first:after] = [start]
        self.ends[first:after] = [end]
        lengths = (e - s for s, e in zip(self.starts[first:], self.ends[first:], strict=True))
        sums = itertools.accumulate(lengths, initial=self.upto[first - 1] if first else 0.0)
        next(sums)  # the seconds before the first span shifted: unchanged
        self.upto[first:] = sums

    def upto_time(self, at: float) -> float:
        """Stalled seconds before ``at``."""
        index = bisect.bisect_right(self.starts, at) - 1
        if index < 0:
            return 0.0
        return self.upto[index] - max(0.0, self.ends[index] - at)

    def within(self, start: float, end: float) -> float:
        """Stalled seconds between ``start`` and ``end``."""
        return self.upto_time(end) - self.upto_time(start) if end > start else 0.0

    def spans(self, start: float, end: float) -> list[tuple[float, float]]:
        """The spans that overlap ``start`` to ``end``, whole."""
        first = bisect.bisect_right(self.ends, start)
        after = bisect.bisect_left(self.starts, end)
        return list(zip(self.starts[first:after], self.ends[first:after], strict=True))

    def __len__(self) -> int:
        return len(self.starts)

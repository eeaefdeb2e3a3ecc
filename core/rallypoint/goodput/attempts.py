"""An attempt as the account follows it (``Run``): when it trained, and the few of its
steps that decide how its training splits; and the job's steps (``Steps``), which tell
each attempt where its redone steps end."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rallypoint.goodput.account import Attempt


class Steps:
    """The job's steps as the account needs them: whether any was reported, and the newest
    reported before a time (where an attempt's redone steps end). Marks come in time order;
    one that comes late counts as before every later one."""

    def __init__(self) -> None:
        self.known = False
        self._at = -math.inf  # the newest mark's time
        self._before: int | None = None  # the highest step marked before it
        self._then: int | None = None  # ... and at it

    def mark(self, at: float, step: int) -> None:
        self.known = True
        if at > self._at:
            self._before, self._then, self._at = _highest(self._before, self._then), step, at
        elif at == self._at:
            self._then = _highest(self._then, step)
        else:
            self._before = _highest(self._before, step)

    def before(self, at: float) -> int | None:
        """The job's highest step reported before ``at``, on any node."""
        return _highest(self._before, self._then) if at > self._at else self._before


def _highest(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


@dataclass
class Run:
    """One attempt as the account follows it: when it trained, and of its steps the first,
    the newest, and when it reached again the step the job had reached before it."""

    attempt: Attempt
    first: bool  # the node's first workers: they start up, later ones restart
    target: int | None  # the job's newest step before it began: redone until reached
    trained_from: float
    trained_to: float | None = None  # None while it trains
    first_mark: tuple[float, int] | None = None
    last_mark: tuple[float, int] | None = None
    reached: float | None = None  # when it reached ``target``
    segment: int | None = None  # its training's index in the node's segments
    split: dict[str, float] | None = None  # its training's phases, once it is over

    def mark(self, at: float, step: int) -> None:
        if self.first_mark is None:
            self.first_mark = (at, step)
        if self.target is not None and self.reached is None and step >= self.target:
            # Between the marks either side of the target step.
            previous = self.last_mark
            if previous is None or step == previous[1]:
                self.reached = at
            else:
                share = (self.target - previous[1]) / (step - previous[1])
                self.reached = previous[0] + share * (at - previous[0])
        self.last_mark = (at, step)

    def step_seconds(self) -> float:
        first, last = self.first_mark, self.last_mark
        if first is None or last is None or last[1] == first[1]:
            return 0.0
        return (last[0] - first[0]) / (last[1] - first[1])

    def resumed(self) -> int | None:
        """The step it resumed from: its load's, else (a script that checkpoints its own
        way) the one before its first."""
        if self.attempt.loaded is not None:
            return self.attempt.loaded
        return None if self.first_mark is None else self.first_mark[1] - 1

    def steps_redone(self) -> int | None:
        """Steps it did again: from the step it resumed from to the job's before it (None
        before its first step)."""
        resumed = self.resumed()
        if self.target is None or resumed is None or self.first_mark is None:
            return None
        return max(self.target - resumed, 0)

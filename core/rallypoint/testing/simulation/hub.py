"""Simulated time, and the threads of the simulated processes, one running at a time.

The handler that ships blocks: in store calls, in ``sleep``, on a ``threading.Event``. So
each simulated thread (a node's agent, its heartbeat) is a greenlet: it runs when the hub
switches to it, until it blocks in its world (``NodeWorld``: a store call, a pause, a
wait), which switches back. What wakes it is an event in the hub's queue, ordered by
simulated time and then by the order it was queued in: with one seed, every run is the
same run. (Greenlets rather than threads taking turns: a switch costs under a microsecond,
an OS thread's hand-over ten or more, and a thousand nodes make millions of them.)
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

import greenlet


class Killed(BaseException):
    """Raised in a thread of a killed process wherever it blocks: it unwinds, and nothing
    it does reaches the store. A ``BaseException``, so that no ``except Exception`` of
    the handler stops it."""


class Hub:
    """The simulated clock and the queue of what happens next."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.greenlet = greenlet.getcurrent()  # the hub's: where a blocked thread goes back
        self.running: Any = None  # the SimThread that has the turn
        self.events = 0

    def at(self, when: float, what: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (when, next(self._seq), what))

    def next_at(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def step(self) -> None:
        """Do the next thing in the queue."""
        when, _, what = heapq.heappop(self._queue)
        self.now = max(self.now, when)
        what()
        self.events += 1

    def current(self) -> Any:
        thread = self.running
        if thread is None:
            raise RuntimeError("a simulated world was used outside a simulated thread")
        return thread

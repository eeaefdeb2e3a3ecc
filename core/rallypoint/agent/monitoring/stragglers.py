"""Stragglers: a node whose workers work markedly longer per step than the round's others.

In a job whose every step ends in a collective (DDP, FSDP), every rank steps at the
slowest one's pace: the wall time of a step is the same everywhere, and what differs is
how long each rank works before it waits for the others. So a node's pace here is the
CPU time its least busy worker spends per step (``/proc/PID/stat``, every thread of the
worker, per step the workers reported), the median over the last PACE_WINDOW samples. The nodes share
their paces through the rendezvous store (``StoreRendezvous.pace``/``paces``); a node
whose pace is above ``--straggler-factor`` times the median of the others' is a
straggler. A rank waiting for a GPU in a busy loop (CUDA's default synchronisation) works
as long as it waits: there the CPU time hides the difference, and no node is named.
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

#: Samples (one per progress report of the agent) whose median is a node's pace.
PACE_WINDOW = 10
#: A pace needs this many samples before it counts: a node is not named on one step.
PACE_SAMPLES = 3

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Pace:
    """This node's workers' CPU seconds per step, sampled as the steps move: of its least
    busy worker, so that work only one rank does (rank 0 saving checkpoints, logging,
    evaluating) does not make its node look slow."""

    def __init__(self) -> None:
        self._last: tuple[dict[int, float], int] | None = None  # (CPU seconds by pid, step)
        self._samples: deque[float] = deque(maxlen=PACE_WINDOW)

    def reset(self) -> None:
        """A new attempt's workers: their CPU time starts again."""
        self._last = None
        self._samples.clear()

    def sample(self, pids: Iterable[int], step: int | None) -> None:
        if step is None:
            return
        cpu = {pid: _cpu_seconds(pid) for pid in pids}
        if self._last is not None and step > self._last[1]:
            before, steps = self._last[0], step - self._last[1]
            spent = [cpu[p] - before[p] for p in cpu if p in before and cpu[p] >= before[p]]
            if spent:
                self._samples.append(min(spent) / steps)
        if self._last is None or step > self._last[1]:
            self._last = (cpu, step)

    def seconds(self) -> float | None:
        """The median CPU seconds per step, once PACE_SAMPLES samples are in."""
        if len(self._samples) < PACE_SAMPLES:
            return None
        return statistics.median(self._samples)


def stragglers(paces: Mapping[str, float], factor: float) -> dict[str, dict[str, Any]]:
    """The nodes of ``paces`` (node id -> CPU seconds per step) above ``factor`` times the
    median of the others' paces, with the ``straggler`` event's fields (the node itself is
    the event's: only a straggler names itself)."""
    found = {}
    for node, pace in paces.items():
        others = [p for n, p in paces.items() if n != node]
        if not others:
            continue
        median = statistics.median(others)
        if median > 0 and pace > factor * median:
            found[node] = {"pace": pace, "median": median, "ratio": pace / median}
    return found


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of ``pid``, every thread (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15)

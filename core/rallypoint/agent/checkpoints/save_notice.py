"""Saves on notice, the agent's side (the worker's is ``rallypoint.worker.notice_watch``).

A node told to stop (SIGTERM, with checkpoints on) has every worker of the job save at one
step before the round changes: its agent picks the step (``notice_step``), gives the round
notice (``RendezvousHandler.give_notice``; every other agent reads it when the round
ends), and each agent writes the step into the file its workers map, then waits for
them to hold there. Only workers that watch for notices (they called ``should_save``)
are waited for: a script that never asks loses what it did since its last save, as
before, and its node leaves at once.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rallypoint.worker import channel, notice_watch

#: Seconds a notice needs to reach every worker: this node's (a file write), and another
#: node's (the round ends, its agent's monitor loop notices within --monitor-interval,
#: reads the step from the store and writes its file).
LOCAL_LEAD = 0.02
ROUND_LEAD = 0.3


def notice_step(step: int, step_seconds: float | None, *, several: bool) -> int:
    """The step to save at, from the newest step this node's workers reached: far enough
    ahead that every worker hears of it before it gets there (a worker that heard late
    saves where it is: a whole state is still whole; ranks' shares may then differ)."""
    lead = ROUND_LEAD if several else LOCAL_LEAD
    if step_seconds is None or step_seconds <= 0:
        return step + (3 if several else 2)
    return step + 1 + max(1, math.ceil(lead / step_seconds))


class SaveNotice:
    """The notice file of this node's workers, and what they said about it."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "save-notice"
        with open(self.path, "wb") as file:
            file.write(notice_watch.FORMAT.pack(notice_watch.NONE))
        self._file = open(self.path, "r+b")  # noqa: SIM115 (mapped until close)
        self._view = mmap.mmap(self._file.fileno(), notice_watch.FORMAT.size)
        self._changed = threading.Condition()
        self._watching: set[int] = set()  # local ranks that ask should_save
        self._held: dict[int, int] = {}  # local rank -> the step it holds at

    def message(self, name: str, data: dict[str, Any]) -> None:
        """A worker's notice message (the worker channel's thread)."""
        local_rank = data.get("local_rank")
        if not isinstance(local_rank, int):
            return
        with self._changed:
            if name == channel.NOTICE_WATCHING:
                self._watching.add(local_rank)
            elif name == channel.NOTICE_HELD and isinstance(data.get("step"), int):
                self._held[local_rank] = data["step"]
            self._changed.notify_all()

    def reset(self) -> None:
        """No notice, and nothing heard: before a new attempt's workers start."""
        with self._changed:
            self._write(notice_watch.NONE)
            self._watching.clear()
            self._held.clear()

    def watched(self, local_ranks: Iterable[int]) -> bool:
        """Whether every one of ``local_ranks`` watches for notices."""
        ranks = set(local_ranks)
        with self._changed:
            return bool(ranks) and ranks <= self._watching

    def give(self, step: int) -> None:
        with self._changed:
            self._write(step)

    def wait_held(
        self, step: int, running: Callable[[], list[int]], timeout: float
    ) -> tuple[list[int], int]:
        """Wait, at most ``timeout`` s, for every running worker (``running()``: their local
        ranks) to hold at ``step`` or later (later: it heard of the notice late). Those
        that did not, and the newest step one holds at."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                late = [r for r in running() if self._held.get(r, -1) < step]
                left = deadline - time.monotonic()
                if not late or left <= 0:
                    return late, max(self._held.values(), default=step)
                self._changed.wait(min(left, 0.05))  # exits are seen by polling

    def close(self) -> None:
        self._view.close()
        self._file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _write(self, step: int) -> None:
        notice_watch.FORMAT.pack_into(self._view, 0, step)

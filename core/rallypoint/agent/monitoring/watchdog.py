"""The progress watchdog (``--watchdog-timeout``): which workers stopped making progress.

Workers call ``rallypoint.heartbeat()`` (``rallypoint.worker.progress``); the heartbeats arrive on
the worker channel's receiver thread and are noted here by local rank. A worker is watched
from its first heartbeat on, so start-up (imports, the process group) never counts; once
watched, a worker whose last heartbeat is older than the timeout is overdue, and the agent
kills and restarts it like a worker that failed.

Heartbeats carry the worker's ``time.monotonic()`` (the host's clock): one sent before the
current workers started comes from an attempt already replaced, and is ignored.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any


class Watchdog:
    """Heartbeats of the current attempt's workers, and which of them are overdue."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._since = math.inf  # no attempt yet: every heartbeat is stale
        self._last: dict[int, float] = {}  # local rank -> monotonic time of its last heartbeat

    def watch(self, started: float) -> None:
        """A new attempt's workers start at ``started`` (monotonic); forget the old ones."""
        with self._lock:
            self._since = started
            self._last.clear()

    def beat(self, data: Mapping[str, Any]) -> None:
        """One heartbeat from the worker channel: ``local_rank`` and ``sent`` (monotonic)."""
        local_rank, sent = data.get("local_rank"), data.get("sent")
        if not isinstance(local_rank, int) or isinstance(local_rank, bool):
            return
        if not isinstance(sent, (int, float)) or isinstance(sent, bool) or sent != sent:
            return
        sent = min(float(sent), time.monotonic())
        with self._lock:
            if sent >= self._since and sent > self._last.get(local_rank, -math.inf):
                self._last[local_rank] = sent

    def last_heartbeat(self, local_rank: int) -> float | None:
        with self._lock:
            return self._last.get(local_rank)

    def overdue(self, local_ranks: Iterable[int], now: float) -> dict[int, float]:
        """Of ``local_ranks``, the watched ones silent for longer than the timeout, with
        the time of their last heartbeat."""
        with self._lock:
            last = {rank: self._last[rank] for rank in local_ranks if rank in self._last}
        return {rank: at for rank, at in last.items() if now - at >= self.timeout}

    def seconds_left(self, local_ranks: Iterable[int], now: float) -> float:
        """Seconds until the first of ``local_ranks`` is overdue (inf when none is watched)."""
        with self._lock:
            times = [self._last[rank] for rank in local_ranks if rank in self._last]
        if not times:
            return math.inf
        return max(0.0, min(times) + self.timeout - now)

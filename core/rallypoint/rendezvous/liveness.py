"""Liveness from a counter, for a coordination store with no expiry of its own (TCPStore).

The store interface is ``rallypoint.interfaces.CoordinationStore``; a backend implements
its few operations on its service (torch's TCPStore, etcd, Redis) and gets the whole
protocol of ``rendezvous.protocol``. ``rendezvous.memory.MemoryStore`` is the reference
implementation, in one process.
"""

from __future__ import annotations

import contextlib
import threading
import time

from rallypoint.interfaces import StoreError

#: What ``CounterLiveness.end_liveness`` adds to a counter: far below zero, for good.
_GONE = -(1 << 62)


class CounterLiveness:
    """``keep_alive`` and ``alive`` for a store with no expiry of its own (TCPStore).

    The owner bumps a counter; an observer remembers when it last saw the counter move.
    A counter never seen before, or not read for longer than ``ttl`` (the store was
    unreachable), starts a new observation instead of counting as dead: only time this
    observer could see the counter and it stood still counts. Clones share what they saw.
    An owner that closes its store (``end_liveness``) drops the counter below zero:
    dead at once.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float, float]] = {}  # value, moved at, read at
        self._lock = threading.Lock()
        self._kept: set[str] = set()  # the keys this connection kept alive

    def add(self, key: str, amount: int) -> int:
        raise NotImplementedError

    def keep_alive(self, key: str, ttl: float) -> None:
        self.add(key, 1)
        self._kept.add(key)

    def end_liveness(self) -> None:
        """The keys this connection kept alive are dead from now on (called by close)."""
        kept, self._kept = self._kept, set()
        for key in kept:
            with contextlib.suppress(StoreError):  # an unreachable store: they lapse
                self.add(key, _GONE)

    def alive(self, key: str, ttl: float) -> bool:
        value = self.add(key, 0)
        if value < 0:  # its owner closed: gone
            return False
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(key)
            if seen is None or seen[0] != value or now - seen[2] > ttl:
                self._seen[key] = (value, now, now)
                return True
            self._seen[key] = (value, seen[1], now)
            return now - seen[1] <= ttl

    def _share_liveness(self, clone: CounterLiveness) -> None:
        """``clone`` shares what this connection saw; what it keeps alive is its own."""
        clone._seen, clone._lock = self._seen, self._lock
        clone._kept = set()

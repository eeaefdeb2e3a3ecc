"""Liveness: from a counter, for a store with no expiry of its own (TCPStore); and a
node's own stalls, which keep it from taking the others for dead (``Stalls``).

The store interface is ``rallypoint.interfaces.CoordinationStore``; a backend implements
its few operations on its service (torch's TCPStore, etcd, Redis) and gets the whole
protocol of ``rendezvous.protocol``. ``rendezvous.memory_store.MemoryStore`` is the reference
implementation, in one process.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from rallypoint.interfaces import StoreError
from rallypoint.rendezvous.world import REAL, World

logger = logging.getLogger("rallypoint.rendezvous")

#: What ``CounterLiveness.end_liveness`` adds to a counter: far below zero, for good.
_GONE = -(1 << 62)


class CounterLiveness:
    """``keep_alive`` and ``alive`` for a store with no expiry of its own (TCPStore).

    The owner bumps a counter; an observer remembers when it last saw the counter move.
    A counter never seen before, or not read for longer than ``ttl`` (the store was
    unreachable), starts a new observation instead of counting as dead: only time this
    observer could see the counter and it stood still counts. Clones share what they saw.
    An owner that closes its store (``end_liveness``) drops the counter below zero:
    dead at once; unless ``trust_drops`` is off (a job whose records are sealed: anyone
    can add to a counter, so a drop proves nothing and its owner says "gone" otherwise,
    ``rendezvous.signing``).
    """

    trust_drops = True
    #: Whose clock says how long a counter stood still (the simulation gives its own).
    world: World = REAL

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
        if not self.trust_drops:
            return
        for key in kept:
            with contextlib.suppress(StoreError):  # an unreachable store: they lapse
                self.add(key, _GONE)

    def alive(self, key: str, ttl: float) -> bool:
        value = self.add(key, 0)
        if value < 0 and self.trust_drops:  # its owner closed: gone
            return False
        now = self.world.monotonic()
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
        clone.world = self.world


class Stalls:
    """This node's own stalls, and what they mean for taking another node for dead.

    A store call that came back only after more than ``ttl`` means the store was out of
    reach (frozen, restarting, cut off from this node) or this host stalled. The other
    nodes may not have been able to renew their liveness meanwhile either: none counts as
    dead for the next ``ttl`` (the grace), time enough for each to renew it. Both of a
    node's threads (joining, heartbeat) note stalls: a lock keeps each update whole.
    """

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.clock = clock
        self._lock = threading.Lock()
        self._grace_until = 0.0
        self._stalled_at = -float("inf")

    def note(self, since: float) -> None:
        """A store call begun at ``since`` (this clock) has just come back."""
        now = self.clock()
        if now - since <= self.ttl:
            return
        with self._lock:
            self._stalled_at = now
            warn = now >= self._grace_until
            self._grace_until = max(self._grace_until, now + self.ttl)
        if warn:
            logger.warning(
                "this node could not reach the rendezvous store for %.1f s: no node counts "
                "as dead for the next %g s (heartbeat_timeout), while each renews its liveness",
                now - since,
                self.ttl,
            )

    def in_grace(self) -> bool:
        """Whether no node may be taken for dead now (this node has just stalled)."""
        return self.clock() < self._grace_until

    def stalled_within(self, seconds: float) -> bool:
        """Whether this node came back from a stall within the last ``seconds``."""
        return self.clock() - self._stalled_at <= seconds

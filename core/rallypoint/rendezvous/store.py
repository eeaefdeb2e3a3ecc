"""The coordination-store interface the rendezvous protocol runs on.

A backend implements these few operations on its service (torch's TCPStore, etcd, Redis)
and gets the whole protocol of ``rendezvous.protocol``: membership, ranks, last call,
late joiners, dead-node detection, outage retries and the exit barrier.
``rendezvous.memory.MemoryStore`` is the reference implementation, in one process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from rallypoint.errors import RallypointError


class StoreError(RallypointError):
    """The store failed, or holds what it should not; the message names it and what to do."""


class StoreUnavailable(StoreError):
    """The store cannot be reached right now (restarting, failing over, network).

    The protocol retries the operation with backoff, for ``retry_timeout`` seconds, and
    leaves running workers alone meanwhile; any other ``StoreError`` ends the rendezvous.
    """


class CoordinationStore(Protocol):
    """Atomic operations on a shared key-value store. Keys are ``/``-separated text.

    Raise ``StoreUnavailable`` when the service cannot be reached (the operation will be
    retried) and ``StoreError`` for anything else; never the client library's own errors.
    """

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if absent); return the sum."""
        ...

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        """``add(key, amount)`` and ``get(other)``, in one request where the service
        allows (an etcd transaction, a Redis script): every node joins a round this way,
        taking its join number and reading the job's round at once. ``add`` then ``get``
        is a correct implementation; a store without this method gets just that."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value at ``key``, or ``None`` if there is none; never blocks."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values at ``keys``, in order (``None`` where absent), in as few requests as
        the service allows: the round's leader reads every joiner's record with it."""
        ...

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` at ``key``."""
        ...

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``None``: if it is absent).

        Returns the value ``key`` holds afterwards: ``desired`` when the swap happened,
        ``b""`` when ``key`` is absent and ``expected`` was not ``None``.
        """
        ...

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Block until every key exists (without polling); ``False`` after ``timeout`` s."""
        ...

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        """Block until ``key`` exists (without polling) and return its value; ``None``
        after ``timeout`` s. Every node reads the round's record this way once the leader
        has written it: a store whose notification carries the value (an etcd watch
        event, a Redis message) answers without another request. ``wait`` then ``get``
        is a correct implementation; a store without this method gets just that."""
        ...

    def keep_alive(self, key: str, ttl: float) -> None:
        """Say "``key``'s owner is alive" for ``ttl`` more seconds. The owner calls this
        every ``ttl / 3`` s; a lease (etcd) or a key expiry (Redis) ends it when they stop,
        and ``close`` ends it at once."""
        ...

    def alive(self, key: str, ttl: float) -> bool:
        """Whether ``key``'s owner called ``keep_alive`` within the last ``ttl`` seconds."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key that starts with ``prefix``, with the liveness kept under it (a
        key, or a key's expiry); return how many keys were deleted. The protocol calls it
        once a run has finished cleanly, with the run's root (``<prefix>/<run id>/``), so
        that a finished job leaves nothing behind. Liveness kept outside the key space (an
        etcd lease) is ended by ``close``. A ``wait`` on a deleted key waits for it to be
        set again."""
        ...

    def clone(self) -> CoordinationStore:
        """A second connection to the same store, for another thread."""
        ...

    def close(self) -> None:
        """Release the connection (and the server, if this process hosts it). The keys
        kept alive through this connection stop being alive now (etcd revokes the lease,
        Redis deletes the key): a node that leaves (its agent stopped, say by a
        preemption's SIGTERM) is seen gone at once, not ``heartbeat_timeout`` later."""
        ...


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

"""``MemoryStore``: the coordination store of one process.

It runs the rendezvous of a job of one node (``--standalone``, ``--nnodes 1``) through the
same protocol as every multi-node backend, without torch or a server. It is also the
shortest complete ``CoordinationStore``, and it passes the conformance suite: read it
first when writing a backend.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence


class _Shared:
    """The data every connection of one ``MemoryStore`` sees."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.values: dict[str, bytes] = {}
        self.expiry: dict[str, float] = {}  # keep_alive deadlines (on ``clock``)
        self.changed = threading.Condition()
        self.clock = clock


class MemoryStore:
    """``CoordinationStore`` in this process's memory, safe to share between threads.

    ``clock`` says when a kept key expires: the simulation
    (``rallypoint.testing.simulation``) gives its own."""

    def __init__(
        self, shared: _Shared | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._shared = shared or _Shared(clock)
        self._kept: set[str] = set()  # the keys this connection kept alive

    def add(self, key: str, amount: int) -> int:
        with self._shared.changed:
            value = int(self._shared.values.get(key, b"0")) + amount
            self._shared.values[key] = str(value).encode()
            self._shared.changed.notify_all()
            return value

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        with self._shared.changed:
            return self.add(key, amount), self._shared.values.get(other)

    def get(self, key: str) -> bytes | None:
        with self._shared.changed:
            return self._shared.values.get(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._shared.changed:
            return [self._shared.values.get(key) for key in keys]

    def set(self, key: str, value: bytes) -> None:
        with self._shared.changed:
            self._shared.values[key] = bytes(value)
            self._shared.changed.notify_all()

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        with self._shared.changed:
            current = self._shared.values.get(key)
            if current == expected:
                self._shared.values[key] = current = bytes(desired)
                self._shared.changed.notify_all()
            return b"" if current is None else current

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._shared.changed:
            return self._shared.changed.wait_for(
                lambda: all(key in self._shared.values for key in keys),
                max(0.0, deadline - time.monotonic()),
            )

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        with self._shared.changed:
            found = self._shared.changed.wait_for(lambda: key in self._shared.values, timeout)
            return self._shared.values[key] if found else None

    def keep_alive(self, key: str, ttl: float) -> None:
        with self._shared.changed:
            self._shared.expiry[key] = self._shared.clock() + ttl
            self._kept.add(key)

    def alive(self, key: str, ttl: float) -> bool:
        with self._shared.changed:
            return self._shared.expiry.get(key, -float("inf")) >= self._shared.clock()

    def delete_prefix(self, prefix: str) -> int:
        with self._shared.changed:
            doomed = [key for key in self._shared.values if key.startswith(prefix)]
            for key in doomed:
                del self._shared.values[key]
            expiring = [key for key in self._shared.expiry if key.startswith(prefix)]
            for key in expiring:
                del self._shared.expiry[key]
            return len(set(doomed) | set(expiring))

    def stored_keys(self) -> list[str]:
        """The keys it keeps until deleted (values and counters; not the liveness keys,
        which expire): what a cleanly finished run must not leave."""
        with self._shared.changed:
            return sorted(self._shared.values)

    def expire(self, keys: Sequence[str]) -> None:
        """End the liveness of ``keys`` now, whichever connection kept them (a server
        that deletes a closed client's keys, as Redis's and etcd's do)."""
        with self._shared.changed:
            for key in keys:
                self._shared.expiry.pop(key, None)

    def clone(self) -> MemoryStore:
        return MemoryStore(self._shared)

    def close(self) -> None:
        """The keys this connection kept alive die now."""
        with self._shared.changed:
            for key in self._kept:
                self._shared.expiry.pop(key, None)
            self._kept.clear()

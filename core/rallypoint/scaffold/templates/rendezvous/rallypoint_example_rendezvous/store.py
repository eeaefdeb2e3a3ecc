"""``ExampleRendezvousStore``: the coordination store rallypoint runs its rendezvous
protocol on.

A placeholder: it keeps the keys in this process's memory, so the conformance tests pass
as generated, but agents on other hosts cannot meet through it. Replace each operation
with calls to your service, keeping the promise in its docstring; raise
``StoreUnavailable`` when the service cannot be reached and ``StoreError`` for anything
else, never your client library's exceptions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence


class _Keys:
    """What the placeholder keeps instead of a service: the data all its connections see."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.deadlines: dict[str, float] = {}  # of keep_alive, on time.monotonic()
        self.changed = threading.Condition()  # notified on every write


class ExampleRendezvousStore:
    def __init__(self, endpoint: str, _keys: _Keys | None = None) -> None:
        self.endpoint = endpoint
        self._keys = _keys or _Keys()  # replace: a client of your service
        self._kept: set[str] = set()  # the keys kept alive through this connection

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if absent); the sum."""
        with self._keys.changed:
            total = int(self._keys.values.get(key, b"0")) + amount
            self._keys.values[key] = str(total).encode()
            self._keys.changed.notify_all()
            return total

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        """``add(key, amount)`` and ``get(other)``, in one request where the service
        allows (a transaction, a script)."""
        with self._keys.changed:
            return self.add(key, amount), self._keys.values.get(other)

    def get(self, key: str) -> bytes | None:
        """The value, ``None`` if absent; never blocks."""
        with self._keys.changed:
            return self._keys.values.get(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values in order, in as few requests as the service allows."""
        with self._keys.changed:
            return [self._keys.values.get(key) for key in keys]

    def set(self, key: str, value: bytes) -> None:
        with self._keys.changed:
            self._keys.values[key] = bytes(value)
            self._keys.changed.notify_all()

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Atomically set ``desired`` if ``key`` holds ``expected`` (``None``: absent);
        return what ``key`` holds afterwards (``b""`` if absent)."""
        with self._keys.changed:
            if self._keys.values.get(key) == expected:
                self._keys.values[key] = bytes(desired)
                self._keys.changed.notify_all()
            return self._keys.values.get(key, b"")

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Block until every key exists, woken by the service (a watch), never a sleep
        loop; ``False`` after ``timeout`` seconds."""
        with self._keys.changed:
            return self._keys.changed.wait_for(
                lambda: all(key in self._keys.values for key in keys), timeout
            )

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        """``wait`` for one key, answering its value (``None`` after ``timeout``); answer
        from the notification when it carries the value (a watch event, a message)."""
        with self._keys.changed:
            found = self._keys.changed.wait_for(lambda: key in self._keys.values, timeout)
            return self._keys.values[key] if found else None

    def keep_alive(self, key: str, ttl: float) -> None:
        """This node is alive for ``ttl`` more seconds (a lease, a key TTL)."""
        with self._keys.changed:
            self._keys.deadlines[key] = time.monotonic() + ttl
            self._kept.add(key)

    def alive(self, key: str, ttl: float) -> bool:
        """Whether ``key``'s owner called ``keep_alive`` within ``ttl`` seconds."""
        with self._keys.changed:
            return self._keys.deadlines.get(key, 0.0) >= time.monotonic()

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` (a finished run's keys); how many there were."""
        with self._keys.changed:
            known = (*self._keys.values, *self._keys.deadlines)
            doomed = {key for key in known if key.startswith(prefix)}
            for key in doomed:
                self._keys.values.pop(key, None)
                self._keys.deadlines.pop(key, None)
            return len(doomed)

    def clone(self) -> ExampleRendezvousStore:
        """A second connection to the same service, for another thread."""
        return ExampleRendezvousStore(self.endpoint, self._keys)

    def close(self) -> None:
        """Release the connection; the keys kept alive through it die now (revoke the
        lease, delete the key), so the other nodes see this one leave at once."""
        with self._keys.changed:
            for key in self._kept:
                self._keys.deadlines.pop(key, None)
            self._kept.clear()

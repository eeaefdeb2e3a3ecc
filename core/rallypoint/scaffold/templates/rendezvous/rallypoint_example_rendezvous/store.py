"""``ExampleRendezvousStore``: the coordination store rallypoint runs its rendezvous
protocol on.

A placeholder: it keeps the keys in this process's memory (rallypoint's reference store,
``MemoryStore``), so the conformance tests pass as generated, but agents on other hosts
cannot meet through it. Replace each operation with calls to your service, keeping the
promise in its docstring; raise ``StoreUnavailable`` when the service cannot be reached and
``StoreError`` for anything else, never your client library's exceptions.
"""

from __future__ import annotations

from collections.abc import Sequence

from rallypoint.sdk import MemoryStore


class ExampleRendezvousStore:
    def __init__(self, endpoint: str, _memory: MemoryStore | None = None) -> None:
        self.endpoint = endpoint
        self._memory = _memory or MemoryStore()  # replace: a client of your service

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if absent); the sum."""
        return self._memory.add(key, amount)

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        """``add(key, amount)`` and ``get(other)``, in one request where the service
        allows (a transaction, a script)."""
        return self._memory.add_and_get(key, amount, other)

    def get(self, key: str) -> bytes | None:
        """The value, ``None`` if absent; never blocks."""
        return self._memory.get(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values in order, in as few requests as the service allows."""
        return self._memory.get_many(keys)

    def set(self, key: str, value: bytes) -> None:
        self._memory.set(key, value)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Atomically set ``desired`` if ``key`` holds ``expected`` (``None``: absent);
        return what ``key`` holds afterwards (``b""`` if absent)."""
        return self._memory.compare_set(key, expected, desired)

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Block until every key exists, woken by the service (a watch), never a sleep
        loop; ``False`` after ``timeout`` seconds."""
        return self._memory.wait(keys, timeout)

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        """``wait`` for one key, answering its value (``None`` after ``timeout``); answer
        from the notification when it carries the value (a watch event, a message)."""
        return self._memory.wait_value(key, timeout)

    def keep_alive(self, key: str, ttl: float) -> None:
        """This node is alive for ``ttl`` more seconds (a lease, a key TTL)."""
        self._memory.keep_alive(key, ttl)

    def alive(self, key: str, ttl: float) -> bool:
        """Whether ``key``'s owner called ``keep_alive`` within ``ttl`` seconds."""
        return self._memory.alive(key, ttl)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` (a finished run's keys); how many there were."""
        return self._memory.delete_prefix(prefix)

    def clone(self) -> ExampleRendezvousStore:
        """A second connection to the same service, for another thread."""
        return ExampleRendezvousStore(self.endpoint, self._memory.clone())

    def close(self) -> None:
        """Release the connection; the keys kept alive through it die now (revoke the
        lease, delete the key), so the other nodes see this one leave at once."""
        self._memory.close()

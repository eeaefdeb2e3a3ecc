"""The coordination-store interface the rendezvous protocol runs on.

A backend implements these few operations on its service (torch's TCPStore, etcd, Redis)
and gets the whole protocol of ``rendezvous.protocol``: membership, ranks, last call,
late joiners, dead-node detection and the exit barrier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rallypoint.errors import RallypointError


class StoreError(RallypointError):
    """The store failed or cannot be reached; the message names it and says what to do."""


class CoordinationStore(Protocol):
    """Atomic operations on a shared key-value store. Keys are ``/``-separated text."""

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if absent); return the sum."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value at ``key``, or ``None`` if there is none; never blocks."""
        ...

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` at ``key``."""
        ...

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``None``: if it is absent).

        Returns the value ``key`` holds afterwards: ``desired`` when the swap happened.
        """
        ...

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Block until every key exists (without polling); ``False`` after ``timeout`` s."""
        ...

    def clone(self) -> CoordinationStore:
        """A second connection to the same store, for another thread."""
        ...

    def close(self) -> None:
        """Release the connection (and the server, if this process hosts it)."""
        ...

"""``RetryingStore``: a coordination store whose operations ride out a brief outage.

The rendezvous protocol talks to its store through one, so that a store restarting, failing
over or briefly unreachable (``StoreUnavailable``) delays a round rather than failing the
job, while running workers are left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from rallypoint.interfaces import CoordinationStore, StoreError, StoreUnavailable
from rallypoint.rendezvous.world import REAL, World

logger = logging.getLogger("rallypoint.rendezvous")

T = TypeVar("T")
#: How far a pause between two tries may overrun before it counts as a stall of this
#: process rather than time the store was tried in.
_OVERRUN = 1.0


class Backoff:
    """When to try an unreachable store again: after 0.1 s, doubling to 2 s, for
    ``retry_timeout`` seconds in all. Time is given, so the simulation's clock drives it
    as the real one does."""

    def __init__(self, retry_timeout: float) -> None:
        self.retry_timeout = retry_timeout
        self.began: float | None = None
        self._delay = 0.1

    def failed(self, now: float, error: StoreError) -> float:
        """The seconds to wait before the next try; ``StoreError`` when time is up."""
        if self.began is None:
            self.began = now
            logger.warning("rendezvous store unreachable (%s); retrying", error)
        if now - self.began >= self.retry_timeout - 0.001:  # a last wait of < 1 ms: none
            raise StoreError(
                f"{error}; still unreachable after retry_timeout={self.retry_timeout:g} s"
            ) from None
        delay = min(self._delay, self.retry_timeout - (now - self.began))
        self._delay = min(self._delay * 2, 2.0)
        return delay

    def excuse(self, seconds: float) -> None:
        """This process did not run for ``seconds`` between two tries (frozen, swapped
        out, its host stalled): the store had no chance to answer then, so that time is
        not counted against it."""
        if self.began is not None:
            self.began += seconds

    def succeeded(self, now: float) -> None:
        if self.began is not None:
            logger.info("rendezvous store reachable again after %.1f s", now - self.began)


class RetryingStore:
    """A store whose operations ride out an outage: ``StoreUnavailable`` is retried with
    exponential backoff (``Backoff``) for ``retry_timeout`` seconds, then it becomes a
    ``StoreError`` that says how long the store was unreachable. Its pauses and clock
    are its ``world``'s."""

    def __init__(self, store: CoordinationStore, retry_timeout: float, world: World = REAL) -> None:
        self.store = store
        self.retry_timeout = retry_timeout
        self.world = world

    def retry(self, operation: Callable[[], T]) -> T:
        backoff: Backoff | None = None  # made at the first failure: a success costs nothing
        while True:
            try:
                result = operation()
            except StoreUnavailable as error:
                backoff = backoff or Backoff(self.retry_timeout)
                delay = backoff.failed(self.world.monotonic(), error)
                slept_from = self.world.monotonic()
                self.world.sleep(delay)
                # A pause that overran by far: this process stood still (SIGSTOP, a stall).
                overran = self.world.monotonic() - slept_from - delay
                if overran > _OVERRUN:
                    backoff.excuse(overran)
                continue
            if backoff is not None:
                backoff.succeeded(self.world.monotonic())
            return result

    def add(self, key: str, amount: int) -> int:
        return self.retry(lambda: self.store.add(key, amount))

    def get(self, key: str) -> bytes | None:
        return self.retry(lambda: self.store.get(key))

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        return self.retry(lambda: self.store.add_and_get(key, amount, other))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self.retry(lambda: self.store.get_many(keys))

    def set(self, key: str, value: bytes) -> None:
        self.retry(lambda: self.store.set(key, value))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        return self.retry(lambda: self.store.compare_set(key, expected, desired))

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        deadline = self.world.monotonic() + timeout
        return self.retry(lambda: self.store.wait(keys, self._left(deadline)))

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        deadline = self.world.monotonic() + timeout
        return self.retry(lambda: self.store.wait_value(key, self._left(deadline)))

    def _left(self, deadline: float) -> float:
        return max(0.0, deadline - self.world.monotonic())

    def keep_alive(self, key: str, ttl: float) -> None:
        self.retry(lambda: self.store.keep_alive(key, ttl))

    def alive(self, key: str, ttl: float) -> bool:
        return self.retry(lambda: self.store.alive(key, ttl))

    def delete_prefix(self, prefix: str) -> int:
        return self.retry(lambda: self.store.delete_prefix(prefix))

    def clone(self) -> RetryingStore:
        return RetryingStore(self.retry(self.store.clone), self.retry_timeout, self.world)

    def close(self) -> None:
        self.store.close()

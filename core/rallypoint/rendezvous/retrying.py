"""``RetryingStore``: a coordination store whose operations ride out a brief outage.

The rendezvous protocol talks to its store through one, so that a store restarting, failing
over or briefly unreachable (``StoreUnavailable``) delays a round rather than failing the
job, while running workers are left alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from rallypoint.interfaces import CoordinationStore, StoreError, StoreUnavailable

logger = logging.getLogger("rallypoint.rendezvous")

T = TypeVar("T")


class RetryingStore:
    """A store whose operations ride out an outage: ``StoreUnavailable`` is retried with
    exponential backoff (0.1 s doubling to 2 s) for ``retry_timeout`` seconds, then it
    becomes a ``StoreError`` that says how long the store was unreachable."""

    def __init__(self, store: CoordinationStore, retry_timeout: float) -> None:
        self.store = store
        self.retry_timeout = retry_timeout

    def _retry(self, operation: Callable[[], T]) -> T:
        began: float | None = None
        delay = 0.1
        while True:
            try:
                result = operation()
            except StoreUnavailable as error:
                now = time.monotonic()
                if began is None:
                    began = now
                    logger.warning("rendezvous store unreachable (%s); retrying", error)
                if now - began >= self.retry_timeout:
                    raise StoreError(
                        f"{error}; still unreachable after retry_timeout={self.retry_timeout:g} s"
                    ) from None
                time.sleep(min(delay, self.retry_timeout - (now - began)))
                delay = min(delay * 2, 2.0)
                continue
            if began is not None:
                logger.info(
                    "rendezvous store reachable again after %.1f s", time.monotonic() - began
                )
            return result

    def add(self, key: str, amount: int) -> int:
        return self._retry(lambda: self.store.add(key, amount))

    def get(self, key: str) -> bytes | None:
        return self._retry(lambda: self.store.get(key))

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        store = self.store
        both = getattr(store, "add_and_get", None)
        if both is not None:
            return self._retry(lambda: both(key, amount, other))  # type: ignore[no-any-return]
        return self.add(key, amount), self.get(other)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._retry(lambda: self.store.get_many(keys))

    def set(self, key: str, value: bytes) -> None:
        self._retry(lambda: self.store.set(key, value))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        return self._retry(lambda: self.store.compare_set(key, expected, desired))

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return self._retry(lambda: self.store.wait(keys, max(0.0, deadline - time.monotonic())))

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        store = self.store
        wait_value = getattr(store, "wait_value", None)  # a store written before it had it

        def once() -> bytes | None:
            left = max(0.0, deadline - time.monotonic())
            if wait_value is not None:
                return wait_value(key, left)  # type: ignore[no-any-return]
            return store.get(key) if store.wait([key], left) else None

        return self._retry(once)

    def keep_alive(self, key: str, ttl: float) -> None:
        self._retry(lambda: self.store.keep_alive(key, ttl))

    def alive(self, key: str, ttl: float) -> bool:
        return self._retry(lambda: self.store.alive(key, ttl))

    def delete_prefix(self, prefix: str) -> int:
        return self._retry(lambda: self.store.delete_prefix(prefix))

    def clone(self) -> RetryingStore:
        return RetryingStore(self._retry(self.store.clone), self.retry_timeout)

    def close(self) -> None:
        self.store.close()

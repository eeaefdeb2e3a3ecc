"""What a wait on etcd keys knows: the keys it waits for, those still missing, and the
etcd watch it shares with the other waits on the same keys of this process."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any


class Watch:
    """One ``wait``: the keys it waits for and those still missing."""

    def __init__(
        self, keys: tuple[bytes, ...], missing: set[bytes], found: dict[bytes, Any]
    ) -> None:
        self.keys = keys
        self.missing = missing
        self.found = found  # key -> its KeyValue, as read or as a put announced it
        self.done = threading.Event()
        self.failed = False
        self.shared: SharedWatch | None = None
        self.since = 0  # the revision from which puts count: the read saw the older ones

    def saw(self, kvs: Iterable[Any]) -> None:
        for kv in kvs:
            self.found[kv.key] = kv
            self.missing.discard(kv.key)
        if not self.missing:
            self.done.set()

    def fail(self) -> None:
        self.failed = True
        self.done.set()


class SharedWatch:
    """One etcd watch and the waits it serves; called on the watcher's thread."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.seen: dict[bytes, Any] = {}  # key -> its KeyValue at its latest put since ``start``
        self.waiters: set[Watch] = set()
        self.ended = False
        self.watch_id: int | None = None
        self.lock = threading.Lock()

    def join(self, waiter: Watch, revision: int) -> bool:
        """Serve ``waiter``, which read the keys before ``revision``: it is told of the puts
        from ``revision`` on (older ones its read saw, or a later delete undid)."""
        with self.lock:
            if self.ended or self.start > revision:
                return False
            self.waiters.add(waiter)
            waiter.shared = self
            waiter.since = revision
            seen = [kv for kv in self.seen.values() if kv.mod_revision >= revision]
        waiter.saw(seen)
        return True

    def leave(self, waiter: Watch) -> bool:
        """Remove ``waiter``; True if it was the last (the watch is then ended)."""
        with self.lock:
            self.waiters.discard(waiter)
            if self.waiters or self.ended:
                return False
            self.ended = True
            return True

    def __call__(self, response: Any) -> None:
        with self.lock:
            waiters = list(self.waiters)
            puts: list[Any] | None = None
            if response is None or isinstance(response, BaseException):
                self.ended = True  # the stream ended: the server went away or we closed it
            else:
                # pyetcd's events read as their KeyValue (key, value, version, revisions)
                puts = list(response.events)
                self.seen.update((kv.key, kv) for kv in puts)
        for waiter in waiters:
            if puts is None:
                waiter.fail()
            else:  # a put older than the waiter's read may have been deleted since
                waiter.saw(kv for kv in puts if kv.mod_revision >= waiter.since)

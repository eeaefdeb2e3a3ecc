"""Rendezvous records sealed with the job token (``--rdzv-conf token_file``).

A job given a token seals every value it writes to the coordination store (join records,
round records, the round counter, generation markers, ``leaving`` and ``open`` marks, the
exit barrier's, a failure) with an HMAC-SHA256 of the token over the key and the value.
What it reads counts only if the seal holds: a value that a process without the token
wrote, or copied from another key, is taken for absent, and the protocol goes on as if it
had not been written. The seal binds no time (no record is trusted for a timestamp) and
the key, so a record is good only where its writer put it.

The counters (``add``: join numbers, the barriers' counts, TCPStore's heartbeat counters)
are numbers a store adds to and cannot carry a seal. A stray writer can bump them, which
delays a round (a join number without a record is left out after ``close_timeout``), never
adds a member. TCPStore's heartbeat counter used to say "gone at once" when its owner
dropped it below zero; a stray could drop it too, so a sealed job does not trust the drop
and its leaving node writes a sealed ``<heartbeat key>/gone`` mark instead.

Every node of a job must hold the same token: its first act is to ``claim`` the run's
token key (``Keys.token_key``), sealed; a node that finds it sealed with another token
stops at once, saying so, rather than ignoring the job's records until ``join_timeout``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Iterator, Sequence

from rallypoint.interfaces import CoordinationStore, RendezvousFailed, StoreError, StoreUnavailable
from rallypoint.rendezvous import records
from rallypoint.rendezvous.liveness import CounterLiveness

logger = logging.getLogger("rallypoint.rendezvous")

#: What a sealed value starts with: the seal's format, then the tag in hex, then a dot.
MARK = records.SEALED
_TAG_HEX = 32  # 128 bits of the HMAC-SHA256: as strong as forging needs, half the bytes
_HEAD = len(MARK) + _TAG_HEX + 1
#: What the token key holds, sealed.
CLAIM = b"job token"
#: A heartbeat key's sealed "gone" mark, on a store whose liveness is a counter.
GONE = "/gone"
#: The first and longest pause between a wait's reads of a key that holds an unsealed value.
_POLL = (0.05, 0.5)
#: How many times a compare-and-set replaces a stray's value before giving up.
_REPLACE_TRIES = 4


class Seal:
    """Seals and opens values with a job token."""

    def __init__(self, token: bytes) -> None:
        # Its own key, derived from the token: the peer transfers' HMACs use the token
        # for other messages, and a tag of one can never pass for the other.
        self._key = hashlib.sha256(b"rallypoint rendezvous records\0" + token).digest()

    def _tag(self, key: str, value: bytes) -> bytes:
        mac = hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256)
        return mac.hexdigest()[:_TAG_HEX].encode()

    def seal(self, key: str, value: bytes) -> bytes:
        return MARK + self._tag(key, value) + b"." + value

    def open(self, key: str, raw: bytes) -> bytes | None:
        """``raw``'s value if this token sealed it for ``key``, else None."""
        if not raw.startswith(MARK) or len(raw) < _HEAD or raw[_HEAD - 1 : _HEAD] != b".":
            return None
        value = raw[_HEAD:]
        if hmac.compare_digest(raw[len(MARK) : _HEAD - 1], self._tag(key, value)):
            return value
        return None


def sealed(raw: bytes) -> bool:
    """Whether ``raw`` looks sealed (by some token): what a node without one reads when
    the job's nodes have one."""
    return raw.startswith(MARK) and len(raw) >= _HEAD


class Ignored:
    """What a node's connections ignored, logged once for all of them."""

    def __init__(self) -> None:
        self._said = False
        self._lock = threading.Lock()

    def note(self, key: str) -> None:
        with self._lock:
            first, self._said = not self._said, True
        if first:
            logger.warning(
                "ignored the rendezvous record at %r: it is not sealed with this job's token "
                "(a process without the token wrote it); ignoring any more such records",
                key[:200],
            )


class SignedStore:
    """A ``CoordinationStore`` whose values are sealed with the job token: see the module.

    An unsealed value reads as absent; a compare-and-set that finds one where it expects
    nothing replaces it (a stray cannot hold a key against the job); a wait waits on
    through one. Counters pass through."""

    def __init__(self, store: CoordinationStore, seal: Seal, ignored: Ignored | None = None):
        self.store = store
        self.seal = seal
        self.ignored = ignored or Ignored()
        # A heartbeat counter's drop below zero is no proof of anything: a stray can add.
        self._counted = isinstance(store, CounterLiveness)
        if self._counted:
            store.trust_drops = False  # type: ignore[attr-defined]
        self._kept: set[str] = set()

    @property
    def hosting(self) -> bool | None:
        return getattr(self.store, "hosting", None)

    def _open(self, key: str, raw: bytes | None) -> bytes | None:
        if raw is None:
            return None
        value = self.seal.open(key, raw)
        if value is None:
            self.ignored.note(key)
        return value

    # --- values ---------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        return self._open(key, self.store.get(key))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._open(k, v) for k, v in zip(keys, self.store.get_many(keys), strict=True)]

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, self.seal.seal(key, value))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        mine = self.seal.seal(key, desired)
        want = None if expected is None else self.seal.seal(key, expected)
        for _ in range(_REPLACE_TRIES):
            now = self.store.compare_set(key, want, mine)
            if now == mine:
                return desired
            value = self._open(key, now) if now else None
            if value is not None:
                return value
            if expected is not None or not now:
                return b""  # as if absent: not swapped
            want = now  # a stray's value where the job has none: replace it
        raise StoreUnavailable(f"a process without the job token keeps writing {key!r}")

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        if not self.store.wait(keys, timeout):
            return False
        for _ in _pauses(deadline):
            if all(value is not None for value in self.get_many(keys)):
                return True
        return False

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        raw = self.store.wait_value(key, timeout)
        if raw is None:
            return None
        value = self._open(key, raw)
        for _ in _pauses(deadline):
            if value is not None:
                break
            value = self.get(key)
        return value

    # --- counters and liveness ------------------------------------------------------------

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        count, raw = self.store.add_and_get(key, amount, other)
        return count, self._open(other, raw)

    def keep_alive(self, key: str, ttl: float) -> None:
        self.store.keep_alive(key, ttl)
        self._kept.add(key)

    def alive(self, key: str, ttl: float) -> bool:
        if not self.store.alive(key, ttl):
            return False
        return not self._counted or self.get(key + GONE) is None

    def delete_prefix(self, prefix: str) -> int:
        return self.store.delete_prefix(prefix)

    # --- the token and the connection ------------------------------------------------------

    def claim(self, key: str) -> None:
        """Seal the run's token key, or find it sealed with this token; stop, in a
        sentence, when the job's nodes hold another token."""
        mine = self.seal.seal(key, CLAIM)
        now = self.store.compare_set(key, None, mine)
        if now == mine or self.seal.open(key, now) == CLAIM:
            return
        # An unsealed value is a stray's: the token key is the job's.
        if not sealed(now) and self.store.compare_set(key, now, mine) == mine:
            return
        raise RendezvousFailed(
            "this node's job token is not the one the job's nodes use (their rendezvous "
            "records are sealed with another): give every node of the job the same "
            "--rdzv-conf token_file or RALLYPOINT_JOB_TOKEN, or give a new job its own "
            "--rdzv-id"
        )

    def clone(self) -> SignedStore:
        return SignedStore(self.store.clone(), self.seal, self.ignored)

    def close(self) -> None:
        if self._counted:
            for key in self._kept:
                # The others see this node gone at once, as the counter's drop said; on
                # an unreachable store its counter lapses instead.
                with contextlib.suppress(StoreError):
                    self.set(key + GONE, b"1")
        self.store.close()


def _pauses(deadline: float) -> Iterator[None]:
    """Yields at once, then after each pause (growing from 0.05 s to 0.5 s) until
    ``deadline``: a wait re-reads a key that a stray wrote, which the store's own wait
    already saw exist and cannot wait on to change."""
    delay = _POLL[0]
    yield
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(delay, left))
        delay = min(delay * 2, _POLL[1])
        yield

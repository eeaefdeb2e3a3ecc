"""Rendezvous records sealed with the job token (``--rdzv-conf token_file``), for one attempt.

A job given a token seals every value it writes to the coordination store (join records,
round records, the round counter, generation markers, ``leaving`` and ``open`` marks, the
exit barrier's, a failure, liveness marks) with an HMAC-SHA256 over the key and the value.
What it reads counts only if the seal holds: a value that a process without the token
wrote, or copied from another key, is taken for absent, and the protocol goes on as if it
had not been written.

**Attempts.** Keys repeat: every c10d attempt starts an empty store, and a clean finish on
etcd or Redis deletes the run's keys, so a record sealed in one attempt would be good in
the next at the same key. The run's first node therefore claims the run's token key
(``Keys.token_key``) with a random nonce, sealed with the token's own key; every node of
the attempt reads the nonce there and seals with a key derived from the token and the
nonce. A record written in another attempt is worth nothing in this one. (What remains:
a stray that recorded an old claim can write it back into an empty store before the next
attempt's first node claims it; see docs/security.md.)

**Counters** (``add``: join numbers, the barriers' hints, TCPStore's heartbeat counters)
cannot carry a seal; a stray can bump them. The protocol caps every count it reads and
decides nothing on a count alone (``rendezvous.joining``).

**Liveness.** With a token a node is alive only while its own sealed, advancing mark says
so: every ``keep_alive`` also writes ``<heartbeat key>/mark``, a sealed number higher than
the last, and a node leaving writes a sealed ``gone`` there. An observer takes a node for
alive while it saw the mark rise within ``ttl``; the store's own liveness (etcd's lease,
Redis's TTL key, TCPStore's counter), which a stray can touch either way, only decides a
first look at a mark that is not fresh, and only for ``ttl`` (``judge``).

**The claim.** Every node of a job must hold the same token. A node that finds the claim
sealed with another token looks for the records of a job behind it: if there are some, it
stops at once, saying so; if there are none after a grace (a squatter's claim, or a dead
job's with another token), it replaces the claim, saying so.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from rallypoint.interfaces import CoordinationStore, RendezvousFailed, StoreError, StoreUnavailable
from rallypoint.job_token import derive
from rallypoint.rendezvous import records
from rallypoint.rendezvous.liveness import CounterLiveness
from rallypoint.rendezvous.world import REAL, World

logger = logging.getLogger("rallypoint.rendezvous")

#: What a sealed value starts with: the seal's format, then the tag in hex, then a dot.
MARK = records.SEALED
_TAG_HEX = 32  # 128 bits of the HMAC-SHA256: as strong as forging needs, half the bytes
_HEAD = len(MARK) + _TAG_HEX + 1
#: What the token key holds, sealed with the token's own key: this, a space, the nonce.
CLAIM = b"job token"
_CLAIM = re.compile(rb"^job token ([0-9a-f]{32})$")
_CLAIM_SHAPE = re.compile(rb"^rp1\.[0-9a-f]{32}\.job token [0-9a-f]{32}$")
#: A heartbeat key's sealed liveness mark: a number that rises with every renewal.
ALIVE = "/mark"
_GONE = b" gone"
_MARK = re.compile(rb"^([0-9]{1,20})( gone)?$")
#: The first and longest pause between a wait's reads of a key that holds an unsealed value.
_POLL = (0.05, 0.5)
#: How many times a compare-and-set replaces a stray's value before giving up.
_REPLACE_TRIES = 4
#: The longest a node waits for a job behind a claim sealed with another token.
CLAIM_GRACE = 5.0

MISMATCH = (
    "this node's job token is not the one the job's nodes use (the run's token claim and "
    "its records are sealed with another): give every node of the job the same "
    "--rdzv-conf token_file or RALLYPOINT_JOB_TOKEN, or give a new job its own --rdzv-id"
)


class Seal:
    """Seals and opens values with a key derived from the job token: the run's (its token
    claim only), or an attempt's (``for_attempt``: every record of the attempt)."""

    def __init__(self, token: bytes) -> None:
        # Its own key, derived from the token: the peer transfers' proofs use another.
        self._key = derive(token, "rendezvous records")
        self.attempt = ""

    def for_attempt(self, attempt: str) -> Seal:
        """The seal of the attempt whose claim holds ``attempt`` (its nonce)."""
        sealed = object.__new__(Seal)
        sealed._key = hmac.new(self._key, b"attempt\0" + attempt.encode(), "sha256").digest()
        sealed.attempt = attempt
        return sealed

    def _tag(self, key: str, value: bytes) -> bytes:
        mac = hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256)
        return mac.hexdigest()[:_TAG_HEX].encode()

    def seal(self, key: str, value: bytes) -> bytes:
        return MARK + self._tag(key, value) + b"." + value

    def open(self, key: str, raw: bytes | None) -> bytes | None:
        """``raw``'s value if this seal sealed it for ``key``, else None."""
        if raw is None or not sealed(raw) or raw[_HEAD - 1 : _HEAD] != b".":
            return None
        value = raw[_HEAD:]
        if hmac.compare_digest(raw[len(MARK) : _HEAD - 1], self._tag(key, value)):
            return value
        return None


def sealed(raw: bytes) -> bool:
    """Whether ``raw`` looks sealed (by some token): what a node without one reads when
    the job's nodes have one."""
    return raw.startswith(MARK) and len(raw) >= _HEAD


def unsealed_value(raw: bytes) -> bytes:
    """A sealed value without its seal: anyone who reads the store can read it."""
    return raw[_HEAD:] if sealed(raw) else raw


def attempt_of(value: bytes | None) -> str | None:
    """The nonce of a claim's opened value, None if it is not a claim."""
    match = _CLAIM.match(value or b"")
    return match.group(1).decode() if match else None


# --- liveness: state and decisions, apart from the store -----------------------------------


@dataclass(frozen=True)
class Watch:
    """What one observer saw of one node's liveness mark."""

    sequence: int  # the highest mark read
    advanced: float | None  # when a mark higher than the one before was read; None: not yet
    since: float  # when this watch began (a first look)
    read: float  # when the mark was last read
    gone: bool = False  # the highest mark said the node left


#: A verdict: alive, gone, or (None) ask the store's own liveness: a first look.
Verdict = bool | None


def judge(
    watch: Watch | None, mark: tuple[int, bool] | None, now: float, ttl: float, wall: int
) -> tuple[Watch | None, Verdict]:
    """The watch after reading ``mark`` (its number, and whether it says gone; None: no
    sealed mark) at ``now``, and the verdict. ``wall``: this host's wall clock, in µs.

    A mark higher than any seen is news: alive (or gone, if it says so). A watch that saw
    the mark rise within ``ttl`` answers alive without news, whatever a stray did to the
    store's own liveness or the mark's key. A first look (no watch, or one not read for
    longer than ``ttl``: the store was out of reach) has not seen a rise yet: for ``ttl``
    it takes the node for alive where its mark is fresh (a mark's number is its writer's
    wall clock in µs, sealed: it can only ever vouch for life, for ``ttl``, so a clock
    skewed between hosts can delay a verdict of death, never cause one), else asks the
    store's own liveness; a mark that does not rise by then is a dead node's, however
    alive a stray keeps its lease, key or counter. No mark at a first look: gone (never
    kept alive in this attempt, or its key was deleted)."""
    if watch is not None and now - watch.read > ttl:
        watch = Watch(watch.sequence, None, now, now, watch.gone)
    if mark is not None and (watch is None or mark[0] > watch.sequence):
        number, gone = mark
        if gone:
            return Watch(number, None, now, now, True), False
        if watch is None:
            return Watch(number, None, now, now), _first_look(number, wall, ttl)
        return Watch(number, now, watch.since, now), True
    if watch is None:
        return None, False
    watch = Watch(watch.sequence, watch.advanced, watch.since, now, watch.gone)
    if watch.gone:
        return watch, False
    if watch.advanced is not None:
        return watch, now - watch.advanced <= ttl
    if now - watch.since > ttl:
        return watch, False
    return watch, _first_look(watch.sequence, wall, ttl)


def _first_look(number: int, wall: int, ttl: float) -> Verdict:
    """Alive where the mark was written within ``ttl`` by its writer's clock, else ask."""
    return True if wall - number <= ttl * 1e6 else None


def _mark(value: bytes | None) -> tuple[int, bool] | None:
    match = _MARK.match(value or b"")
    return (int(match.group(1)), bool(match.group(2))) if match else None


class _Shared:
    """What one node's connections share: the attempt's seal once claimed, whether an
    ignored record was logged, the numbers of its own marks, its watches of the others'."""

    def __init__(self, seal: Seal) -> None:
        self.run_seal = seal
        self.seal: Seal | None = None  # the attempt's
        self.claim_key: str | None = None  # where the attempt's claim is
        self.lock = threading.Lock()
        self.said = False
        self.sequence = 0  # the last mark this node wrote
        self.kept: set[str] = set()  # the heartbeat keys this node keeps, by any connection
        self.watches: dict[str, Watch] = {}


class SignedStore:
    """A ``CoordinationStore`` whose values are sealed with the job token for one attempt:
    see the module.

    An unsealed value reads as absent; a compare-and-set that finds one where it expects
    nothing replaces it (a stray cannot hold a key against the job); a wait waits on
    through one. Counters pass through. Until the attempt is known (``claim``, or
    ``view`` for a reader), nothing reads as present and nothing can be written."""

    def __init__(
        self,
        store: CoordinationStore,
        seal: Seal,
        *,
        world: World = REAL,
        _shared: _Shared | None = None,
    ) -> None:
        self.store = store
        self.shared = _shared or _Shared(seal)
        self.world = world  # its clocks (a liveness mark is wall-clock time) and pauses
        # A heartbeat counter's drop below zero is no proof of anything: a stray can add.
        if isinstance(store, CounterLiveness):
            store.trust_drops = False

    @property
    def attempt(self) -> str | None:
        seal = self.shared.seal
        return None if seal is None else seal.attempt

    def _seal(self) -> Seal:
        seal = self.shared.seal
        if seal is None:
            raise StoreError("a sealed rendezvous store written to before its token claim")
        return seal

    def _note(self, key: str) -> None:
        with self.shared.lock:
            first, self.shared.said = not self.shared.said, True
        if first:
            logger.warning(
                "ignored the rendezvous record at %r: it is not sealed with this job's token "
                "for this attempt (a process without the token wrote it, or copied it from "
                "an earlier attempt); ignoring any more such records",
                key[:200],
            )

    def _open(self, key: str, raw: bytes | None) -> bytes | None:
        if raw is None:
            return None
        seal = self.shared.seal
        value = None if seal is None else seal.open(key, raw)
        if value is None:
            self._note(key)
        return value

    # --- values ---------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        return self._open(key, self.store.get(key))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._open(k, v) for k, v in zip(keys, self.store.get_many(keys), strict=True)]

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, self._seal().seal(key, value))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        seal = self._seal()
        mine = seal.seal(key, desired)
        want = None if expected is None else seal.seal(key, expected)
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
        deadline = self.world.monotonic() + timeout
        if not self.store.wait(keys, timeout):
            return False
        for _ in _pauses(deadline, self.world):
            if all(value is not None for value in self.get_many(keys)):
                return True
        return False

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        deadline = self.world.monotonic() + timeout
        raw = self.store.wait_value(key, timeout)
        if raw is None:
            return None
        value = self._open(key, raw)
        for _ in _pauses(deadline, self.world):
            if value is not None:
                break
            value = self.get(key)
        return value

    # --- counters -------------------------------------------------------------------------

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        count, raw = self.store.add_and_get(key, amount, other)
        return count, self._open(other, raw)

    def delete_prefix(self, prefix: str) -> int:
        return self.store.delete_prefix(prefix)

    # --- liveness -------------------------------------------------------------------------

    def keep_alive(self, key: str, ttl: float) -> None:
        self.store.keep_alive(key, ttl)
        self.set(key + ALIVE, str(self._next(key)).encode())
        with self.shared.lock:
            self.shared.kept.add(key)
        self._check_claim()

    def _check_claim(self) -> None:
        """The run's claim still holds this node's attempt: one read a renewal. Where
        it does not, the store lost its data (restarted empty, or its c10d host died) and
        a node claimed the run anew: this node's records are another attempt's there,
        and going on would form a second job beside that one's."""
        key, seal = self.shared.claim_key, self.shared.seal
        if key is None or seal is None:
            return
        now = attempt_of(self.shared.run_seal.open(key, self.store.get(key) or None))
        if now != seal.attempt:
            raise StoreError(
                "the run's job token claim is no longer this node's attempt: the rendezvous "
                "store lost its data (restarted empty, or the agent that hosted it died); "
                "restart the job"
            )

    def _next(self, key: str) -> int:
        """The number of this node's next mark: above the last, and at least the wall
        clock's microseconds. A node id is an agent process's own (host, pid, a random
        part), so no earlier mark under ``key`` can be higher but after a clock step back
        between two agents of one id; reading the old mark to be sure would cost every
        node's first renewal a request."""
        with self.shared.lock:
            number = max(self.shared.sequence + 1, self.world.time_ns() // 1000)
            self.shared.sequence = number
            return number

    def alive(self, key: str, ttl: float) -> bool:
        mark = _mark(self.get(key + ALIVE))
        now = self.world.monotonic()
        with self.shared.lock:
            watch, verdict = judge(
                self.shared.watches.get(key), mark, now, ttl, self.world.time_ns() // 1000
            )
            if watch is None:
                self.shared.watches.pop(key, None)
            else:
                self.shared.watches[key] = watch
        if verdict is None:  # a first look: the store's own liveness says
            return self.store.alive(key, ttl)
        return verdict

    # --- the token claim ------------------------------------------------------------------

    def claim(
        self,
        key: str,
        job_behind: Callable[[], bool],
        grace: float = CLAIM_GRACE,
    ) -> None:
        """Take part in the run's attempt: seal the token key ``key`` with a new nonce, or
        find it sealed with this token (the attempt's nonce). A claim sealed with another
        token stops this node in a sentence when ``job_behind()`` finds records of a job
        under the run's keys within ``grace`` seconds; else it is replaced, saying so."""
        run_seal = self.shared.run_seal
        mine = run_seal.seal(key, CLAIM + b" " + secrets.token_hex(16).encode())
        deadline = self.world.monotonic() + grace
        want: bytes | None = None
        for _ in range(1000):  # each turn pauses, or replaces a stray's value
            now = self.store.compare_set(key, want, mine)
            attempt = attempt_of(run_seal.open(key, now or None))
            if attempt is not None:
                if want is not None:
                    logger.warning(
                        "replaced the run's token claim at %r: no record of a job stood "
                        "behind it (a process without this job's token wrote it, or a job "
                        "with another token left it)",
                        key[:200],
                    )
                self.shared.seal = run_seal.for_attempt(attempt)
                self.shared.claim_key = key
                return
            if not now:
                want = None  # deleted meanwhile: claim it afresh
                continue
            if not _CLAIM_SHAPE.match(now):
                self._note(key)
                want = now  # not a claim at all: a stray's; the token key is the job's
                continue
            if job_behind():
                raise RendezvousFailed(MISMATCH)
            if self.world.monotonic() >= deadline:
                want = now
                continue
            want = None
            self.world.sleep(0.2)
        raise StoreUnavailable(f"the run's token claim at {key!r} keeps changing")

    def view(self, key: str) -> bool:
        """As a reader (``rallypoint rendezvous status``): read the attempt from the token
        key without writing; whether it is sealed with this token."""
        attempt = attempt_of(self.shared.run_seal.open(key, self.store.get(key)))
        if attempt is not None:
            self.shared.seal = self.shared.run_seal.for_attempt(attempt)
        return attempt is not None

    # --- the connection -------------------------------------------------------------------

    def clone(self) -> SignedStore:
        return SignedStore(
            self.store.clone(), self.shared.run_seal, world=self.world, _shared=self.shared
        )

    def end_liveness(self) -> None:
        """This node leaves: a sealed ``gone`` on every mark it kept, by any of its
        connections, once. The others see it gone at once; on an unreachable store its
        marks stop rising, and it counts as gone after ttl. Before the node's last writes
        (``protocol.leave``): a mark written after the run's keys were deleted would stay."""
        with self.shared.lock:
            kept, self.shared.kept = self.shared.kept, set()
        for key in kept:
            with contextlib.suppress(StoreError):
                self.set(key + ALIVE, str(self._next(key)).encode() + _GONE)

    def close(self) -> None:
        self.end_liveness()
        self.store.close()


def _pauses(deadline: float, world: World) -> Iterator[None]:
    """Yields at once, then after each pause (growing from 0.05 s to 0.5 s) until
    ``deadline``: a wait re-reads a key that a stray wrote, which the store's own wait
    already saw exist and cannot wait on to change."""
    delay = _POLL[0]
    yield
    while (left := deadline - world.monotonic()) > 0:
        world.sleep(min(delay, left))
        delay = min(delay * 2, _POLL[1])
        yield

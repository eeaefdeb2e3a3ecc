"""``RedisStore``: the coordination store of the ``redis`` backend, on redis-py.

How the store's operations map to Redis:

* ``add``, ``set`` and ``compare_set`` are server-side Lua scripts: each is atomic, takes
  one round trip, and when it creates the key publishes the value on the key's channel.
  ``add_and_get`` is ``add``'s script given a second key, which it reads (``GET``).
* ``wait`` subscribes to the channels of the keys it waits for (a channel is named like
  its key), then reads the keys, then blocks on the subscription until the missing ones
  are published. No polling: a round closes as soon as its last key is set. A wait for
  one key takes two round trips before it blocks (subscribe, read); a wait for several
  first reads them all (the leader's read of N joiners finds them all there), and reads
  again once all were published. ``wait_value`` is a wait for one key that answers its
  value, from the read or from the message that announced the key: every node gets the
  round's record without a request of its own after the leader wrote it. A wait that
  timed out leaves its subscription in place, and the next wait on the same keys goes on
  from it without a request: the heartbeat thread waits for the round's end in short
  slices, for hours.
* Commands go over a connection each store holds, not through ``redis.Redis``'s command
  methods, which cost about three times the CPU of the command (pool, checks, metrics).
* ``keep_alive`` sets a key with a TTL (``PX``) that the owner refreshes; ``alive`` is
  whether the key exists. A dead agent's key expires on the server, so no other agent has
  to watch clocks; an agent that stops (``close``) deletes it, so it is seen gone at once.

redis-py's own retries are off: an unreachable server is ``StoreUnavailable`` at once,
and the rendezvous protocol retries with its backoff for ``retry_timeout``. Nothing from
redis-py escapes; every error says which server and what to do.

Where the server is and how to reach it is ``target.py``; redis-py's errors as sentences,
``errors.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from rallypoint.sdk import RendezvousRequest, StoreError, StoreUnavailable, liveness_ttl
from rallypoint_redis.errors import translate
from rallypoint_redis.target import Target, target_for

logger = logging.getLogger("rallypoint.redis")

T = TypeVar("T")

#: While a wait is idle this long, PING the subscription: a connection to a server that
#: vanished without closing it (a host gone, a partition) must not hold a wait for its
#: whole timeout.
SUBSCRIPTION_CHECK = 5.0

# KEYS[1]: the key, which is also the channel its waiters subscribe to.
_SET_TEXT = """
local existed = redis.call('EXISTS', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
if existed == 0 then redis.call('PUBLISH', KEYS[1], ARGV[1]) end
return 1
"""

# KEYS[2], if given: a key read in the same request (add_and_get), answered beside the sum.
_ADD_TEXT = """
local existed = redis.call('EXISTS', KEYS[1])
local value = redis.call('INCRBY', KEYS[1], ARGV[1])
if existed == 0 then redis.call('PUBLISH', KEYS[1], tostring(value)) end
if KEYS[2] then return {value, redis.call('GET', KEYS[2])} end
return value
"""

# ARGV: 1 if a value is expected (else: the key must be absent), the expected value,
# the desired value.
_COMPARE_SET_TEXT = """
local current = redis.call('GET', KEYS[1])
if (ARGV[1] == '0' and current == false) or (ARGV[1] == '1' and current == ARGV[2]) then
  redis.call('SET', KEYS[1], ARGV[3])
  if current == false then redis.call('PUBLISH', KEYS[1], ARGV[3]) end
  return ARGV[3]
end
if current == false then return '' end
return current
"""


@dataclass(frozen=True)
class _Script:
    """A Lua script and its SHA1, by which EVALSHA names it."""

    text: str
    sha: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


_SET, _ADD, _COMPARE_SET = _Script(_SET_TEXT), _Script(_ADD_TEXT), _Script(_COMPARE_SET_TEXT)


class RedisStore:
    """``CoordinationStore`` on one Redis database (standalone, or a Sentinel master).

    One instance is used by one thread; ``clone`` opens a second connection pool.
    """

    def __init__(self, target: Target, key_ttl: float) -> None:
        self.target = target
        self.key_ttl = key_ttl
        self._client: Any = target.client()
        self._connection: Any = None  # a redis.connection.Connection held for commands
        self._subscriber: Any = None  # a redis.connection.Connection in subscribe mode
        self._channels: set[str] = set()  # what the subscriber is subscribed to
        self._kept: _Pending | None = None  # a wait that timed out, to go on with
        self._alive_keys: set[str] = set()  # what keep_alive set here: deleted by close
        self._closed = False

    # --- errors ---------------------------------------------------------------------------

    def _call(self, operation: Callable[[], T]) -> T:
        try:
            return operation()
        except redis.RedisError as error:
            raise translate(error, self.target) from None
        except Exception as error:
            raise self._broken(error) from None

    def _command(self, *args: Any) -> Any:
        """One command on this store's own connection, its reply as the server sent it.

        Not through ``redis.Redis``'s command methods: those take a connection from the
        pool, check it and give it back, record metrics and convert the reply on every
        call, about three times the CPU of the command itself. A connection that failed
        is dropped; the next command connects again.
        """
        connection = self._connection
        if connection is None:
            connection = self._connection = self._client.connection_pool.get_connection()
        try:
            connection.send_command(*args)
            return connection.read_response()
        except redis.ResponseError:
            raise  # the server answered: the connection is fine
        except BaseException:
            self._drop_connection()
            raise

    def _script(self, script: _Script, keys: Sequence[str], *args: Any) -> Any:
        """Run ``script`` on ``keys``: by its SHA1, or by its text where the server does
        not have it cached (a restarted server, a failover)."""
        try:
            return self._command("EVALSHA", script.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return self._command("EVAL", script.text, len(keys), *keys, *args)

    def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        self._disconnect(connection)

    def _disconnect(self, connection: Any) -> None:
        """Close ``connection`` (if any) and give it back to the pool, which reopens it
        when it is taken again."""
        if connection is not None:
            connection.disconnect()
            self._client.connection_pool.release(connection)

    def _broken(self, error: Exception) -> Exception:
        """A socket error redis-py let through, or any error of a call that ``close()``
        (from another thread: a handler shutting down) pulled the connection from under."""
        if self._closed:
            return StoreError(f"the connection to {self.target.describe} was closed")
        if isinstance(error, (OSError, ValueError)):
            return StoreUnavailable(f"cannot reach {self.target.describe} ({error})")
        return error

    # --- CoordinationStore ----------------------------------------------------------------

    def add(self, key: str, amount: int) -> int:
        return int(self._call(lambda: self._script(_ADD, [key], int(amount))))

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        """``add`` and ``get`` in one script: one round trip."""
        total, value = self._call(lambda: self._script(_ADD, [key, other], int(amount)))
        return int(total), None if value is None else bytes(value)

    def get(self, key: str) -> bytes | None:
        value = self._call(lambda: self._command("GET", key))
        return None if value is None else bytes(value)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        values = self._call(lambda: self._command("MGET", *keys))
        return [None if value is None else bytes(value) for value in values]

    def set(self, key: str, value: bytes) -> None:
        self._call(lambda: self._script(_SET, [key], bytes(value)))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        args = ["0", b""] if expected is None else ["1", bytes(expected)]
        value = self._call(lambda: self._script(_COMPARE_SET, [key], *args, bytes(desired)))
        return bytes(value)

    def keep_alive(self, key: str, ttl: float) -> None:
        # The key lives min(ttl, key_ttl): key_ttl bounds how long a dead agent looks alive.
        milliseconds = max(1, int(min(ttl, self.key_ttl) * 1000))
        self._call(lambda: self._command("SET", key, b"1", "PX", milliseconds))
        self._alive_keys.add(key)

    def alive(self, key: str, ttl: float) -> bool:
        return bool(self._call(lambda: self._command("EXISTS", key)))

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return True
        return self._waiting(wanted, timeout) is not None

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        state = self._waiting([key], timeout)
        if state is None:
            return None
        value = state.values.get(key)
        # Every read keeps the values it found; a message keeps its payload unless empty:
        # a key created empty, or announced by an older rallypoint (which published no
        # value). Then read it.
        return value if value is not None else self.get(key)

    def _waiting(self, keys: list[str], timeout: float) -> _Pending | None:
        """The wait's state once every key exists (with the values it saw), else None."""
        deadline = time.monotonic() + max(0.0, timeout)
        try:
            return self._wait(keys, deadline)
        except redis.RedisError as error:
            self._drop_subscriber()  # its state is unknown now: subscribe afresh next time
            raise translate(error, self.target) from None
        except Exception as error:
            with contextlib.suppress(Exception):
                self._drop_subscriber()
            raise self._broken(error) from None

    def delete_prefix(self, prefix: str) -> int:
        """SCAN for the keys under ``prefix`` (a glob with the prefix's own glob characters
        escaped), UNLINK them a batch at a time: no command blocks the server for long."""
        pattern = re.sub(r"([\\*?\[\]])", r"\\\1", prefix) + "*"

        def delete() -> int:
            deleted = 0
            batch: list[Any] = []
            for key in self._client.scan_iter(match=pattern, count=500):
                batch.append(key)
                if len(batch) >= 500:
                    deleted += int(self._client.unlink(*batch))
                    batch = []
            if batch:
                deleted += int(self._client.unlink(*batch))
            return deleted

        return self._call(delete)

    def clone(self) -> RedisStore:
        """A second store, its connections opened now (one for commands, one for the
        subscription): the thread it is for does not connect on its first call, and a
        server that cannot be reached is ``StoreUnavailable`` here."""
        clone = RedisStore(self.target, self.key_ttl)
        try:
            clone._call(clone._open)
        except BaseException:
            clone.close()
            raise
        return clone

    def _open(self) -> None:
        self._subscription()
        self._command("PING")  # opens the command connection

    def close(self) -> None:
        """Delete the keys kept alive here (the others see this node leave at once), on
        a connection of the pool: ``close`` may come from another thread than the one
        using this store's own; then release the connections."""
        alive_keys, self._alive_keys = self._alive_keys, set()
        if alive_keys and not self._closed:
            with contextlib.suppress(redis.RedisError, OSError, ValueError):
                self._client.delete(*alive_keys)
        self._closed = True
        with contextlib.suppress(redis.RedisError, OSError, ValueError):
            self._drop_subscriber()
        with contextlib.suppress(redis.RedisError, OSError, ValueError):
            self._drop_connection()
        self._client.close()

    # --- waiting --------------------------------------------------------------------------

    def _check(self, state: _Pending, keys: Sequence[str]) -> None:
        """Read ``keys``: those that exist leave ``state.pending``, their values kept."""
        values = self._command("MGET", *keys)  # one request, one reply
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                state.pending.discard(key)
                state.values[key] = bytes(value)

    def _wait(self, keys: list[str], deadline: float) -> _Pending | None:
        kept, self._kept = self._kept, None
        if kept is not None and kept.keys == keys and self._subscriber is not None:
            # The last wait, on these keys, timed out; its subscription saw every key
            # created since it checked them.
            state = kept
        else:
            state = _Pending(keys, list(keys), set(keys))
            if not self._begin(state, deadline):
                return None
        if self._follow(state, deadline):
            return state
        self._kept = state
        return None

    def _begin(self, state: _Pending, deadline: float) -> bool:
        """Subscribe to the channels of the keys not yet there, then read them (a key set
        in between is seen either way). False if the deadline came first."""
        if len(state.keys) > 1 or time.monotonic() >= deadline:
            # Several keys are mostly there already (the leader reading the joiners'
            # records): look first, and subscribe only for those missing.
            self._check(state, state.keys)
            state.missing = sorted(state.pending)
            if not state.pending:
                return True
            if time.monotonic() >= deadline:
                return False
        if self._subscribe(state.missing, deadline) is None:
            return False
        self._check(state, state.missing)
        return True

    def _follow(self, state: _Pending, deadline: float) -> bool:
        """Read the subscription until every pending key was created, or the deadline."""
        subscriber = self._subscriber
        while state.pending:
            ping = state.ping_deadline
            until = min(deadline, ping if ping is not None else state.check_at)
            # At the deadline too: what already arrived still counts.
            if subscriber.can_read(timeout=max(0.0, until - time.monotonic())):
                reply = subscriber.read_response()
                kind = _kind(reply)
                if kind == b"message":
                    key = _text(reply[1])
                    state.pending.discard(key)
                    if reply[2]:  # the value it was created with (rallypoint publishes it)
                        state.values[key] = bytes(reply[2])
                    if not state.pending and len(state.missing) > 1:
                        # Several keys: make sure they all still exist (one may have been
                        # deleted since it was created). One key existed when announced.
                        state.pending = set(state.missing)
                        self._check(state, state.missing)
                elif kind == b"pong":
                    state.ping_deadline = None
                    state.check_at = time.monotonic() + SUBSCRIPTION_CHECK
                    # A key set without a PUBLISH (by another program, or its message lost
                    # with a connection) is found here, within SUBSCRIPTION_CHECK.
                    self._check(state, sorted(state.pending))
                continue
            now = time.monotonic()
            if now >= deadline:
                return False
            if state.ping_deadline is not None and now >= state.ping_deadline:
                raise redis.TimeoutError("the subscription connection stopped answering")
            if state.ping_deadline is None and now >= state.check_at:
                subscriber.send_command("PING")
                state.ping_deadline = now + self.target.socket_timeout
        return True

    def _subscribe(self, channels: list[str], deadline: float) -> Any:
        """Subscribed to exactly ``channels`` (and confirmed), or None at the deadline."""
        subscriber = self._subscription()
        new = [channel for channel in channels if channel not in self._channels]
        stale = sorted(self._channels.difference(channels))
        commands: list[tuple[str, ...]] = []
        if stale:
            commands.append(("UNSUBSCRIBE", *stale))
        if new:
            commands.append(("SUBSCRIBE", *new))
        if not commands:
            return subscriber
        subscriber.send_packed_command(subscriber.pack_commands(commands))
        self._channels = set(channels)
        confirming, leaving = set(new), len(stale)
        while confirming or leaving:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not subscriber.can_read(timeout=remaining):
                self._drop_subscriber()  # replies still due: start clean next time
                return None
            reply = subscriber.read_response()
            kind = _kind(reply)
            if kind == b"subscribe":
                confirming.discard(_text(reply[1]))
            elif kind == b"unsubscribe":
                leaving -= 1
        return subscriber

    def _subscription(self) -> Any:
        if self._subscriber is None:
            self._subscriber = self._client.connection_pool.get_connection()
        return self._subscriber

    def _drop_subscriber(self) -> None:
        subscriber, self._subscriber = self._subscriber, None
        self._channels = set()
        self._kept = None
        self._disconnect(subscriber)


@dataclass
class _Pending:
    """One wait: its keys, those it subscribed for, those not yet created, the values
    it saw, and when to check that the subscription connection still answers."""

    keys: list[str]
    missing: list[str]
    pending: set[str]
    values: dict[str, bytes] = field(default_factory=dict)  # the keys' values, as seen
    check_at: float = field(default_factory=lambda: time.monotonic() + SUBSCRIPTION_CHECK)
    ping_deadline: float | None = None


def _kind(reply: Any) -> bytes:
    if isinstance(reply, list) and reply:
        return bytes(reply[0])
    return b""


def _text(value: Any) -> str:
    return bytes(value).decode("utf-8", "replace")


def connect_store(request: RendezvousRequest) -> RedisStore:
    """A store on the Redis that ``request`` names, checked: the server answers, accepts
    the credentials and the TLS settings. While it cannot be reached the agent retries for
    ``retry_timeout`` (a viewer tries once); other failures are errors at once."""
    target = target_for(request)
    store = RedisStore(target, liveness_ttl(target.options, "key_ttl"))
    try:
        _probe(store, 0.0 if request.viewer else float(target.options["retry_timeout"]))
    except BaseException:
        store.close()
        raise
    return store


def _probe(store: RedisStore, retry_timeout: float) -> None:
    began = time.monotonic()
    delay = 0.1
    while True:
        try:
            store._call(lambda: store._command("PING"))
            break
        except StoreUnavailable as error:
            waited = time.monotonic() - began
            if waited >= retry_timeout:
                tls = (
                    "with TLS on that port" if store.target.tls else "without TLS (else: rediss://)"
                )
                raise StoreError(
                    f"{error}; is redis-server running there, {tls}, and reachable from "
                    "this host?" + (f" (retried for {retry_timeout:g} s)" if retry_timeout else "")
                ) from None
            if delay == 0.1:
                logger.warning("%s; retrying for up to %g s", error, retry_timeout)
            time.sleep(min(delay, retry_timeout - waited))
            delay = min(delay * 2, 2.0)
    # Open the subscription connection now, off the path of the first wait.
    store._call(lambda: store._subscription())
    policy = _eviction_policy(store)
    if policy is not None and policy != "noeviction":
        logger.warning(
            "%s has maxmemory-policy %s: under memory pressure it may evict rendezvous keys "
            "and break a round; set maxmemory-policy noeviction",
            store.target.describe,
            policy,
        )


def _eviction_policy(store: RedisStore) -> str | None:
    """The server's maxmemory-policy, or None where CONFIG is renamed or forbidden."""
    try:
        # On the store's own connection: the pool's would stay open, idle, for the job.
        reply = store._command("CONFIG", "GET", "maxmemory-policy")  # [name, value]
    except redis.ResponseError:
        return None
    except redis.RedisError as error:
        raise translate(error, store.target) from None
    if not isinstance(reply, list) or len(reply) < 2:
        return None
    value = reply[1]
    return value.decode() if isinstance(value, bytes) else str(value)

"""``EtcdStore``: the rendezvous protocol's coordination store on etcd's v3 API.

Each store operation is one etcd request (or a few, for an atomic add that has to convert
a key), and none of them polls:

* ``get_many`` and the "which keys exist" read of ``wait`` are one transaction (or one
  range read when there are more keys than a transaction may hold);
* ``compare_set`` is one transaction comparing the value (or that the key is absent); a
  create-if-absent on a key that exists is answered by a read, which etcd serves without
  a Raft proposal and a WAL write (every node reads the job's round that way);
* ``add`` is one transaction that bumps the key's etcd *version*: a counter key holds a
  base, and its value is that base plus the key's version. Concurrent adds never conflict
  (a compare-and-set counter would retry O(N^2) times when N nodes join at once);
* ``wait`` watches the keys still missing, from the revision of that read, so no write
  between the read and the watch is missed; a watch that timed out is kept for the next
  ``wait`` on the same keys (the heartbeat thread waits on one key in short slices);
  ``wait_value`` reads the value with the key, or takes it from the watch event, so
  every node gets the round's record without another request;
* ``keep_alive`` grants a lease whose ID is derived from the key, then renews it;
  ``alive`` asks etcd for that lease (LeaseTimeToLive). When an agent dies, etcd expires
  its lease; when it leaves, ``close`` revokes it. A heartbeat is one request, and the
  leases hold no keys.

The gRPC calls use ``pyetcd``'s generated stubs and its watcher; endpoints, failover,
authentication tokens and errors are handled here, so that no client-library exception
leaves this module: an unreachable endpoint is ``StoreUnavailable`` (the protocol retries
it, and the next call goes to the next endpoint), anything else a ``StoreError`` that
says what to fix.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rallypoint.redact import redact_endpoint
from rallypoint.rendezvous.store import StoreError, StoreUnavailable

# Set for gRPC's start-up in this process only (the agent's workers inherit os.environ):
# * no fork support: the agent forks its workers (subprocess with preexec_fn) while gRPC
#   threads run, and gRPC's fork handlers then abort about one child in a hundred;
# * a quiet C core: it logs every failed TLS handshake and reconnect to stderr, while the
#   errors that matter reach the user as StoreErrors.
_GRPC_ENVIRONMENT = {"GRPC_ENABLE_FORK_SUPPORT": "false", "GRPC_VERBOSITY": "NONE"}
_saved = {name: os.environ.get(name) for name in _GRPC_ENVIRONMENT}
os.environ.update(_GRPC_ENVIRONMENT)
try:
    import grpc
    from pyetcd import etcdrpc
    from pyetcd.watch import Watcher
finally:
    for _variable, _setting in _saved.items():
        if _setting is None:
            del os.environ[_variable]
        else:
            os.environ[_variable] = _setting

T = TypeVar("T")

DEFAULT_PORT = 2379
#: A counter's value: this marker, then the base (decimal); the counter is base + version.
_MARK = b"\x00rallypoint.counter\x00"
_MARK_END = _MARK[:-1] + b"\x01"  # every value that starts with _MARK sorts below this
#: etcd refuses transactions of more operations (its --max-txn-ops default).
_MAX_TXN_OPS = 128

_UNREACHABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
_TLS_WORDS = ("ssl", "tls", "tsi_", "handshake", "certificate")

# gRPC's defaults back off up to two minutes between reconnects: after a restarted etcd
# is back, the next try should come within a second. Keepalive pings (no more often than
# etcd's --grpc-keepalive-min-time of 5 s) notice a server that went silent.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


# --- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class EtcdConfig:
    """Where etcd is and how to talk to it."""

    endpoints: tuple[tuple[str, int], ...]
    tls: bool = False
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    connect_timeout: float = 5.0
    request_timeout: float = 10.0
    lease_ttl: float | None = None

    @property
    def names(self) -> str:
        return ", ".join(f"{host}:{port}" for host, port in self.endpoints)


def parse_endpoints(text: str) -> tuple[tuple[tuple[str, int], ...], bool]:
    """``host:port[,host:port...]`` -> the endpoints, and whether a scheme asked for TLS.

    Each endpoint may be ``host``, ``host:port``, ``[v6]:port``, or any of these after
    ``http://`` or ``https://`` (etcdctl's form); the port defaults to 2379.
    """
    endpoints: list[tuple[str, int]] = []
    schemes: set[str] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if "@" in item:  # a URL's user:password@ (etcdctl takes them as flags, so do we)
            raise ValueError(
                f"{redact_endpoint(item)!r}: give the user and password with --rdzv-conf "
                "user=...,password=..., not in the endpoint"
            )
        scheme, sep, rest = item.partition("://")
        if sep:
            if scheme not in ("http", "https"):
                raise ValueError(f"{item!r}: the scheme must be http:// or https://")
            schemes.add(scheme)
            item = rest.rstrip("/")
        host, port = item, DEFAULT_PORT
        if item.startswith("["):  # [v6] or [v6]:port
            host, _, after = item[1:].partition("]")
            if after:
                if not after.startswith(":") or not after[1:].isdigit():
                    raise ValueError(f"{raw.strip()!r}: expected [address]:port")
                port = int(after[1:])
        elif item.count(":") == 1:
            host, _, digits = item.partition(":")
            if not digits.isdigit():
                raise ValueError(f"{raw.strip()!r}: expected host:port")
            port = int(digits)
        if not host or not 0 < port < 65536:
            raise ValueError(f"{raw.strip()!r}: expected host:port")
        endpoints.append((host, port))
    if not endpoints:
        raise ValueError("no endpoint given; expected host:port[,host:port...]")
    if len(schemes) > 1:
        raise ValueError("mixes http:// and https:// endpoints; one cluster uses one or the other")
    return tuple(endpoints), schemes == {"https"}


# --- the connection -------------------------------------------------------------------------


class _Unreachable(StoreUnavailable):
    """An endpoint did not answer; ``detail`` is gRPC's reason."""

    def __init__(self, endpoint: str, detail: str) -> None:
        super().__init__(f"etcd at {endpoint} did not answer ({_short(detail)})")
        self.detail = detail


class _Connection:
    """Channels to the endpoints, the one in use, the auth token and the watch stream;
    shared by a store and its clones (gRPC channels are safe to share between threads)."""

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        self.lock = threading.RLock()
        self.credentials = _credentials(config)
        self.channels: dict[int, Any] = {}
        self.current = 0
        self.metadata: tuple[tuple[str, str], ...] | None = None
        self.watcher: Any = None
        self.watches: dict[tuple[bytes, bytes], _SharedWatch] = {}
        self.create_lock = threading.Lock()
        self.users = 1

    # Endpoints and failover ------------------------------------------------------------------

    def endpoint(self, index: int | None = None) -> str:
        host, port = self.config.endpoints[self.current if index is None else index]
        return f"{host}:{port}"

    def channel(self, index: int) -> Any:
        with self.lock:
            channel = self.channels.get(index)
            if channel is None:
                target = self.endpoint(index)
                if self.credentials is None:
                    channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
                else:
                    channel = grpc.secure_channel(
                        target, self.credentials, options=_CHANNEL_OPTIONS
                    )
                self.channels[index] = channel
            return channel

    def fail_over(self, index: int) -> None:
        """The endpoint ``index`` did not answer: the next call goes to the next one."""
        with self.lock:
            if self.current != index:
                return  # another thread has already moved on
            if len(self.config.endpoints) > 1:
                self.current = (index + 1) % len(self.config.endpoints)
            self._drop_watcher()

    def _drop_watcher(self) -> None:
        """End the watch stream (its watches fail, their waiters retry on a new one)."""
        self.watches.clear()
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None

    # Calls -----------------------------------------------------------------------------------

    def call(
        self,
        stub: type,
        method: str,
        request: Any,
        *,
        timeout: float | None = None,
        index: int | None = None,
    ) -> Any:
        """One unary call on the endpoint in use (or ``index``); errors become
        ``StoreError``s."""
        operation = functools.partial(_unary, stub, method, request)
        return self.run(operation, timeout=timeout, index=index)

    def run(
        self,
        operation: Callable[[Any, Any, float], T],
        *,
        timeout: float | None = None,
        index: int | None = None,
    ) -> T:
        """``operation(channel, metadata, timeout)`` on the endpoint in use (or ``index``).

        An expired token (etcd restarted, or the token's TTL passed) is renewed once.
        """
        limit = self.config.request_timeout if timeout is None else timeout
        for attempt in (1, 2):
            with self.lock:
                use = self.current if index is None else index
                metadata = self.metadata
            try:
                return operation(self.channel(use), metadata, limit)
            except grpc.RpcError as error:
                code, details = _code(error), _details(error)
                if code == grpc.StatusCode.UNAUTHENTICATED and attempt == 1 and self.config.user:
                    self.authenticate(use)
                    continue
                if code in _UNREACHABLE:
                    if index is None:
                        self.fail_over(use)
                    raise _Unreachable(self.endpoint(use), details) from None
                raise self.refused(use, code, details) from None
        raise AssertionError("unreachable")

    def refused(self, index: int, code: Any, details: str) -> StoreError:
        """A clear error for an etcd that answered no."""
        where = f"etcd at {self.endpoint(index)}"
        user = self.config.user
        lowered = details.lower()
        if "user name is empty" in lowered or (
            code == grpc.StatusCode.UNAUTHENTICATED and not user
        ):
            return StoreError(
                f"{where} requires authentication: give --rdzv-conf user=NAME,password=SECRET"
            )
        if "authentication failed" in lowered:
            return StoreError(
                f"{where} refused user {user!r}: wrong user name or password "
                "(check the user and password keys of --rdzv-conf)"
            )
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return StoreError(
                f"{where}: user {user!r} lacks permission on the rendezvous keys; grant it a "
                "role with readwrite on the prefix (etcdctl role grant-permission --prefix)"
            )
        if code == grpc.StatusCode.UNIMPLEMENTED or "http2 header" in lowered:
            return StoreError(
                f"{where} answered, but not as etcd v3 ({details}); is --rdzv-endpoint the "
                "address of etcd's client port (2379 by default)?"
            )
        return StoreError(f"{where} refused the request: {details}")

    def authenticate(self, index: int) -> None:
        """Get a token for user/password; every call after carries it."""
        request = etcdrpc.AuthenticateRequest(name=self.config.user, password=self.config.password)
        try:
            reply = _unary(
                etcdrpc.AuthStub,
                "Authenticate",
                request,
                self.channel(index),
                None,
                self.config.request_timeout,
            )
        except grpc.RpcError as error:
            code, details = _code(error), _details(error)
            if "authentication is not enabled" in details:
                with self.lock:  # nothing to do: etcd takes every request as is
                    self.metadata = None
                return
            if code in _UNREACHABLE:
                raise _Unreachable(self.endpoint(index), details) from None
            raise self.refused(index, code, details) from None
        with self.lock:
            self.metadata = (("token", reply.token),)
            self._drop_watcher()  # its stream carries the old token

    def subscribe(self, waiter: _Watch, key: bytes, range_end: bytes, revision: int) -> None:
        """Tell ``waiter`` of every put to ``[key, range_end)`` from ``revision`` on.

        Waits on the same keys share one etcd watch: when every node of a round waits for
        the round's record, etcd keeps one watch per process, not one per node. A watch is
        shared only when it started no later than ``revision``: it has seen every put the
        new waiter must not miss (those already delivered are in ``seen``).
        """
        with self.create_lock:  # one creation at a time (pyetcd's watcher needs it anyway)
            with self.lock:
                shared = self.watches.get((key, range_end))
                if shared is not None and shared.join(waiter, revision):
                    return
                if self.watcher is None:
                    self.watcher = Watcher(
                        etcdrpc.WatchStub(self.channel(self.current)),
                        timeout=self.config.request_timeout,
                        metadata=self.metadata,
                    )
                watcher, index = self.watcher, self.current
            shared = _SharedWatch(revision)
            shared.join(waiter, revision)
            try:
                shared.watch_id = watcher.add_callback(
                    key,
                    shared,
                    range_end=range_end,
                    start_revision=revision,
                    filters=[etcdrpc.WatchCreateRequest.NODELETE],
                )
            except grpc.RpcError as error:
                code, details = _code(error), _details(error)
                if code in _UNREACHABLE:
                    self.fail_over(index)
                    raise _Unreachable(self.endpoint(index), details) from None
                raise self.refused(index, code, details) from None
            except Exception as error:  # pyetcd's WatchTimedOut, RevisionCompactedError
                self.fail_over(index)
                raise StoreUnavailable(
                    f"etcd at {self.endpoint(index)} did not start a watch ({type(error).__name__})"
                ) from None
            with self.lock:
                self.watches[(key, range_end)] = shared

    def unsubscribe(self, waiter: _Watch) -> None:
        """``waiter`` is done; the etcd watch ends with its last waiter."""
        shared = waiter.shared
        if shared is None:
            return
        waiter.shared = None
        with self.lock:
            if not shared.leave(waiter):
                return
            for place, watch in list(self.watches.items()):
                if watch is shared:
                    del self.watches[place]
            watcher = self.watcher
        if watcher is not None and shared.watch_id is not None:
            watcher.cancel(shared.watch_id)

    def close(self) -> None:
        with _POOL_LOCK, self.lock:
            self.users -= 1
            if self.users > 0:
                return
            if _POOL.get(self.config) is self:
                del _POOL[self.config]
            self._drop_watcher()
            channels, self.channels = list(self.channels.values()), {}
        for channel in channels:
            channel.close()


#: The open connections of this process, by configuration: every store of one process
#: that talks to the same cluster as the same user shares one gRPC channel per endpoint
#: and one watch stream (gRPC multiplexes them), rather than a channel, a watch stream
#: and their threads each. One agent has two stores (its heartbeat thread's clone); a
#: benchmark that simulates a thousand agents in one process has two thousand.
_POOL: dict[EtcdConfig, _Connection] = {}
_POOL_LOCK = threading.Lock()


#: The stubs made on each channel. Making a stub builds a callable for every method of its
#: service, which costs more Python time than the request itself: it is done once per
#: channel and service, not once per request.
_STUBS: weakref.WeakKeyDictionary[Any, dict[type, Any]] = weakref.WeakKeyDictionary()
_STUBS_LOCK = threading.Lock()


def _stub(stub: type, channel: Any) -> Any:
    made = _STUBS.get(channel, {}).get(stub)
    if made is None:
        with _STUBS_LOCK:
            made = _STUBS.setdefault(channel, {}).setdefault(stub, stub(channel))
    return made


def _unary(
    stub: type, method: str, request: Any, channel: Any, metadata: Any, timeout: float
) -> Any:
    service = _stub(stub, channel)
    if method == "LeaseKeepAlive":  # a stream: one request, one answer
        replies = service.LeaseKeepAlive(iter([request]), timeout=timeout, metadata=metadata)
        return next(replies, None)
    return getattr(service, method)(request, timeout=timeout, metadata=metadata)


def _lease_unary(
    method: str,
    request: Any,
    answer: tuple[Any, str],
    channel: Any,
    metadata: Any,
    timeout: float,
) -> Any:
    """A call of etcd's Lease service; None when it fails with ``answer`` (a status code and
    a word of its details), which says what the caller wants to know ("exists", "not
    found") rather than that the call went wrong."""
    try:
        return _unary(etcdrpc.LeaseStub, method, request, channel, metadata, timeout)
    except grpc.RpcError as error:
        code, word = answer
        if _code(error) == code and word in _details(error):
            return None
        raise


def _code(error: Any) -> Any:
    code = getattr(error, "code", None)
    return code() if callable(code) else grpc.StatusCode.UNKNOWN


def _details(error: Any) -> str:
    details = getattr(error, "details", None)
    text = details() if callable(details) else None
    return str(text or error).strip()


def _credentials(config: EtcdConfig) -> Any:
    if not (config.tls or config.ca_cert or config.cert or config.key):
        return None
    if bool(config.cert) != bool(config.key):
        raise StoreError("--rdzv-conf: give both cert and key (the client certificate and its key)")

    def read(name: str, path: str | None) -> bytes | None:
        if not path:
            return None
        try:
            with open(os.path.expanduser(path), "rb") as file:
                return file.read()
        except OSError as error:
            shown = "" if name == "key" else f"={path}"  # a private key's path stays private
            raise StoreError(
                f"--rdzv-conf {name}{shown}: cannot read it ({error.strerror})"
            ) from None

    return grpc.ssl_channel_credentials(
        root_certificates=read("ca_cert", config.ca_cert),
        private_key=read("key", config.key),
        certificate_chain=read("cert", config.cert),
    )


# --- the store ------------------------------------------------------------------------------


class _Watch:
    """One ``wait``: the keys it waits for and those still missing."""

    def __init__(
        self, keys: tuple[bytes, ...], missing: set[bytes], found: dict[bytes, Any]
    ) -> None:
        self.keys = keys
        self.missing = missing
        self.found = found  # key -> its KeyValue, as read or as a put announced it
        self.done = threading.Event()
        self.failed = False
        self.shared: _SharedWatch | None = None
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


class _SharedWatch:
    """One etcd watch and the waits it serves; called on the watcher's thread."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.seen: dict[bytes, Any] = {}  # key -> its KeyValue at its latest put since ``start``
        self.waiters: set[_Watch] = set()
        self.ended = False
        self.watch_id: int | None = None
        self.lock = threading.Lock()

    def join(self, waiter: _Watch, revision: int) -> bool:
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

    def leave(self, waiter: _Watch) -> bool:
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


class EtcdStore:
    """``CoordinationStore`` on etcd v3. Thread-confined: use ``clone`` for another thread."""

    def __init__(
        self, config: EtcdConfig, *, probe_key: str = "/", _connection: _Connection | None = None
    ) -> None:
        self._leases: dict[bytes, int] = {}  # key kept alive -> lease TTL
        self._watch: _Watch | None = None
        self._closed = False  # a second close must not let go of the shared connection again
        if _connection is not None:
            self._connection = _connection
            return
        with _POOL_LOCK:
            pooled = _POOL.get(config)
            if pooled is not None:
                with pooled.lock:
                    pooled.users += 1
        if pooled is not None:  # this process already talks to that cluster, checked
            self._connection = pooled
            return
        self._connection = _Connection(config)
        try:
            self._check(probe_key.encode())
        except BaseException:
            self._connection.close()
            raise
        with _POOL_LOCK:
            _POOL.setdefault(config, self._connection)

    @property
    def config(self) -> EtcdConfig:
        return self._connection.config

    def _check(self, probe: bytes) -> None:
        """Reach an endpoint within connect_timeout (trying each in turn), log in, and read
        under the prefix once; else a ``StoreError`` that names the endpoints and the cause."""
        config = self._connection.config
        count = len(config.endpoints)
        deadline = time.monotonic() + config.connect_timeout
        delay = 0.05
        last: dict[int, str] = {}
        while True:
            for index in range(count):
                remaining = deadline - time.monotonic()
                limit = max(0.2, min(remaining, max(1.0, config.connect_timeout / count)))
                try:
                    if config.user:
                        self._connection.authenticate(index)
                    request = etcdrpc.RangeRequest(key=probe, keys_only=True, limit=1)
                    self._connection.call(
                        etcdrpc.KVStub, "Range", request, timeout=limit, index=index
                    )
                except _Unreachable as error:
                    detail = error.detail
                    if any(word in detail.lower() for word in _TLS_WORDS):
                        raise StoreError(
                            f"TLS with etcd at {self._connection.endpoint(index)} failed "
                            f"({_short(detail)}); check --rdzv-conf ca_cert (the CA that signed "
                            "etcd's certificate), and cert and key (etcd asks for a client "
                            "certificate when it runs with --client-cert-auth)"
                        ) from None
                    last[index] = detail
                    continue
                with self._connection.lock:
                    self._connection.current = index
                return
            if time.monotonic() + delay >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        causes = "; ".join(
            f"{self._connection.endpoint(i)}: {_short(d)}" for i, d in sorted(last.items())
        )
        hint = "" if config.tls or config.ca_cert else " (if etcd serves TLS, give ca_cert)"
        raise StoreError(
            f"cannot reach etcd at {config.names} within connect_timeout="
            f"{config.connect_timeout:g} s ({causes}); is etcd running there and is "
            f"--rdzv-endpoint right?{hint}"
        )

    # --- reads ----------------------------------------------------------------------------

    def _range(self, key: bytes, **fields: Any) -> Any:
        return self._connection.call(
            etcdrpc.KVStub, "Range", etcdrpc.RangeRequest(key=key, **fields)
        )

    def _txn(
        self,
        compare: Iterable[Any] = (),
        success: Iterable[Any] = (),
        failure: Iterable[Any] = (),
    ) -> Any:
        request = etcdrpc.TxnRequest(
            compare=list(compare), success=list(success), failure=list(failure)
        )
        return self._connection.call(etcdrpc.KVStub, "Txn", request)

    def _read(self, keys: Sequence[bytes], keys_only: bool = False) -> tuple[dict[bytes, Any], int]:
        """The key-values of ``keys`` that exist, and the revision they were read at, in
        one request: a transaction of reads, or one range read over them all."""
        if len(keys) == 1:
            reply = self._range(keys[0], keys_only=keys_only)
            return {kv.key: kv for kv in reply.kvs}, reply.header.revision
        if len(keys) <= _MAX_TXN_OPS:
            reply = self._txn(
                success=[_get(key, keys_only=keys_only) for key in keys],
            )
            found = {
                kv.key: kv for response in reply.responses for kv in response.response_range.kvs
            }
            return found, reply.header.revision
        wanted = set(keys)
        reply = self._range(min(keys), range_end=max(keys) + b"\x00", keys_only=keys_only)
        return {kv.key: kv for kv in reply.kvs if kv.key in wanted}, reply.header.revision

    def get(self, key: str) -> bytes | None:
        kvs = self._range(key.encode()).kvs
        return _value(kvs[0]) if kvs else None

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        encoded = [key.encode() for key in keys]
        found, _ = self._read(list(dict.fromkeys(encoded)))
        return [_value(found[key]) if key in found else None for key in encoded]

    # --- writes ---------------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        self._connection.call(
            etcdrpc.KVStub, "Put", etcdrpc.PutRequest(key=key.encode(), value=bytes(value))
        )

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        name = key.encode()
        if expected is None:
            # Create-if-absent, mostly called on a key that exists (every node of a job
            # reads the job's round this way): a read answers it. A transaction that may
            # write goes through Raft, a WAL write, even when its comparison fails.
            kvs = self._range(name).kvs
            if kvs:
                return _value(kvs[0])
            compare = _compare(name, "CREATE", create_revision=0)
        else:
            compare = _compare(name, "VALUE", value=bytes(expected))
        reply = self._txn([compare], [_put(name, bytes(desired))], [_get(name)])
        if reply.succeeded:
            return bytes(desired)
        kvs = reply.responses[0].response_range.kvs
        return bytes(kvs[0].value) if kvs else b""

    def add(self, key: str, amount: int) -> int:
        name = key.encode()
        kv: Any = None
        if amount == 0:
            kvs = self._range(name).kvs
            return _counter(name, kvs[0]) if kvs else 0
        if amount == 1:
            count, kv, _ = self._bump(name)
            if count is not None:
                return count
        else:
            kvs = self._range(name).kvs
            kv = kvs[0] if kvs else None
        return self._add_to(name, kv, amount)

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        """``add(key, amount)`` and ``get(other)`` in one request (a transaction)."""
        if amount != 1:
            return self.add(key, amount), self.get(other)
        name = key.encode()
        count, kv, read = self._bump(name, other.encode())
        if count is None:
            count = self._add_to(name, kv, amount)
        return count, (_value(read[0]) if read else None)

    def _bump(self, name: bytes, read: bytes | None = None) -> tuple[int | None, Any, Any]:
        """Add 1 to the counter at ``name`` in one request that also reads key ``read``:
        its new value (None if ``name`` holds no counter, whose key-value comes second),
        and what the read found (its key-values; None without ``read``)."""
        # A counter: bump its version, keeping its base (ignore_value). Absent: create
        # it. Either way one request, and concurrent adds never conflict.
        also = [] if read is None else [_get(read)]
        is_counter = [
            _compare(name, "VALUE", value=_MARK, result="GREATER"),
            _compare(name, "VALUE", value=_MARK_END, result="LESS"),
        ]
        create = etcdrpc.TxnRequest(
            compare=[_compare(name, "CREATE", create_revision=0)],
            success=[_put(name, _MARK + b"0")],
            failure=[_get(name)],
        )
        bump = etcdrpc.RequestOp(
            request_put=etcdrpc.PutRequest(key=name, ignore_value=True, prev_kv=True)
        )
        reply = self._txn(is_counter, [bump, *also], [etcdrpc.RequestOp(request_txn=create), *also])
        found = reply.responses[1].response_range.kvs if also else None
        if reply.succeeded:
            return _counter(name, reply.responses[0].response_put.prev_kv) + 1, None, found
        inner = reply.responses[0].response_txn
        if inner.succeeded:
            return 1, None, found
        return None, inner.responses[0].response_range.kvs[0], found

    def _add_to(self, name: bytes, kv: Any, amount: int) -> int:
        # Another amount, or a key set() as a plain integer: compare-and-set the base.
        while True:
            total = (_counter(name, kv) if kv is not None else 0) + amount
            version = (kv.version if kv is not None else 0) + 1  # the key's, after this put
            guard = (
                _compare(name, "MOD", mod_revision=kv.mod_revision)
                if kv is not None
                else _compare(name, "CREATE", create_revision=0)
            )
            value = _MARK + str(total - version).encode()
            reply = self._txn([guard], [_put(name, value)], [_get(name)])
            if reply.succeeded:
                return total
            kvs = reply.responses[0].response_range.kvs
            kv = kvs[0] if kvs else None

    def delete_prefix(self, prefix: str) -> int:
        """One DeleteRange over the prefix. Liveness is not under it: it is kept in leases,
        which ``close`` revokes (or which expire)."""
        start = prefix.encode()
        reply = self._connection.call(
            etcdrpc.KVStub,
            "DeleteRange",
            etcdrpc.DeleteRangeRequest(key=start, range_end=_prefix_end(start)),
        )
        return int(reply.deleted)

    # --- waiting --------------------------------------------------------------------------

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        wanted = tuple(dict.fromkeys(key.encode() for key in keys))
        if not wanted:
            return True
        return self._wait(wanted, timeout, keys_only=True) is not None

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        """A wait whose read, or the watch event that ends it, carries the value."""
        name = key.encode()
        found = self._wait((name,), timeout, keys_only=False)
        if found is None:
            return None
        kv = found.get(name)
        return _value(kv) if kv is not None and kv.value else self.get(key)

    def _wait(
        self, wanted: tuple[bytes, ...], timeout: float, *, keys_only: bool
    ) -> dict[bytes, Any] | None:
        """Once every key exists, their KeyValues as read or announced (values left out
        of a ``keys_only`` read); None after ``timeout``."""
        deadline = time.monotonic() + timeout
        kept = self._watch
        if kept is not None and kept.keys == wanted and not kept.failed:
            # The last wait on these keys timed out; its watch saw every put since.
            if kept.done.wait(max(0.0, timeout)) and not kept.failed:
                self._drop_watch()
                return kept.found
            if not kept.failed:
                return None
        self._drop_watch()
        found, revision = self._read(wanted, keys_only=keys_only)
        missing = {key for key in wanted if key not in found}
        if not missing:
            return found
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        watch = _Watch(wanted, missing, found)
        try:
            self._connection.subscribe(watch, min(missing), max(missing) + b"\x00", revision + 1)
        except BaseException:
            self._connection.unsubscribe(watch)
            raise
        self._watch = watch
        if watch.done.wait(remaining) and not watch.failed:
            self._drop_watch()
            return watch.found
        if not watch.failed:
            return None  # timed out; the watch stays for the next wait on these keys
        self._drop_watch()
        raise StoreUnavailable(
            f"etcd at {self._connection.endpoint()} ended a watch (the server went away)"
        )

    def _drop_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            self._connection.unsubscribe(watch)

    # --- liveness -------------------------------------------------------------------------

    def lease_seconds(self, ttl: float) -> int:
        """The lease TTL for a heartbeat of ``ttl``: ``lease_ttl`` if shorter (whole
        seconds; etcd raises anything under its minimum, about 2 s)."""
        lease_ttl = self.config.lease_ttl
        seconds = min(ttl, lease_ttl) if lease_ttl else ttl
        return max(1, math.ceil(seconds))

    def keep_alive(self, key: str, ttl: float) -> None:
        """Grant ``key``'s lease (one request), then renew it. Its ID is derived from the
        key, so that any node can ask etcd about it (``alive``) knowing only the key, and
        no key needs attaching to it: a heartbeat costs one request, not a grant and a put."""
        name = key.encode()
        lease_id = _lease_id(name)
        seconds = self.lease_seconds(ttl)
        if self._leases.get(name) == seconds:
            reply = self._connection.call(
                etcdrpc.LeaseStub, "LeaseKeepAlive", etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
            )
            if reply is not None and reply.TTL > 0:
                return
            # The lease expired (etcd was out of reach for longer than it): grant it again.
        if not self._grant(lease_id, seconds):
            # It exists already: a lease of another length (ttl changed), one that expired
            # and etcd has not revoked yet, or the one this node's previous agent held (it
            # was restarted under the same node id). This node owns it: start it anew
            # (it may have expired meanwhile: "not found" is an answer too).
            revoke = etcdrpc.LeaseRevokeRequest(ID=lease_id)
            self._lease("LeaseRevoke", revoke, (grpc.StatusCode.NOT_FOUND, "not found"))
            if not self._grant(lease_id, seconds):
                raise StoreError(
                    f"etcd at {self._connection.endpoint()} kept lease {lease_id:x} of "
                    f"{key!r} after revoking it; is another agent running as this node?"
                )
        self._leases[name] = seconds

    def _grant(self, lease_id: int, seconds: int) -> bool:
        """Grant lease ``lease_id``; False if it exists already."""
        request = etcdrpc.LeaseGrantRequest(ID=lease_id, TTL=seconds)
        exists = (grpc.StatusCode.FAILED_PRECONDITION, "exists")
        return self._lease("LeaseGrant", request, exists) is not None

    def _lease(self, method: str, request: Any, answer: tuple[Any, str]) -> Any:
        """``_lease_unary`` on the endpoint in use (errors become ``StoreError``s)."""
        return self._connection.run(functools.partial(_lease_unary, method, request, answer))

    def alive(self, key: str, ttl: float) -> bool:
        """Whether ``key``'s lease exists: etcd deletes it when it expires or is revoked
        (it answers TTL -1 for a lease it does not have)."""
        request = etcdrpc.LeaseTimeToLiveRequest(ID=_lease_id(key.encode()))
        reply = self._connection.call(etcdrpc.LeaseStub, "LeaseTimeToLive", request)
        return int(reply.TTL) >= 0

    def _revoke(self, lease_id: int) -> None:
        with contextlib.suppress(StoreError):  # else it expires by itself
            self._connection.call(
                etcdrpc.LeaseStub,
                "LeaseRevoke",
                etcdrpc.LeaseRevokeRequest(ID=lease_id),
                timeout=1.0,
            )

    # --- connections ----------------------------------------------------------------------

    def clone(self) -> EtcdStore:
        with self._connection.lock:
            self._connection.users += 1
        return EtcdStore(self.config, _connection=self._connection)

    def close(self) -> None:
        """Release the connection; the leases of the keys kept alive here are revoked now,
        so the other nodes see this one leave at once, not after the TTL."""
        if self._closed:
            return
        self._closed = True
        self._drop_watch()
        kept, self._leases = list(self._leases), {}
        for name in kept:
            self._revoke(_lease_id(name))
        self._connection.close()


# --- request building -----------------------------------------------------------------------


def _compare(key: bytes, target: str, *, result: str = "EQUAL", **value: Any) -> Any:
    return etcdrpc.Compare(
        key=key,
        target=getattr(etcdrpc.Compare, target),
        result=getattr(etcdrpc.Compare, result),
        **value,
    )


def _put(key: bytes, value: bytes) -> Any:
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=value))


def _get(key: bytes, *, keys_only: bool = False) -> Any:
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key, keys_only=keys_only))


def _lease_id(key: bytes) -> int:
    """The ID of the lease that keeps ``key``'s owner alive: 63 bits of a hash of the key
    (etcd lets a client choose a lease's ID; it must be positive). Keys hold the run id and
    the node id, so two nodes, or two jobs on one etcd, never share a lease."""
    digest = hashlib.blake2b(key, digest_size=8, person=b"rallypoint-hb").digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


def _prefix_end(prefix: bytes) -> bytes:
    """The end of the range of keys that start with ``prefix`` (etcdctl's --prefix)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # every key


def _value(kv: Any) -> bytes:
    """A key's value as the store's users see it: a counter reads as its decimal total."""
    value = bytes(kv.value)
    if value.startswith(_MARK) and len(value) > len(_MARK):
        return str(_counter(kv.key, kv)).encode()
    return value


def _counter(key: bytes, kv: Any) -> int:
    value = bytes(kv.value)
    try:
        if value.startswith(_MARK):
            return int(value[len(_MARK) :]) + int(kv.version)
        return int(value)
    except ValueError:
        raise StoreError(
            f"etcd key {key.decode(errors='replace')!r} holds {value[:40]!r}, not a counter; "
            "is another program writing under the rendezvous prefix?"
        ) from None


def _short(detail: str) -> str:
    """gRPC's reason without its address list and OpenSSL's codes, for one-line errors."""
    text = detail.replace("failed to connect to all addresses; last error: ", "")
    text = text.rpartition("OPENSSL_internal:")[2] or text
    text = re.sub(r"^[A-Z_]+: (ipv[46]:\S+|unix:\S+): ", "", text)
    text = text.removesuffix(": OK")
    return text if len(text) <= 160 else text[:157] + "..."

"""The gRPC side of the etcd store: channels to the endpoints, failover between them,
authentication tokens, the watch stream, and the errors.

The calls use ``pyetcd``'s generated stubs and its watcher; no client-library exception
leaves this package: an unreachable endpoint is ``StoreUnavailable`` (the protocol
retries it, and the next call goes to the next endpoint), anything else a ``StoreError``
that says what to fix. Every store of one process that talks to the same cluster as the
same user shares one ``Connection`` (``pooled``, ``share``).
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from rallypoint.sdk import StoreError, StoreUnavailable
from rallypoint_etcd.config import EtcdConfig
from rallypoint_etcd.watches import SharedWatch, Watch

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

# What store.py uses; grpc and etcdrpc are taken from here, so that gRPC always starts
# with the environment above, whichever module imports it first.
__all__ = ["Connection", "etcdrpc", "grpc", "lease_unary", "pooled", "share"]

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


class _Unreachable(StoreUnavailable):
    """An endpoint did not answer; ``detail`` is gRPC's reason."""

    def __init__(self, endpoint: str, detail: str) -> None:
        super().__init__(f"etcd at {endpoint} did not answer ({_short(detail)})")
        self.detail = detail


class Connection:
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
        self.watches: dict[tuple[bytes, bytes], SharedWatch] = {}
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

    def check(self, probe: bytes) -> None:
        """Reach an endpoint within connect_timeout (trying each in turn), log in, and read
        under the prefix once; else a ``StoreError`` that names the endpoints and the cause."""
        config = self.config
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
                        self.authenticate(index)
                    request = etcdrpc.RangeRequest(key=probe, keys_only=True, limit=1)
                    self.call(etcdrpc.KVStub, "Range", request, timeout=limit, index=index)
                except _Unreachable as error:
                    detail = error.detail
                    if any(word in detail.lower() for word in _TLS_WORDS):
                        raise StoreError(
                            f"TLS with etcd at {self.endpoint(index)} failed "
                            f"({_short(detail)}); check --rdzv-conf ca_cert (the CA that signed "
                            "etcd's certificate), and cert and key (etcd asks for a client "
                            "certificate when it runs with --client-cert-auth)"
                        ) from None
                    last[index] = detail
                    continue
                with self.lock:
                    self.current = index
                return
            if time.monotonic() + delay >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        causes = "; ".join(f"{self.endpoint(i)}: {_short(d)}" for i, d in sorted(last.items()))
        hint = "" if config.tls or config.ca_cert else " (if etcd serves TLS, give ca_cert)"
        raise StoreError(
            f"cannot reach etcd at {config.names} within connect_timeout="
            f"{config.connect_timeout:g} s ({causes}); is etcd running there and is "
            f"--rdzv-endpoint right?{hint}"
        )

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

    def subscribe(self, waiter: Watch, key: bytes, range_end: bytes, revision: int) -> None:
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
            shared = SharedWatch(revision)
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

    def unsubscribe(self, waiter: Watch) -> None:
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
_POOL: dict[EtcdConfig, Connection] = {}
_POOL_LOCK = threading.Lock()


def pooled(config: EtcdConfig) -> Connection | None:
    """The connection this process already has to ``config``'s cluster, counted as used
    once more; None if it has none."""
    with _POOL_LOCK:
        connection = _POOL.get(config)
        if connection is not None:
            with connection.lock:
                connection.users += 1
        return connection


def share(connection: Connection) -> None:
    """Offer ``connection``, checked, to the stores this process opens next."""
    with _POOL_LOCK:
        _POOL.setdefault(connection.config, connection)


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


def lease_unary(
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


def _short(detail: str) -> str:
    """gRPC's reason without its address list and OpenSSL's codes, for one-line errors."""
    text = detail.replace("failed to connect to all addresses; last error: ", "")
    text = text.rpartition("OPENSSL_internal:")[2] or text
    text = re.sub(r"^[A-Z_]+: (ipv[46]:\S+|unix:\S+): ", "", text)
    text = text.removesuffix(": OK")
    return text if len(text) <= 160 else text[:157] + "..."

"""The ``c10d`` backend's store: torch's TCPStore, hosted by one of the agents.

torch is imported here only, when a multi-node ``c10d`` job starts. The agent whose host
is the endpoint's hosts the store (or the one told ``is_host=true``); when that agent dies
the store dies with it, and the other agents report it: use etcd or Redis where the job
must survive the loss of any node. A connection that breaks while the host still listens
(a network blip, a partition) is ``StoreUnavailable``: the next call connects again, and
the protocol retries meanwhile. An agent that was to host the store but finds its port
taken joins the store there only if an agent of its job hosts it, which that agent's mark
in the store tells (``HostMark``); else it stops, saying so.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rallypoint.interfaces import StoreError, StoreUnavailable
from rallypoint.rendezvous.liveness import CounterLiveness

T = TypeVar("T")

logger = logging.getLogger("rallypoint.rendezvous")

#: The longest one attempt to connect again may take: the protocol retries it with backoff.
RECONNECT_TIMEOUT = 5.0
#: The longest one of torch's blocking waits lasts; a longer ``wait`` is made of several.
WAIT_SLICE = 1.0
#: How long an agent that was to host the store, and found its port taken, waits for the
#: mark of the agent that hosts it (``HostMark``): it writes it as it starts the store.
HOST_MARK_WAIT = 5.0
#: How long it may take to connect to what listens there first: torch's client looks the
#: host up in DNS on every connect (a resolver's timeout is 5 s), and a loaded host is
#: slower still; a listener that is no TCPStore never answers and costs this much.
HOST_CONNECT_WAIT = 20.0
#: What ``get`` compares keys with: no rendezvous record or counter is ever this value.
_READ = b"\x00rallypoint: read, do not write\x00"


def _is_local(host: str) -> bool:
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    if address.startswith("127."):
        return True
    local = {socket.gethostname(), socket.getfqdn()}
    with contextlib.suppress(OSError):
        local |= {socket.gethostbyname(name) for name in list(local)}
    return host in local or address in local


@dataclass(frozen=True)
class HostMark:
    """The key the agent that hosts a job's store writes into it at once, naming its node,
    sealed with the job token when there is one. An agent that was to host the store but
    finds the port taken joins only a store that holds it: another agent of the job on
    this host (several agents of a host is common in tests), not whatever listens there."""

    key: str
    node: str
    token: bytes | None = field(default=None, repr=False)
    #: The flag that chooses the store's port, named in the refusal.
    flag: str = "--rdzv-endpoint"

    def value(self) -> bytes:
        if self.token is None:
            return self.node.encode()
        from rallypoint.rendezvous.signing import Seal

        return Seal(self.token).seal(self.key, self.node.encode())

    def read(self, raw: bytes) -> str | None:
        """The hosting node ``raw`` names, or None when it is not this job's mark."""
        if self.token is not None:
            from rallypoint.rendezvous.signing import Seal

            opened = Seal(self.token).open(self.key, raw)
            if opened is None:
                return None
            raw = opened
        return raw.decode(errors="replace") or None


class TCPStoreClient(CounterLiveness):
    """``CoordinationStore`` on a torch TCPStore; liveness by heartbeat counters."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        is_host: bool | None,
        timeout: float,
        mark: HostMark | None = None,
    ) -> None:
        """``mark``: what the agent that hosts writes, and what one that was to host but
        finds the port taken checks before it joins the store there (``HostMark``)."""
        super().__init__()
        # torch's C++ logging would print a warning for every wait that times out (the last
        # call ends that way); quiet it for this process only, not for the workers.
        saved = os.environ.get("TORCH_CPP_LOG_LEVEL")
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        try:
            import torch.distributed as dist
        finally:
            if saved is None:
                del os.environ["TORCH_CPP_LOG_LEVEL"]
            else:
                os.environ["TORCH_CPP_LOG_LEVEL"] = saved

        self.host, self.port, self.timeout = host, port, timeout
        self._seen_keys: set[str] = set()  # keys a wait of this client saw exist
        # Keys written through this client and its clones: TCPStore cannot list its keys,
        # so delete_prefix deletes these.
        self._written: set[str] = set()
        self._dist = dist
        self._closed = False
        hosting = _is_local(host) if is_host is None else is_host
        self.hosting = False
        if hosting:
            try:
                self._store: Any = self._connect(host, port, True)
            except (RuntimeError, dist.DistStoreError) as error:
                if mark is not None and _in_use(error):  # an agent of this job, or not
                    self._store = self._join_host(port, mark)
                    return
                if is_host:
                    raise StoreError(
                        f"cannot host the c10d store on port {port} ({error}); is the port taken?"
                    ) from None
                # The port is taken here: another agent of this host hosts it; join it.
            else:
                self.hosting = True
                if mark is not None:  # not through set: never deleted with the run's keys
                    self._store.set(mark.key, mark.value())
                return
        try:
            self._store = self._connect(host, port, False)
        except (RuntimeError, dist.DistStoreError) as error:
            raise StoreError(
                f"cannot reach the c10d store at {host}:{port} ({error}); is the agent that "
                "hosts it (the one on the endpoint's host) running?"
            ) from None

    def _join_host(self, port: int, mark: HostMark) -> Any:
        """The store another agent of this job hosts on this host's ``port``, which this
        agent found taken; ``StoreError`` when no such agent's mark is there within
        HOST_MARK_WAIT seconds."""
        refusal = (
            f"port {port} on this host is taken by a process that is not an agent of this "
            f"job ({{}}); free the port, or choose another port with {mark.flag}"
        )
        # torch's client waits for a listener's answer with no bound: one that is no
        # TCPStore may never give it. So it connects in a thread of its own, given up on
        # (left behind, a daemon) after HOST_CONNECT_WAIT seconds.
        connected: dict[str, Any] = {}

        def connect() -> None:
            try:
                connected["store"] = self._connect(self.host, port, False, HOST_CONNECT_WAIT)
            except (RuntimeError, self._dist.DistStoreError) as error:
                connected["error"] = error

        thread = threading.Thread(target=connect, name="rallypoint-store-probe", daemon=True)
        thread.start()
        thread.join(HOST_CONNECT_WAIT)
        deadline = time.monotonic() + HOST_MARK_WAIT
        if "store" not in connected:
            error = connected.get("error")
            why = "no answer" if error is None else _first_line(error)
            raise StoreError(refusal.format(f"{why} as a TCPStore"))
        store = connected["store"]
        raw = None
        while raw is None and (left := deadline - time.monotonic()) > 0:
            try:
                store.wait([mark.key], datetime.timedelta(seconds=left))
                if store.check([mark.key]):  # a wait may be woken by a read of the key
                    raw = bytes(store.get(mark.key))
            except (RuntimeError, self._dist.DistStoreError):
                break  # timed out, or it is no store of ours
        node = None if raw is None else mark.read(raw)
        if node is None and raw is not None and mark.token is not None:
            from rallypoint.rendezvous.signing import MISMATCH, sealed

            if sealed(raw):  # the job's, with another token (or a squatter's look-alike)
                raise StoreError(f"the c10d store on port {port} of this host: {MISMATCH}")
        if node is None:
            found = "no mark of an agent of this job" if raw is None else "a mark it cannot prove"
            raise StoreError(refusal.format(f"{found} after {HOST_MARK_WAIT:g} s"))
        logger.info(
            "another agent of this host (node %s) hosts the c10d store on port %d: joining it",
            node, port,
        )  # fmt: skip
        store.set_timeout(datetime.timedelta(seconds=self.timeout))
        return store

    def _connect(self, host: str, port: int, is_master: bool, timeout: float | None = None) -> Any:
        return self._dist.TCPStore(  # type: ignore[attr-defined]
            host,
            port,
            is_master=is_master,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout if timeout is None else timeout),
            use_libuv=True,
        )

    def _connection(self) -> Any:
        """The TCPStore client; connected again if the last call broke the connection."""
        if self._closed:
            raise StoreError(
                f"the connection to the c10d store at {self.host}:{self.port} was closed"
            )
        if self._store is None:
            try:
                store = self._connect(
                    self.host, self.port, False, min(self.timeout, RECONNECT_TIMEOUT)
                )
                store.set_timeout(datetime.timedelta(seconds=self.timeout))
            except (RuntimeError, self._dist.DistStoreError) as error:
                raise self._failed(error, connecting=True) from None
            self._store = store
        return self._store

    def _call(self, name: str, *args: Any) -> Any:
        store = self._connection()
        try:
            return getattr(store, name)(*args)
        except (RuntimeError, self._dist.DistStoreError) as error:
            raise self._failed(error) from None

    def _failed(self, error: Exception, connecting: bool = False) -> StoreError:
        """A broken connection is ``StoreUnavailable`` while the host still listens (the
        network failed: connect again on the next call); else the store went with the
        agent that hosted it."""
        broken = connecting or isinstance(error, self._dist.DistNetworkError)
        if broken and not self.hosting and not self._closed:
            self._store = None
            if self._host_listens():
                return StoreUnavailable(
                    f"lost the connection to the c10d store at {self.host}:{self.port} "
                    f"({_first_line(error)}); connecting again"
                )
        return StoreError(
            f"the c10d store at {self.host}:{self.port} failed ({_first_line(error)}); the "
            "agent hosting it may have died, which a c10d job cannot survive (use etcd or "
            "redis for that)"
        )

    def _host_listens(self) -> bool:
        """Whether the host's port takes connections: only a refusal says the store is
        gone (a partition drops or delays the attempt instead)."""
        try:
            socket.create_connection((self.host, self.port), timeout=1.0).close()
        except ConnectionRefusedError:
            return False
        except OSError:
            return True
        return True

    def add(self, key: str, amount: int) -> int:
        if amount:
            self._written.add(key)
        return int(self._call("add", key, amount))

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        # TCPStore has no request that does both: two round trips.
        return self.add(key, amount), self.get(other)

    def get(self, key: str) -> bytes | None:
        # TCPStore's own get waits for the key (two round trips, and it blocks while the
        # key is absent). A compare-and-set that never matches reads in one round trip,
        # without blocking: it answers the value, or `expected` when the key is absent,
        # and writes nothing (a key holding _READ would be set to _READ again).
        value = bytes(self._call("compare_set", key, _READ, _READ))
        return None if value == _READ else value

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        known = all(key in self._seen_keys for key in keys)
        if known or self._call("check", list(keys)):  # all there: one request for every value
            return [bytes(value) for value in self._call("multi_get", list(keys))]
        return [self.get(key) for key in keys]

    def set(self, key: str, value: bytes) -> None:
        self._written.add(key)
        self._call("set", key, value)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        self._written.add(key)
        value = bytes(self._call("compare_set", key, expected or b"", desired))
        if expected is not None and value == expected != desired:
            return b""  # TCPStore answers `expected` when the key is absent
        return value

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        store = self._connection()

        def attempt(slice_: datetime.timedelta) -> bool | None:
            store.wait(list(keys), slice_)
            # TCPStore wakes a key's waiters on every compare-and-set of it, the one that
            # finds it absent too (what ``get`` sends, and what any client may): woken is
            # not written. None: wait on.
            return True if store.check(list(keys)) else None

        if self._in_slices(timeout, attempt) is None:
            return False
        self._seen_keys.update(keys)
        return True

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        # A wait, then the non-blocking read: two round trips, like TCPStore's own get,
        # which under load (a wait cancelled at the end of a short slice) was seen to
        # answer an empty value for a key nobody had written.
        deadline = time.monotonic() + timeout
        while self.wait([key], max(0.0, deadline - time.monotonic())):
            value = self.get(key)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                break
        return None

    def _in_slices(self, timeout: float, attempt: Callable[[datetime.timedelta], T]) -> T | None:
        """``attempt(slice)``, a blocking TCPStore call, until it returns; None once
        ``timeout`` passed. In slices of at most WAIT_SLICE: torch's C++ waits hold the
        thread past signals, and the agent leaves a rendezvous on SIGTERM (its handler
        runs between two slices)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                result = attempt(datetime.timedelta(seconds=min(max(left, 0.001), WAIT_SLICE)))
                if result is not None:
                    return result
                if left <= 0:
                    return None
                # Woken for nothing: wait on, a little later (a stray may wake it in a loop).
                time.sleep(min(0.01, max(0.0, left)))
                continue
            except (RuntimeError, self._dist.DistStoreError) as error:
                timed_out = isinstance(error, self._dist.DistStoreError) and (
                    "timeout" in str(error).lower()
                )
                if not timed_out:
                    raise self._failed(error) from None
                if left <= WAIT_SLICE:
                    return None

    def delete_prefix(self, prefix: str) -> int:
        """Delete the keys under ``prefix`` that this client and its clones wrote (TCPStore
        cannot list keys; its store ends with the agent hosting it anyway)."""
        deleted = 0
        for key in sorted(k for k in self._written if k.startswith(prefix)):
            if self._call("delete_key", key):
                deleted += 1
            self._written.discard(key)
        self._seen_keys = {k for k in self._seen_keys if not k.startswith(prefix)}
        return deleted

    def clone(self) -> TCPStoreClient:
        clone = object.__new__(TCPStoreClient)
        clone.host, clone.port, clone.timeout, clone._dist = (
            self.host,
            self.port,
            self.timeout,
            self._dist,
        )
        clone.hosting = False
        clone._closed = False
        clone._seen_keys = set()
        clone._written = self._written
        try:
            clone._store = self._connection().clone()
        except (RuntimeError, self._dist.DistStoreError) as error:
            raise self._failed(error) from None
        self._share_liveness(clone)
        return clone

    def close(self) -> None:
        if not self._closed and self._store is not None:
            self.end_liveness()
        self._closed = True
        self._store = None


def _in_use(error: Exception) -> bool:
    """Whether torch failed to host a store because the port is taken."""
    text = str(error)
    return "EADDRINUSE" in text or "already in use" in text.lower()


def _first_line(error: Exception) -> str:
    """torch's message without the C++ stack trace it may carry."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

"""The ``c10d`` backend's store: torch's TCPStore, hosted by one of the agents.

torch is imported here only, when a multi-node ``c10d`` job starts. The agent whose host
is the endpoint's hosts the store (or the one told ``is_host=true``); when that agent dies
the store dies with it, and the other agents report it: use etcd or Redis where the job
must survive the loss of any node.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Sequence
from typing import Any

from rallypoint.rendezvous.store import CounterLiveness, StoreError


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


class TCPStoreClient(CounterLiveness):
    """``CoordinationStore`` on a torch TCPStore; liveness by heartbeat counters."""

    def __init__(self, host: str, port: int, *, is_host: bool | None, timeout: float) -> None:
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
        self._dist = dist
        hosting = _is_local(host) if is_host is None else is_host
        self.hosting = False
        if hosting:
            try:
                self._store: Any = self._connect(host, port, True)
                self.hosting = True
                return
            except (RuntimeError, dist.DistStoreError) as error:
                if is_host:
                    raise StoreError(
                        f"cannot host the c10d store on port {port} ({error}); is the port taken?"
                    ) from None
                # The port is taken here: another agent of this host hosts it; join it.
        try:
            self._store = self._connect(host, port, False)
        except (RuntimeError, dist.DistStoreError) as error:
            raise StoreError(
                f"cannot reach the c10d store at {host}:{port} ({error}); is the agent that "
                "hosts it (the one on the endpoint's host) running?"
            ) from None

    def _connect(self, host: str, port: int, is_master: bool) -> Any:
        return self._dist.TCPStore(  # type: ignore[attr-defined]
            host,
            port,
            is_master=is_master,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout),
            use_libuv=True,
        )

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._store, name)(*args)
        except (RuntimeError, self._dist.DistStoreError) as error:
            raise self._failed(error) from None

    def _failed(self, error: Exception) -> StoreError:
        return StoreError(
            f"the c10d store at {self.host}:{self.port} failed ({error}); the agent hosting "
            "it may have died, which a c10d job cannot survive (use etcd or redis for that)"
        )

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def get(self, key: str) -> bytes | None:
        # TCPStore's get blocks until the key exists: check first, unless a wait of this
        # client already saw it (the protocol never deletes keys).
        if key not in self._seen_keys and not self._call("check", [key]):
            return None
        return bytes(self._call("get", key))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        known = all(key in self._seen_keys for key in keys)
        if known or self._call("check", list(keys)):  # all there: one request for every value
            return [bytes(value) for value in self._call("multi_get", list(keys))]
        return [self.get(key) for key in keys]

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, value)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        value = bytes(self._call("compare_set", key, expected or b"", desired))
        if expected is not None and value == expected != desired:
            return b""  # TCPStore answers `expected` when the key is absent
        return value

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        try:
            self._store.wait(list(keys), datetime.timedelta(seconds=max(timeout, 0.001)))
        except (RuntimeError, self._dist.DistStoreError) as error:
            if isinstance(error, self._dist.DistStoreError) and "timeout" in str(error).lower():
                return False
            raise self._failed(error) from None
        self._seen_keys.update(keys)
        return True

    def clone(self) -> TCPStoreClient:
        clone = object.__new__(TCPStoreClient)
        clone.host, clone.port, clone.timeout, clone._dist = (
            self.host,
            self.port,
            self.timeout,
            self._dist,
        )
        clone.hosting = False
        clone._seen_keys = set()
        clone._store = self._store.clone()
        self._share_liveness(clone)
        return clone

    def close(self) -> None:
        self._store = None

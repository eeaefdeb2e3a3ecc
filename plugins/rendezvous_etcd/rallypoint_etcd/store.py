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

The gRPC side (endpoints, failover, authentication, errors) is ``connection.py``; the
bookkeeping of waits is ``watches.py``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

from rallypoint.sdk import StoreError, StoreUnavailable
from rallypoint_etcd.config import EtcdConfig
from rallypoint_etcd.connection import Connection, etcdrpc, grpc, lease_unary, pooled, share
from rallypoint_etcd.watches import Watch

#: A counter's value: this marker, then the base (decimal); the counter is base + version.
_MARK = b"\x00rallypoint.counter\x00"
_MARK_END = _MARK[:-1] + b"\x01"  # every value that starts with _MARK sorts below this
#: etcd refuses transactions of more operations (its --max-txn-ops default).
_MAX_TXN_OPS = 128


class EtcdStore:
    """``CoordinationStore`` on etcd v3. Thread-confined: use ``clone`` for another thread."""

    def __init__(
        self, config: EtcdConfig, *, probe_key: str = "/", _connection: Connection | None = None
    ) -> None:
        self._leases: dict[bytes, int] = {}  # key kept alive -> lease TTL
        self._watch: Watch | None = None
        self._closed = False  # a second close must not let go of the shared connection again
        if _connection is not None:
            self._connection = _connection
            return
        shared = pooled(config)
        if shared is not None:  # this process already talks to that cluster, checked
            self._connection = shared
            return
        self._connection = Connection(config)
        try:
            self._connection.check(probe_key.encode())
        except BaseException:
            self._connection.close()
            raise
        share(self._connection)

    @property
    def config(self) -> EtcdConfig:
        return self._connection.config

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
        watch = Watch(wanted, missing, found)
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
        """``lease_unary`` on the endpoint in use (errors become ``StoreError``s)."""
        return self._connection.run(functools.partial(lease_unary, method, request, answer))

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

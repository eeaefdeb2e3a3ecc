"""The etcd store against the store conformance suite, on a real etcd server."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from etcd_servers import PASSWORD, USER, Restartable
from pyetcd import etcdrpc

from rallypoint.sdk import StoreError, StoreUnavailable
from rallypoint.testing.helpers import RetryingStore
from rallypoint.testing.store_conformance import Connect, StoreConformance
from rallypoint_etcd.config import EtcdConfig, parse_endpoints
from rallypoint_etcd.store import EtcdStore, _lease_id
from servers import EtcdServer


def store_config(server: EtcdServer, **fields: object) -> EtcdConfig:
    endpoints, _ = parse_endpoints(server.endpoint)
    return EtcdConfig(endpoints=endpoints, **fields)  # type: ignore[arg-type]


class TestEtcdStore(StoreConformance):
    liveness_is_a_key = False  # a lease, revoked by close

    @pytest.fixture
    def connect(self, etcd_server_session: EtcdServer) -> Connect:
        config = store_config(etcd_server_session)
        return lambda: EtcdStore(config)

    @pytest.fixture
    def outage(self, etcd_server_session: EtcdServer) -> Callable[[float], None]:
        def pause(seconds: float) -> None:  # the server freezes, its connections stay open
            os.kill(etcd_server_session.pid, signal.SIGSTOP)
            try:
                time.sleep(seconds)
            finally:
                os.kill(etcd_server_session.pid, signal.SIGCONT)

        return pause


# --- what the suite does not cover: etcd's own mechanisms -------------------------------------


@pytest.fixture
def store(etcd_server_session: EtcdServer) -> Iterator[EtcdStore]:
    client = EtcdStore(store_config(etcd_server_session))
    yield client
    client.close()


@pytest.fixture
def prefix() -> str:
    return f"/etcd-tests/{uuid.uuid4().hex}/"


def test_endpoints_parse() -> None:
    assert parse_endpoints("a:1, b:2,c") == ((("a", 1), ("b", 2), ("c", 2379)), False)
    assert parse_endpoints("https://a:1,https://b:2/") == ((("a", 1), ("b", 2)), True)
    assert parse_endpoints("[::1]:3") == ((("::1", 3),), False)
    for bad in ("", "a:x", "ftp://a:1", "http://a:1,https://b:2", "a:99999"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)


def test_a_counter_reads_as_its_total_and_mixes_with_set(store: EtcdStore, prefix: str) -> None:
    key = prefix + "n"
    assert [store.add(key, 1) for _ in range(3)] == [1, 2, 3]
    assert store.get(key) == b"3"
    assert store.get_many([key]) == [b"3"]
    assert store.add(key, -2) == 1
    assert store.add(key, 1) == 2
    store.set(key, b"40")  # a plain integer, as set() leaves it
    assert store.add(key, 1) == 41
    assert store.add(key, 1) == 42
    store.set(key, b"not a number")
    with pytest.raises(StoreError, match="not a counter"):
        store.add(key, 1)


def test_many_keys_in_one_read_and_one_wait(store: EtcdStore, prefix: str) -> None:
    keys = [f"{prefix}node/{i}" for i in range(1, 301)]  # over etcd's 128 operations a txn
    for key in keys[:-1]:
        store.set(key, key.encode())
    store.set(prefix + "node/zz-unrelated", b"x")  # inside the range read, not asked for
    values = store.get_many(keys)
    assert values[:-1] == [key.encode() for key in keys[:-1]] and values[-1] is None
    assert not store.wait(keys, 0.2)
    threading.Timer(0.2, store.clone().set, args=(keys[-1], b"last")).start()
    assert store.wait(keys, 10)


def test_a_closed_store_leaves_at_once(
    etcd_server_session: EtcdServer, store: EtcdStore, prefix: str
) -> None:
    config = store_config(etcd_server_session)
    leaving = EtcdStore(config)
    leaving.keep_alive(prefix + "hb/left", 30)
    assert store.alive(prefix + "hb/left", 30)
    leaving.close()  # revokes its lease: no need to wait 30 s
    assert not store.alive(prefix + "hb/left", 30)


def test_a_wait_that_shares_a_watch_sees_puts_and_deletes(
    etcd_server_session: EtcdServer, prefix: str
) -> None:
    # Stores of one process share a connection and waits on the same key share its
    # watch: what the watch saw before a delete must not answer a wait after it.
    key = prefix + "round/closed"
    timers: list[threading.Timer] = []
    with _clients(etcd_server_session, 3) as (holder, waiter, writer):
        try:
            assert not holder.wait([key], 0.2)  # its watch of the key is kept
            timers.append(threading.Timer(0.3, writer.set, args=(key, b"first")))
            timers[-1].start()
            assert waiter.wait_value(key, 10) == b"first"
            writer.delete_prefix(prefix)
            assert not waiter.wait([key], 0.5), "a deleted key counted as present"
            assert waiter.wait_value(key, 0.2) is None
            timers.append(threading.Timer(0.3, writer.set, args=(key, b"second")))
            timers[-1].start()
            assert waiter.wait_value(key, 10) == b"second"
            assert holder.wait([key], 0.2)  # the kept watch saw the second put
        finally:
            for timer in timers:
                timer.join(10)


@contextlib.contextmanager
def _clients(server: EtcdServer, count: int) -> Iterator[list[EtcdStore]]:
    """``count`` stores of this process (they share its connection), closed after."""
    config = store_config(server)
    clients = [EtcdStore(config) for _ in range(count)]
    try:
        yield clients
    finally:
        for client in clients:
            client.close()


def _lease(store: EtcdStore, key: str) -> tuple[int, int, list[bytes]]:
    """The lease that keeps ``key`` alive: its TTL left, its granted TTL, its keys."""
    request = etcdrpc.LeaseTimeToLiveRequest(ID=_lease_id(key.encode()), keys=True)
    reply = store._connection.call(etcdrpc.LeaseStub, "LeaseTimeToLive", request)
    return int(reply.TTL), int(reply.grantedTTL), list(reply.keys)


def test_liveness_is_a_lease_named_by_the_key(store: EtcdStore, prefix: str) -> None:
    key = prefix + "hb/a"
    assert not store.alive(key, 30)  # no lease yet: etcd answers TTL -1
    store.keep_alive(key, 30)
    assert store.alive(key, 30)
    left, granted, keys = _lease(store, key)
    assert granted == 30 and 0 < left <= 30 and keys == []  # no key attached
    assert store.get(key) is None  # nothing in the key space
    assert not store.alive(prefix + "hb/b", 30)  # another key, another lease


def test_a_restarted_agent_takes_over_its_lease(
    etcd_server_session: EtcdServer, prefix: str
) -> None:
    key = prefix + "hb/a"
    with _clients(etcd_server_session, 3) as (died, restarted, observer):
        died.keep_alive(key, 30)  # an agent killed without closing: its lease stays
        restarted.keep_alive(key, 5)  # its successor, the same node, another TTL
        assert observer.alive(key, 5)
        assert _lease(observer, key)[1] == 5  # granted anew, with the successor's TTL
        restarted.keep_alive(key, 5)  # renewed from here on
        assert observer.alive(key, 5)
        restarted.close()
        assert not observer.alive(key, 5)


def test_lease_ttl_caps_the_heartbeat_ttl(etcd_server_session: EtcdServer) -> None:
    store = EtcdStore(store_config(etcd_server_session, lease_ttl=3.0))
    try:
        assert store.lease_seconds(15) == 3
        assert store.lease_seconds(2.5) == 3  # whole seconds, rounded up
    finally:
        store.close()


def test_operations_ride_out_a_restart_on_the_same_data(
    restartable_etcd: Restartable, prefix: str
) -> None:
    endpoints, _ = parse_endpoints(restartable_etcd.endpoint)
    store = RetryingStore(EtcdStore(EtcdConfig(endpoints=endpoints)), retry_timeout=30)
    other = EtcdStore(EtcdConfig(endpoints=endpoints))
    try:
        store.set(prefix + "before", b"1")
        store.keep_alive(prefix + "hb", 10)
        assert not store.wait([prefix + "after"], 0.1)  # leaves a watch open
        restartable_etcd.kill()
        with pytest.raises(StoreUnavailable, match="did not answer"):
            other.get(prefix + "before")
        threading.Timer(0.5, restartable_etcd.start).start()
        assert store.get(prefix + "before") == b"1"  # retried until etcd is back
        threading.Timer(0.3, other.set, args=(prefix + "after", b"1")).start()
        assert store.wait([prefix + "after"], 10)  # a new watch on the new server
        store.keep_alive(prefix + "hb", 10)
        assert other.alive(prefix + "hb", 10)
    finally:
        store.close()
        other.close()


def test_the_token_is_renewed_after_a_restart(
    tmp_path: Path, restartable_etcd: Restartable
) -> None:
    import grpc  # type: ignore[import-untyped]
    from pyetcd import etcdrpc

    with grpc.insecure_channel(restartable_etcd.endpoint) as channel:
        auth = etcdrpc.AuthStub(channel)
        auth.UserAdd(etcdrpc.AuthUserAddRequest(name=USER, password=PASSWORD), timeout=10)
        auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=USER, role="root"), timeout=10)
        auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=10)
    endpoints, _ = parse_endpoints(restartable_etcd.endpoint)
    config = EtcdConfig(endpoints=endpoints, user=USER, password=PASSWORD)
    store = RetryingStore(EtcdStore(config), retry_timeout=30)
    try:
        store.set("/k", b"1")
        restartable_etcd.kill()
        restartable_etcd.start()  # simple tokens live in etcd's memory: this one is gone
        assert store.get("/k") == b"1"
    finally:
        store.close()


def test_failover_to_another_cluster_member(etcd_cluster: list[EtcdServer], prefix: str) -> None:
    endpoints, _ = parse_endpoints(",".join(member.endpoint for member in etcd_cluster))
    store = RetryingStore(EtcdStore(EtcdConfig(endpoints=endpoints)), retry_timeout=30)
    try:
        store.set(prefix + "k", b"1")
        etcd_cluster[0].stop()  # the member in use: the first that answered
        began = time.monotonic()
        assert store.add(prefix + "n", 1) == 1
        assert store.get(prefix + "k") == b"1"
        assert time.monotonic() - began < 10
    finally:
        store.close()

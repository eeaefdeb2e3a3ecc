"""Rendezvous records sealed with the job token (rallypoint.rendezvous.signing): what a
process without the token writes is ignored, a node with another token is kept out at
once, and a forged "gone" on TCPStore's heartbeat counters is not believed. Real stores:
the in-process reference store and torch's TCPStore on a loopback port. Agents on every
backend: tests/faults/test_token_faults.py."""

from __future__ import annotations

import threading
import time

import pytest

from rallypoint.builtins.rank_assigners import register_rank_assigners
from rallypoint.extensions import NodeSpec
from rallypoint.interfaces import Assignment, RendezvousFailed
from rallypoint.rendezvous import records
from rallypoint.rendezvous.liveness import _GONE
from rallypoint.rendezvous.memory_store import MemoryStore
from rallypoint.rendezvous.protocol import StoreRendezvous
from rallypoint.rendezvous.settings import Settings
from rallypoint.rendezvous.signing import GONE, Seal, SignedStore
from rallypoint.rendezvous.tcpstore import TCPStoreClient
from servers import free_port

TOKEN, OTHER = b"the job's secret", b"another job's secret"


def test_a_seal_holds_only_for_its_token_key_and_value() -> None:
    seal = Seal(TOKEN)
    raw = seal.seal("/rallypoint/job/state", b"1")
    assert seal.open("/rallypoint/job/state", raw) == b"1"
    assert seal.open("/rallypoint/job/0/closed", raw) is None  # copied to another key
    assert Seal(OTHER).open("/rallypoint/job/state", raw) is None
    assert seal.open("/rallypoint/job/state", raw[:-1] + b"2") is None  # value changed
    assert seal.open("/rallypoint/job/state", b"1") is None  # not sealed at all
    assert seal.open("/rallypoint/job/state", seal.seal("/rallypoint/job/state", b"")) == b""


def test_what_a_stray_writes_reads_as_absent_and_is_replaced() -> None:
    store = MemoryStore()
    stray, signed = store.clone(), SignedStore(store.clone(), Seal(TOKEN))
    stray.set("k", b"forged")
    assert signed.get("k") is None and signed.get_many(["k", "j"]) == [None, None]
    assert signed.compare_set("k", b"x", b"y") == b""  # expected a value: not swapped
    assert signed.compare_set("k", None, b"mine") == b"mine"  # expected none: the job's key
    assert signed.get("k") == b"mine" and stray.get("k") != b"mine"  # sealed in the store
    stray.set("k", b"forged again")
    assert signed.compare_set("k", b"mine", b"next") == b""  # a stray's overwrite: no value
    assert signed.add_and_get("n", 1, "k") == (1, None)


def test_a_wait_waits_on_through_a_strays_value() -> None:
    store = MemoryStore()
    stray, signed = store.clone(), SignedStore(store.clone(), Seal(TOKEN))
    stray.set("open", b"1")
    began = time.monotonic()
    assert not signed.wait(["open"], 0.3)
    assert signed.wait_value("open", 0.3) is None
    assert time.monotonic() - began >= 0.6
    writer = SignedStore(store.clone(), Seal(TOKEN))
    threading.Timer(0.2, writer.set, ("open", b"1")).start()
    assert signed.wait_value("open", 10) == b"1"
    assert signed.wait(["open"], 10)


def test_a_node_with_another_token_or_none_is_kept_out_at_once() -> None:
    store = MemoryStore()
    first = node(store, "a", TOKEN)
    waiting = threading.Thread(target=lambda: _swallow(first.next_round), daemon=True)
    waiting.start()  # claims the run's token key, then waits for a second node
    time.sleep(0.3)
    for token, said in ((OTHER, "job token is not the one"), (None, "this node has none")):
        began = time.monotonic()
        with pytest.raises(RendezvousFailed, match=said):
            node(store, "b", token).next_round()
        assert time.monotonic() - began < 5
    first.close()


def test_a_strays_join_record_and_marks_take_no_part_in_a_round() -> None:
    store = MemoryStore()
    nodes = [node(store, name, TOKEN, close_timeout=1.0) for name in "ab"]
    try:
        first = in_threads([n.next_round for n in nodes])
        assert {a.info.members for a in first} in ({("a", "b")}, {("b", "a")}), first
        # While round 0 runs, a stray says the job failed and node b leaves, and takes
        # join number 1 of the next round (its leader) with a well-formed record, alive.
        keys, stray = nodes[0].keys, store.clone()
        stray.set(keys.failed(), b'{"node": "a", "reason": "forged"}')
        stray.set(keys.leaving(0, "b"), b"1")
        assert stray.add(keys.of_round(1, "joined"), 1) == 1
        forged = records.NodeRecord("stray", "10.0.0.9", 8, 29500, run_id="job", nnodes="2:3")
        stray.set(keys.of_round(1, "node", 1), records.encode(forged))
        stray.keep_alive(keys.heartbeat("stray"), 3.0)
        nodes[0].request_new_round()
        second = in_threads([n.next_round for n in nodes])
        assert all(isinstance(a, Assignment) for a in second), second
        assert {tuple(sorted(a.info.members)) for a in second} == {("a", "b")}
    finally:
        for n in nodes:
            n.close()


def in_threads(calls: list[object]) -> list[Assignment]:
    """What each of ``calls`` returned (or raised), run at once in threads."""
    results: list[object] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = _swallow(calls[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results  # type: ignore[return-value]


def test_a_forged_drop_of_a_heartbeat_counter_is_not_believed() -> None:
    port = free_port()
    host = TCPStoreClient("127.0.0.1", port, is_host=True, timeout=10)
    try:
        owner = SignedStore(
            TCPStoreClient("127.0.0.1", port, is_host=False, timeout=10), Seal(TOKEN)
        )
        watcher = SignedStore(host.clone(), Seal(TOKEN))
        stray = TCPStoreClient("127.0.0.1", port, is_host=False, timeout=10)
        key = "/rallypoint/job/hb/b"
        owner.keep_alive(key, 3.0)
        assert watcher.alive(key, 3.0)
        stray.add(key, _GONE)  # what an unsealed job's owner does when it leaves
        owner.keep_alive(key, 3.0)
        assert watcher.alive(key, 3.0)
        stray.set(key + GONE, b"1")
        assert watcher.alive(key, 3.0)
        owner.close()  # leaving: a sealed mark, seen at once
        assert not watcher.alive(key, 3.0)
        stray.close()
        watcher.close()
    finally:
        host.close()


def node(
    store: MemoryStore, name: str, token: bytes | None, close_timeout: float = 2.0
) -> StoreRendezvous:
    """Node ``name`` of run "job" (2 to 3 nodes) on ``store``, with ``token``."""
    conf = {"heartbeat_timeout": 3.0, "last_call_timeout": 0.3, "close_timeout": close_timeout}
    settings = Settings.from_conf(2, 3, {**conf, "join_timeout": 30.0, "retry_timeout": 5.0})
    ordered = register_rank_assigners()[0]
    return StoreRendezvous(
        store.clone(), "job", NodeSpec(name, host="127.0.0.1"), 1, ordered, settings, token=token
    )


def _swallow(call: object) -> object:
    try:
        return call()  # type: ignore[operator]
    except Exception as error:  # the test reads what came back
        return error

"""Rendezvous records sealed with the job token, for one attempt (rallypoint.rendezvous.
signing): what a process without the token writes, bumps or replays is ignored or bounded,
a node with another token is kept out at once, a squatted claim is replaced, and liveness
cannot be forged either way. Real stores: the in-process reference store and torch's
TCPStore on a loopback port; agents on every backend: tests/faults/test_token_faults.py."""

from __future__ import annotations

import threading
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.builtins.rank_assigners import register_rank_assigners
from rallypoint.extensions import NodeSpec
from rallypoint.interfaces import Assignment, RendezvousFailed
from rallypoint.rendezvous import calls, generations, records
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.liveness import _GONE
from rallypoint.rendezvous.memory_store import MemoryStore
from rallypoint.rendezvous.protocol import StoreRendezvous
from rallypoint.rendezvous.settings import Settings
from rallypoint.rendezvous.signing import ALIVE, MISMATCH, Seal, SignedStore, Watch, judge
from rallypoint.rendezvous.status import read_status
from rallypoint.rendezvous.tcpstore import TCPStoreClient
from servers import free_port

TOKEN, OTHER = b"the job's secret", b"another job's secret"
CLAIM_KEY = "/rallypoint/job~token"


def claimed(store: MemoryStore, token: bytes = TOKEN) -> SignedStore:
    """A client of ``store`` in the attempt of run "job" (claiming it if nobody has)."""
    signed = SignedStore(store.clone(), Seal(token))
    signed.claim(CLAIM_KEY, lambda: False)
    return signed


# --- seals -----------------------------------------------------------------------------------


def test_a_seal_holds_only_for_its_token_attempt_key_and_value() -> None:
    seal = Seal(TOKEN).for_attempt("a" * 32)
    raw = seal.seal("/rallypoint/job/state", b"1")
    assert seal.open("/rallypoint/job/state", raw) == b"1"
    assert seal.open("/rallypoint/job/0/closed", raw) is None  # copied to another key
    assert Seal(OTHER).for_attempt("a" * 32).open("/rallypoint/job/state", raw) is None
    assert Seal(TOKEN).for_attempt("b" * 32).open("/rallypoint/job/state", raw) is None
    assert Seal(TOKEN).open("/rallypoint/job/state", raw) is None  # the run's, not the attempt's
    assert seal.open("/rallypoint/job/state", raw[:-1] + b"2") is None  # value changed
    assert seal.open("/rallypoint/job/state", b"1") is None  # not sealed at all
    assert seal.open("/rallypoint/job/state", seal.seal("/rallypoint/job/state", b"")) == b""


@settings(max_examples=300, deadline=None)
@given(
    key=st.text(max_size=40),
    value=st.binary(max_size=64),
    raw=st.binary(max_size=120),
    attempt=st.text(alphabet="0123456789abcdef", min_size=32, max_size=32),
)
def test_a_seal_opens_only_what_it_sealed_for_that_key_and_attempt(
    key: str, value: bytes, raw: bytes, attempt: str
) -> None:
    seal = Seal(TOKEN).for_attempt(attempt)
    assert seal.open(key, seal.seal(key, value)) == value
    assert seal.open(key + "x", seal.seal(key, value)) is None
    assert (
        Seal(TOKEN)
        .for_attempt("f" * 32 if attempt != "f" * 32 else "e" * 32)
        .open(key, seal.seal(key, value))
        is None
    )
    if raw != seal.seal(key, raw[45:]):  # arbitrary bytes: never a value, never an error
        assert seal.open(key, raw) is None


def test_what_a_stray_writes_reads_as_absent_and_is_replaced() -> None:
    store = MemoryStore()
    stray, signed = store.clone(), claimed(store)
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
    stray, signed = store.clone(), claimed(store)
    stray.set("open", b"1")
    began = time.monotonic()
    assert not signed.wait(["open"], 0.3)
    assert signed.wait_value("open", 0.3) is None
    assert time.monotonic() - began >= 0.6
    writer = claimed(store)
    threading.Timer(0.2, writer.set, ("open", b"1")).start()
    assert signed.wait_value("open", 10) == b"1"
    assert signed.wait(["open"], 10)


# --- 2. a record of an earlier attempt is worth nothing --------------------------------------


def test_every_attempt_has_its_own_seal() -> None:
    """Attempt 1 claims the run; after it (a clean finish deletes the claim, a c10d store
    ends with its host), attempt 2 claims anew: its records' seals differ."""
    store = MemoryStore()
    first = claimed(store)
    assert claimed(store).attempt == first.attempt  # the same attempt: the same nonce
    store.delete_prefix(CLAIM_KEY)
    second = claimed(store)
    assert second.attempt != first.attempt
    first.set("/rallypoint/job/failed", b'{"node": "a", "reason": "done"}')
    assert second.get("/rallypoint/job/failed") is None


def old_attempt() -> tuple[Keys, dict[str, bytes]]:
    """The store of an earlier attempt (nodes a and b, one round, then a failure), as a
    stray that read it keeps it."""
    old = MemoryStore()
    nodes = [node(old, name, TOKEN) for name in "ab"]
    try:
        in_threads([n.next_round for n in nodes])
        nodes[0].fail("the loss went to nan")
    finally:
        for n in nodes:
            n.close()
    keys = nodes[0].keys
    names = [keys.failed(), keys.of_round(0, "closed"), keys.of_round(0, "node", 2)]
    found = {name: old.get(name) for name in names}
    assert all(found.values()), found
    return keys, found  # type: ignore[return-value]


def test_a_failure_copied_from_an_earlier_attempt_stops_nobody() -> None:
    """Attempt 2 (nodes c and d) trains; a stray writes attempt 1's failure into its store
    and a worker failure makes a new round. Before attempts were bound into the seals,
    every node stopped with "the job failed on node a: the loss went to nan"."""
    keys, old = old_attempt()
    store = MemoryStore()
    nodes = [node(store, name, TOKEN) for name in "cd"]
    try:
        in_threads([n.next_round for n in nodes])
        store.clone().set(keys.failed(), old[keys.failed()])
        nodes[0].request_new_round()
        results = in_threads([n.next_round for n in nodes])
    finally:
        for n in nodes:
            n.close()
    assert formed(results) == {(1, ("c", "d"))}


def test_a_round_copied_from_an_earlier_attempt_is_nobodys() -> None:
    """Attempt 1's round record, written into attempt 2's store before its nodes come:
    they form round 0 themselves (before: they took it for a round that had closed
    without them, and went on to round 1)."""
    keys, old = old_attempt()
    store = MemoryStore()
    store.clone().set(keys.of_round(0, "closed"), old[keys.of_round(0, "closed")])
    nodes = [node(store, name, TOKEN) for name in "cd"]
    try:
        results = in_threads([n.next_round for n in nodes])
    finally:
        for n in nodes:
            n.close()
    assert formed(results) == {(0, ("c", "d"))}


def test_a_join_copied_from_an_earlier_attempt_adds_no_member() -> None:
    """Node c leads round 0 of attempt 2; a stray takes join number 2 and writes node b's
    record of attempt 1 there, then d joins: the round forms with c and d (before: with
    b too, a phantom member whose workers never come)."""
    keys, old = old_attempt()
    store = MemoryStore()
    stray = store.clone()
    c = node(store, "c", TOKEN)
    d = node(store, "d", TOKEN)
    results: list[object] = []
    try:
        leading = threading.Thread(target=lambda: results.append(_swallow(c.next_round)))
        leading.start()
        deadline = time.monotonic() + 10
        while store.get(keys.of_round(0, "node", 1)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stray.add(keys.of_round(0, "joined"), 1) == 2
        stray.set(keys.of_round(0, "node", 2), old[keys.of_round(0, "node", 2)])
        results += in_threads([d.next_round])
        leading.join(60)
    finally:
        c.close()
        d.close()
    assert {members for _, members in formed(results)} == {("c", "d")}


def test_an_older_state_or_generation_written_back_takes_no_node_back() -> None:
    """Within one attempt: a stray writes back the sealed round counter and generation
    hint it read earlier. Nodes read where the job really is (the markers after a hint),
    a round still ends, and a newcomer joins the running job, not a dead round."""
    store = MemoryStore()
    nodes = [node(store, name, TOKEN, close_timeout=0.5) for name in "ab"]
    stray = store.clone()
    try:
        in_threads([n.next_round for n in nodes])
        keys = nodes[0].keys
        nodes[0].request_new_round()
        second = in_threads([n.next_round for n in nodes])
        assert {a.info.round for a in second} == {1}
        old_state = store.get(keys.state())  # "round 1", sealed
        nodes[1].request_new_round()
        third = in_threads([n.next_round for n in nodes])
        assert {a.info.round for a in third} == {2}
        stray.set(keys.state(), old_state)  # back to round 1
        signed = claimed(store)
        assert calls.drive(generations.job_round(keys), signed) == 2
        # The round the job is in still ends, and a newcomer comes into the job's round.
        newcomer = node(store, "c", TOKEN, close_timeout=0.5)
        nodes.append(newcomer)
        results = in_threads([n.next_round for n in nodes])
        assert all(isinstance(r, Assignment) for r in results), results
        assert {r.info.round for r in results} == {3}
        assert {tuple(sorted(r.info.members)) for r in results} == {("a", "b", "c")}
    finally:
        for n in nodes:
            n.close()


def test_a_generation_hint_written_back_is_passed_over() -> None:
    store = MemoryStore()
    signed, stray = claimed(store), store.clone()
    keys = Keys("/rallypoint", "job")
    signed.compare_set(keys.born(1), None, b"a")
    signed.set(keys.generation_key, records.encode_int(1))
    old_hint = store.get(keys.generation_key)
    signed.compare_set(keys.born(2), None, b"b")
    signed.set(keys.generation_key, records.encode_int(2))
    stray.set(keys.generation_key, old_hint)  # back to generation 1, whose keys are gone
    assert generations.current_generation(signed, keys).generation == 2
    stray.set(keys.born(3), b"forged")  # a marker a stray wrote is no generation
    assert generations.current_generation(signed, keys).generation == 2


# --- 3. counters are bounded ---------------------------------------------------------------


def test_a_bumped_join_counter_keeps_no_leader_past_its_timeout() -> None:
    """A stray adds 2**40 to round 0's join counter while its leader waits for a second
    node: the leader reads at most MAX-and-slack join numbers and gives up at
    join_timeout (before the caps, it gathered batch after batch, each waiting
    close_timeout, long after join_timeout); gone() and status read capped counts."""
    store = MemoryStore()
    leader = node(store, "a", TOKEN, close_timeout=0.3, join_timeout=3.0)
    stray = store.clone()
    keys = leader.keys
    try:
        waiting = threading.Thread(target=lambda: _swallow(leader.next_round), daemon=True)
        began = time.monotonic()
        waiting.start()
        deadline = time.monotonic() + 10
        while store.get(keys.of_round(0, "node", 1)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        stray.add(keys.of_round(0, "joined"), 1 << 40)
        waiting.join(30)
        assert not waiting.is_alive()
        assert time.monotonic() - began < 3.0 + 3.0  # join_timeout and a little
        tracemalloc.start()
        try:
            assert leader.gone(["a", "b"]) == ["b"]
            report = read_status(claimed(store), keys, "job", 0.3)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 20 << 20, peak  # not one key per counted join
        assert report["joined_current_round"] <= generations.MOST_CHECKED
    finally:
        leader.close()


def test_bumped_barrier_counts_neither_pass_the_barrier_nor_delete_the_run() -> None:
    """A stray adds to the exit barrier's and the leaving count of the last round: a node
    that finishes first still waits for the other at the barrier, and leaving first, it
    does not delete the run's keys from under the other."""
    store = MemoryStore()
    nodes = [node(store, name, TOKEN) for name in "ab"]
    stray = store.clone()
    try:
        in_threads([n.next_round for n in nodes])
        keys = nodes[0].keys
        stray.add(keys.of_round(0, "done"), 5)
        stray.add(keys.of_round(0, "left"), 5)
        began = time.monotonic()
        nodes[0].exit_barrier(1.0)  # b has not finished: a waits out its timeout
        assert time.monotonic() - began >= 1.0
        assert nodes[0].joining.finished is None
        finisher = threading.Thread(target=nodes[1].exit_barrier, args=(10.0,))
        finisher.start()
        nodes[0].exit_barrier(10.0)
        finisher.join(15)
        assert nodes[0].joining.finished == nodes[1].joining.finished == 0
        nodes[0].close()  # a leaves first: b has not, so the run's keys stay
        assert store.get(keys.of_round(0, "closed")) is not None
    finally:
        for n in nodes:
            n.close()


# --- 4. liveness cannot be forged either way -------------------------------------------------


def test_the_verdicts_of_a_watch() -> None:
    ttl, wall = 3.0, 100_000_000  # the observer's wall clock, in µs
    old, fresh = wall - 10_000_000, wall - 1_000_000  # marks written 10 s and 1 s ago
    watch, verdict = judge(None, (old, False), 0.0, ttl, wall)
    assert verdict is None  # a first look at a stale mark: the store's own liveness says
    watch, verdict = judge(watch, (old, False), 2.0, ttl, wall)
    assert verdict is None  # still within the first look's ttl
    watch, verdict = judge(watch, (old, False), 3.5, ttl, wall)
    assert verdict is False  # a mark that never rose: dead, however alive the store says
    assert judge(None, (fresh, False), 0.0, ttl, wall)[1] is True  # fresh: alive, not asked
    watch, verdict = judge(None, (old, False), 0.0, ttl, wall)
    watch, verdict = judge(watch, (old + 1, False), 1.0, ttl, wall)
    assert verdict is True
    watch, verdict = judge(watch, None, 3.9, ttl, wall)
    assert verdict is True  # its key deleted, its mark junk: no news within ttl of a rise
    watch, verdict = judge(watch, (old - 5, False), 4.1, ttl, wall)
    assert verdict is False  # an older mark written back is no rise
    watch, verdict = judge(watch, (old + 2, True), 4.2, ttl, wall)
    assert verdict is False
    assert judge(watch, (old + 2, False), 4.3, ttl, wall)[1] is False  # gone stays gone
    assert judge(None, None, 0.0, ttl, wall) == (None, False)


@settings(max_examples=200, deadline=None)
@given(
    marks=st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 50), st.booleans())), max_size=40),
    ttl=st.sampled_from((1.0, 3.0)),
)
def test_a_mark_that_does_not_rise_is_dead_after_ttl(
    marks: list[tuple[int, bool] | None], ttl: float
) -> None:
    """Whatever a stray writes (junk, older marks, the same mark again), a node whose
    highest mark was read more than ttl ago is never alive, once a watch has seen it."""
    watch: Watch | None = None
    now, highest, rose = 0.0, -1, None
    for mark in marks:
        now += ttl / 4
        watch, verdict = judge(watch, mark, now, ttl, 10**12)  # every mark stale
        if mark is not None and mark[0] > highest:
            highest, rose = mark[0], now
        if verdict is True:
            assert rose is not None and now - rose <= ttl


def test_a_forged_liveness_is_not_believed_on_tcpstore() -> None:
    """A stray keeps a dead node's heartbeat counter moving, or drops a live one's below
    zero: neither is believed; the owner's sealed mark, rising or gone, is."""
    port = free_port()
    host = TCPStoreClient("127.0.0.1", port, is_host=True, timeout=10)
    try:
        owner = SignedStore(
            TCPStoreClient("127.0.0.1", port, is_host=False, timeout=10), Seal(TOKEN)
        )
        owner.claim(CLAIM_KEY, lambda: False)
        watcher = SignedStore(host.clone(), Seal(TOKEN))
        watcher.claim(CLAIM_KEY, lambda: False)
        stray = TCPStoreClient("127.0.0.1", port, is_host=False, timeout=10)
        key, ttl = "/rallypoint/job/hb/b", 0.6
        owner.keep_alive(key, ttl)
        assert watcher.alive(key, ttl)
        stray.add(key, _GONE)  # what an unsealed job's owner does when it leaves
        owner.keep_alive(key, ttl)
        assert watcher.alive(key, ttl)
        stray.set(key + ALIVE, b"99999999999999999 gone")
        assert watcher.alive(key, ttl)
        # The owner dies; a stray keeps its counter moving.
        deadline = time.monotonic() + 3 * ttl
        while time.monotonic() < deadline and watcher.alive(key, ttl):
            stray.add(key, 1)
            time.sleep(0.1)
        assert not watcher.alive(key, ttl), "a dead node kept alive by a stray's counter"
        owner.keep_alive(key, ttl)  # back, and leaving: a sealed mark, seen at once
        assert watcher.alive(key, ttl)
        owner.close()
        assert not watcher.alive(key, ttl)
        stray.close()
        watcher.close()
    finally:
        host.close()


def test_a_live_node_whose_store_liveness_a_stray_revokes_stays_alive() -> None:
    """On a store whose liveness expires (the reference store, as etcd's leases and Redis's
    keys): a stray ends a live node's liveness over and over; a watcher that saw its mark
    rise keeps it alive, and a node dead for good is gone within ttl of its last rise."""
    store = MemoryStore()
    owner, watcher, stray = claimed(store), claimed(store), store.clone()
    key, ttl = "/rallypoint/job/hb/a", 0.6
    owner.keep_alive(key, ttl)
    assert watcher.alive(key, ttl)
    ends = time.monotonic() + 3 * ttl
    while time.monotonic() < ends:
        stray.keep_alive(key, ttl)
        stray.close()  # its "liveness" of the key ends: the key is dead in the store
        assert watcher.alive(key, ttl)
        owner.keep_alive(key, ttl)
        time.sleep(ttl / 4)
    # The owner dies (nothing closed); a stray keeps the store's liveness of it up.
    deadline = time.monotonic() + 3 * ttl
    while time.monotonic() < deadline and watcher.alive(key, ttl):
        stray.keep_alive(key, ttl)
        time.sleep(0.05)
    assert not watcher.alive(key, ttl)


# --- 8. the token claim cannot be squatted --------------------------------------------------


def test_a_node_with_another_token_or_none_is_kept_out_at_once() -> None:
    store = MemoryStore()
    first = node(store, "a", TOKEN)
    waiting = threading.Thread(target=lambda: _swallow(first.next_round), daemon=True)
    waiting.start()  # claims the run's token key, then waits for a second node
    deadline = time.monotonic() + 10
    while store.get(first.keys.of_round(0, "node", 1)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    for token, said in ((OTHER, MISMATCH), (None, "this node has none")):
        began = time.monotonic()
        with pytest.raises(RendezvousFailed, match=said.split("(")[0]):
            node(store, "b", token).next_round()
        assert time.monotonic() - began < 5
    first.close()


@pytest.mark.parametrize("token", [TOKEN, None])
def test_a_squatted_claim_locks_no_job_out(
    token: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Any 37-byte value shaped like a claim at the run's token key, before the job comes:
    a job with a token replaces it after a grace (no record of a job stands behind it),
    and one without a token ignores it. Before, every node stopped with "this node's
    job token is not the one the job's nodes use"."""
    store = MemoryStore()
    keys = Keys("/rallypoint", "job")
    forged = Seal(OTHER).seal(keys.token_key, b"job token " + b"0" * 32)
    store.set(keys.token_key, forged)
    nodes = [node(store, name, token, heartbeat_timeout=1.0) for name in "ab"]
    try:
        results = in_threads([n.next_round for n in nodes])
    finally:
        for n in nodes:
            n.close()
    assert all(isinstance(r, Assignment) for r in results), results
    said = caplog.text
    if token is not None:
        assert "replaced the run's token claim" in said, said
        assert store.get(keys.token_key) != forged
    else:
        assert "ignored the job token claim" in said, said


def test_the_strays_join_record_and_marks_take_no_part_in_a_round() -> None:
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


# --- helpers ---------------------------------------------------------------------------------


def formed(results: list[object]) -> set[tuple[int, tuple[str, ...]]]:
    """The rounds ``results`` are assignments to, and their members; each must be one."""
    assert all(isinstance(r, Assignment) for r in results), results
    return {(r.info.round, tuple(sorted(r.info.members))) for r in results}  # type: ignore[attr-defined]


def in_threads(calls_: list[object]) -> list[Assignment]:
    """What each of ``calls_`` returned (or raised), run at once in threads."""
    results: list[object] = [None] * len(calls_)

    def run(i: int) -> None:
        results[i] = _swallow(calls_[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls_))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results  # type: ignore[return-value]


def node(
    store: MemoryStore,
    name: str,
    token: bytes | None,
    close_timeout: float = 2.0,
    join_timeout: float = 30.0,
    heartbeat_timeout: float = 3.0,
) -> StoreRendezvous:
    """Node ``name`` of run "job" (2 to 3 nodes) on ``store``, with ``token``."""
    conf = {
        "heartbeat_timeout": heartbeat_timeout,
        "last_call_timeout": 0.3,
        "close_timeout": close_timeout,
    }
    settings = Settings.from_conf(
        2, 3, {**conf, "join_timeout": join_timeout, "retry_timeout": 5.0}
    )
    ordered = register_rank_assigners()[0]
    return StoreRendezvous(
        store.clone(), "job", NodeSpec(name, host="127.0.0.1"), 1, ordered, settings, token=token
    )


def _swallow(call: object) -> object:
    try:
        return call()  # type: ignore[operator]
    except Exception as error:  # the test reads what came back
        return error

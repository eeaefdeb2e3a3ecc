"""The conformance suite every ``CoordinationStore`` must pass.

A backend's tests subclass ``StoreConformance`` and provide one fixture, ``connect``: a
callable that returns a new client of one running store service (a real server, never a
fake). Every test then runs against that service: the store operations first (atomicity
under concurrency, one compare-and-set winner, wake-ups without polling, liveness that
expires), then the rendezvous protocol on top of them (agreement under concurrent joins,
run-id namespacing, scale-up, a full job, a dead node detected, malformed records).

A backend whose server the test can stop and start again also provides ``outage``: a
callable that makes the service unreachable for the given seconds and then brings it back
(with its data), for the test that operations ride out an outage. Without it that test
is skipped, with the reason.

    import pytest
    from rallypoint.testing.store_conformance import StoreConformance

    class TestMyStore(StoreConformance):
        @pytest.fixture
        def connect(self, my_server):
            return lambda: MyStore(my_server.endpoint)

        @pytest.fixture
        def outage(self, my_server):
            return my_server.pause  # pause(seconds): SIGSTOP, sleep, SIGCONT
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rallypoint.builtins.rank_assigners import ordered
from rallypoint.extensions import NodeSpec, RankAssigner
from rallypoint.interfaces import Assignment, CoordinationStore, RendezvousTimeout, StoreError
from rallypoint.rendezvous.protocol import StoreRendezvous
from rallypoint.rendezvous.retrying import RetryingStore
from rallypoint.rendezvous.settings import Settings

Connect = Callable[[], CoordinationStore]
Outage = Callable[[float], None]

_ORDERED = RankAssigner("ordered", "sorted by host and node id", ordered)


def _later(timers: list[threading.Timer], call: Callable[..., Any], *args: Any) -> None:
    """``call(*args)`` in 0.3 s, on another thread (kept in ``timers``)."""
    timer = threading.Timer(0.3, call, args=args)
    timers.append(timer)
    timer.start()


def _join(timers: list[threading.Timer]) -> None:
    """Let the calls of ``timers`` finish before their stores are closed: one closed under
    a call still reading its reply fails that call (an error in a thread nobody joins)."""
    for timer in timers:
        timer.join(10)


def _in_threads(count: int, target: Callable[[int], Any], timeout: float = 60) -> list[Any]:
    """Run ``target(i)`` in ``count`` threads at once; return results (or exceptions)."""
    results: list[Any] = [None] * count
    start = threading.Barrier(count)

    def run(index: int) -> None:
        start.wait()
        try:
            results[index] = target(index)
        except Exception as error:  # handed to the test's assertions
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return results


class _Conformance:
    """What both halves of the suite share: the store's traits and the fixtures."""

    #: Whether ``keep_alive`` keeps its liveness under the key it is given (a key, or a
    #: key's expiry), which ``delete_prefix`` then deletes and counts. A store that keeps
    #: it elsewhere (etcd: in a lease, which ``close`` revokes) sets this to False.
    liveness_is_a_key = True
    #: The backend's ``store_in_agent``: its store lives in an agent's process. Here no
    #: node hosts it (the ``connect`` fixture's process does), so each node is told so.
    store_in_agent = False

    @pytest.fixture
    def store(self, connect: Connect) -> Iterator[CoordinationStore]:
        client = connect()
        yield client
        client.close()

    @pytest.fixture
    def prefix(self) -> str:
        """Keys unique to one test, so tests never see each other's data."""
        return f"/conformance/{uuid.uuid4().hex}/"


class StoreOperations(_Conformance):
    """The store's operations, each against the real store: values, counters, waits,
    liveness, deleting a prefix, connections."""

    def test_get_set_round_trip_bytes(self, store: CoordinationStore, prefix: str) -> None:
        assert store.get(prefix + "absent") is None
        value = bytes(range(256))
        store.set(prefix + "key", value)
        assert store.get(prefix + "key") == value

    def test_add_is_atomic_under_concurrency(self, connect: Connect, prefix: str) -> None:
        def add_many(_: int) -> list[int]:
            client = connect()
            try:
                return [client.add(prefix + "counter", 1) for _ in range(50)]
            finally:
                client.close()

        results = _in_threads(8, add_many)
        seen = [value for values in results for value in values]
        assert sorted(seen) == list(range(1, 401))
        store = connect()
        try:
            assert store.add(prefix + "counter", 0) == 400
        finally:
            store.close()

    def test_add_and_get_adds_and_reads_together(self, connect: Connect, prefix: str) -> None:
        # As the protocol calls it: the store's own add_and_get, or add then get for a
        # store without it. Each node joins a round this way.
        store = RetryingStore(connect(), retry_timeout=0)
        try:
            assert store.add_and_get(prefix + "first", 1, prefix + "absent") == (1, None)
            store.set(prefix + "state", b"round 3")

            def join_many(_: int) -> list[tuple[int, bytes | None]]:
                client = RetryingStore(connect(), retry_timeout=0)
                try:
                    return [
                        client.add_and_get(prefix + "joined", 1, prefix + "state")
                        for _ in range(25)
                    ]
                finally:
                    client.close()

            results = [pair for pairs in _in_threads(8, join_many) for pair in pairs]
            assert sorted(count for count, _ in results) == list(range(1, 201))
            assert {value for _, value in results} == {b"round 3"}
            assert store.add(prefix + "joined", 0) == 200
        finally:
            store.close()

    def test_compare_set(self, store: CoordinationStore, prefix: str) -> None:
        key = prefix + "cas"
        assert store.compare_set(key, None, b"one") == b"one"
        assert store.compare_set(key, None, b"two") == b"one"
        assert store.compare_set(key, b"wrong", b"two") == b"one"
        assert store.compare_set(key, b"one", b"two") == b"two"
        assert store.get(key) == b"two"

    def test_compare_set_has_one_winner(self, connect: Connect, prefix: str) -> None:
        def claim(index: int) -> bool:
            client = connect()
            try:
                desired = f"node{index}".encode()
                return client.compare_set(prefix + "leader", None, desired) == desired
            finally:
                client.close()

        assert sum(_in_threads(8, claim)) == 1

    def test_wait_wakes_on_set_without_polling(self, connect: Connect, prefix: str) -> None:
        waiter, setter = connect(), connect()
        timers: list[threading.Timer] = []
        try:
            _later(timers, setter.set, prefix + "ready", b"1")
            began = time.monotonic()
            assert waiter.wait([prefix + "ready"], 10)
            # Woken by the set, not by the 10 s timeout (the bound is generous on purpose).
            assert time.monotonic() - began < 5
        finally:
            _join(timers)
            waiter.close()
            setter.close()

    def test_wait_times_out(self, store: CoordinationStore, prefix: str) -> None:
        began = time.monotonic()
        assert not store.wait([prefix + "never"], 0.3)
        assert time.monotonic() - began < 2

    def test_wait_value_answers_the_value_once_set(self, connect: Connect, prefix: str) -> None:
        # As the protocol calls it: the store's own wait_value, or wait then get for a
        # store written before the interface had it.
        waiter, setter = RetryingStore(connect(), retry_timeout=0), connect()
        record = bytes(range(256)) * 256  # a round record of a thousand nodes is this big
        timers: list[threading.Timer] = []
        try:
            assert waiter.wait_value(prefix + "record", 0.2) is None  # times out: None
            _later(timers, setter.set, prefix + "record", record)
            began = time.monotonic()
            assert waiter.wait_value(prefix + "record", 10) == record
            assert time.monotonic() - began < 5  # woken by the set, not by the timeout
            assert waiter.wait_value(prefix + "record", 0) == record  # there already
            _later(timers, setter.add, prefix + "count", 3)
            assert waiter.wait_value(prefix + "count", 10) == b"3"  # a counter: its total
        finally:
            _join(timers)
            waiter.close()
            setter.close()

    def test_get_many_reads_in_order(self, store: CoordinationStore, prefix: str) -> None:
        store.set(prefix + "a", b"1")
        store.set(prefix + "c", b"3")
        assert store.get_many([prefix + "c", prefix + "b", prefix + "a"]) == [b"3", None, b"1"]
        assert store.get_many([]) == []

    def test_liveness_lasts_while_kept_and_expires_after(
        self, connect: Connect, prefix: str
    ) -> None:
        owner, observer = connect(), connect()
        key, ttl = prefix + "hb", 2.0
        try:
            owner.keep_alive(key, ttl)
            began = time.monotonic()
            while time.monotonic() - began < 2 * ttl:  # kept alive: alive throughout
                assert observer.alive(key, ttl)
                owner.keep_alive(key, ttl)
                time.sleep(ttl / 4)
            stopped = time.monotonic()
            while observer.alive(key, ttl):  # no longer kept: dead within a few ttl
                assert time.monotonic() - stopped < 4 * ttl, "liveness never expired"
                time.sleep(0.1)
            assert time.monotonic() - stopped >= ttl / 2, "expired long before the ttl"
        finally:
            owner.close()
            observer.close()

    def test_closing_ends_the_liveness_it_kept(self, connect: Connect, prefix: str) -> None:
        owner, observer = connect(), connect()
        key, ttl = prefix + "hb", 30.0
        try:
            owner.keep_alive(key, ttl)
            assert observer.alive(key, ttl)
            owner.close()  # the owner leaves (its agent stopped): gone now, not in 30 s
            owner.close()  # again: harmless, and the observer's connection is untouched
            assert not observer.alive(key, ttl)
        finally:
            owner.close()
            observer.close()

    def test_a_read_of_an_absent_key_wakes_no_wait(self, connect: Connect, prefix: str) -> None:
        """Reading a key that is not there (any client may) is not writing it: a wait on
        it goes on. (torch's TCPStore wakes a key's waiters on every compare-and-set of
        it, the failed one its ``get`` is made of too.)"""
        waiter, reader = connect(), connect()
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                reader.get(prefix + "open")
                reader.get_many([prefix + "open"])
                time.sleep(0.02)

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        try:
            assert not waiter.wait([prefix + "open"], 1.0)
            assert waiter.wait_value(prefix + "open", 0.5) is None
        finally:
            stop.set()
            thread.join(10)
            waiter.close()
            reader.close()

    def test_with_a_token_a_strays_liveness_neither_keeps_the_dead_nor_ends_the_live(
        self, connect: Connect, prefix: str
    ) -> None:
        """Sealed liveness (``rendezvous.signing``) on this store: a stray that ends a live
        node's liveness again and again (``keep_alive`` and ``close`` of its key: an etcd
        lease revoked, a Redis key deleted, a counter dropped) does not make it look dead
        to a watcher; and a stray that keeps a dead node's liveness up (renewing its lease
        or key, moving its counter) keeps it alive for no longer than a few ttl."""
        from rallypoint.rendezvous.signing import Seal, SignedStore

        token, claim = b"conformance token", prefix + "~token"
        owner, watcher = SignedStore(connect(), Seal(token)), SignedStore(connect(), Seal(token))
        for signed in (owner, watcher):
            signed.claim(claim, lambda: False)
        key, ttl = prefix + "hb/a", 2.0
        strays: list[CoordinationStore] = []
        try:
            owner.keep_alive(key, ttl)
            assert watcher.alive(key, ttl)
            ends = time.monotonic() + 2 * ttl
            while time.monotonic() < ends:
                stray = connect()
                stray.keep_alive(key, ttl)
                stray.close()  # what it kept ends: the owner's liveness in the store too
                assert watcher.alive(key, ttl), "a live node taken for dead by a stray's touch"
                owner.keep_alive(key, ttl)
                time.sleep(ttl / 6)
            # The owner dies (nothing closed); a stray keeps its liveness up in the store.
            stray = connect()
            strays.append(stray)
            died = time.monotonic()
            while watcher.alive(key, ttl):
                assert time.monotonic() - died < 4 * ttl, "a dead node kept alive by a stray"
                stray.keep_alive(key, ttl)
                time.sleep(0.1)
        finally:
            for client in (*strays, owner, watcher):
                client.close()

    def test_operations_ride_out_an_outage(
        self, connect: Connect, prefix: str, request: pytest.FixtureRequest
    ) -> None:
        try:
            outage: Outage = request.getfixturevalue("outage")
        except pytest.FixtureLookupError:
            pytest.skip("this backend's tests give no `outage` fixture (its server cannot pause)")
        store = RetryingStore(connect(), retry_timeout=30)
        try:
            store.set(prefix + "before", b"1")
            threading.Thread(target=outage, args=(2.0,), daemon=True).start()
            time.sleep(0.5)  # the outage has begun
            began = time.monotonic()
            assert store.add(prefix + "counter", 1) == 1  # retried until the store is back
            assert time.monotonic() - began < 25
            assert store.get(prefix + "before") == b"1", "the outage lost data"
        finally:
            store.close()

    def test_delete_prefix_deletes_the_keys_under_it(
        self, store: CoordinationStore, prefix: str
    ) -> None:
        run = prefix + "run/"
        store.set(run + "a", b"1")
        assert store.add(run + "n", 3) == 3
        assert store.compare_set(run + "cas", None, b"x") == b"x"
        store.keep_alive(run + "hb", 30)
        store.set(prefix + "run-other", b"kept")  # the same text, not under run/
        store.set(prefix + "outside", b"kept")
        assert store.delete_prefix(run) == 3 + self.liveness_is_a_key
        assert store.get_many([run + "a", run + "n", run + "cas", run + "hb"]) == [None] * 4
        assert store.get_many([prefix + "run-other", prefix + "outside"]) == [b"kept"] * 2
        # Deleted keys start again from nothing; a wait on one waits for a new write.
        assert store.add(run + "n", 1) == 1
        assert store.compare_set(run + "cas", None, b"y") == b"y"
        assert not store.wait([run + "a"], 0.3)
        assert store.delete_prefix(prefix + "nothing/") == 0

    def test_delete_prefix_deletes_what_other_connections_wrote(
        self, store: CoordinationStore, connect: Connect, prefix: str
    ) -> None:
        other = connect()
        try:
            other.set(prefix + "theirs", b"1")
            other.keep_alive(prefix + "their-hb", 30)
            assert store.delete_prefix(prefix) == 1 + self.liveness_is_a_key
            assert other.get(prefix + "theirs") is None
        finally:
            other.close()

    def test_a_wait_begun_before_a_delete_is_not_fooled_after_it(
        self, connect: Connect, prefix: str
    ) -> None:
        # A wait that saw `a` set, still waiting for `b` while `a` is deleted; then a
        # second wait on the same keys (which may share the first one's subscription).
        first, second, writer = connect(), connect(), connect()
        keys = [prefix + "a", prefix + "b"]
        timers: list[threading.Timer] = []
        try:
            earlier = threading.Thread(target=first.wait, args=(keys, 5.0), daemon=True)
            earlier.start()
            time.sleep(0.3)  # the first wait has begun (its outcome is not checked)
            writer.set(keys[0], b"1")
            writer.delete_prefix(prefix)
            _later(timers, writer.set, keys[1], b"1")
            assert not second.wait(keys, 1.5), "a deleted key counted as present"
            earlier.join(10)
        finally:
            _join(timers)
            for client in (first, second, writer):
                client.close()

    def test_clone_is_a_second_connection(self, store: CoordinationStore, prefix: str) -> None:
        clone = store.clone()
        try:
            result = _in_threads(1, lambda _: clone.add(prefix + "n", 5))
            assert result == [5]
            assert store.add(prefix + "n", 0) == 5
        finally:
            clone.close()


class ProtocolOverStore(_Conformance):
    """The rendezvous protocol on the real store: rounds, late and lost nodes, leaving,
    a clean finish, bad state."""

    def _node(
        self,
        connect: Connect,
        run_id: str,
        name: str,
        low: int,
        high: int,
        **conf: float,
    ) -> StoreRendezvous:
        return self._sealed_node(connect, run_id, name, low, high, None, **conf)

    def _sealed_node(
        self,
        connect: Connect,
        run_id: str,
        name: str,
        low: int,
        high: int,
        token: bytes | None,
        **conf: float,
    ) -> StoreRendezvous:
        """A node whose records are sealed with ``token`` (none: not sealed)."""
        settings = Settings.from_conf(low, high, {"last_call_timeout": 2.0, **conf})
        node = NodeSpec(name, host="127.0.0.1")
        host = False if self.store_in_agent else None
        return StoreRendezvous(
            connect(), run_id, node, 2, _ORDERED, settings, token=token, host=host
        )

    def test_concurrent_joins_agree(self, connect: Connect) -> None:
        run_id = uuid.uuid4().hex
        # A last call of 60 s: the round must close when the 8th node joins, not after it.
        nodes = [
            self._node(connect, run_id, f"node{i}", 8, 8, last_call_timeout=60) for i in range(8)
        ]
        try:
            began = time.monotonic()
            assignments = _in_threads(8, lambda i: nodes[i].next_round())
            took = time.monotonic() - began
        finally:
            for node in nodes:
                node.close()
        assert all(isinstance(a, Assignment) for a in assignments), assignments
        infos = [a.info for a in assignments]
        assert sorted(info.group_rank for info in infos) == list(range(8))
        assert len({(info.members, info.master_port, info.round) for info in infos}) == 1
        assert all(info.world_size == 16 for info in infos)
        assert took < 30, "MAX nodes joined: the round must close then, not after the last call"

    def test_run_ids_never_mix(self, connect: Connect) -> None:
        runs = [uuid.uuid4().hex, uuid.uuid4().hex]
        nodes = [self._node(connect, runs[i % 2], f"n{i}", 2, 2) for i in range(4)]
        try:
            assignments = _in_threads(4, lambda i: nodes[i].next_round())
        finally:
            for node in nodes:
                node.close()
        members = {run: set() for run in runs}  # type: dict[str, set[str]]
        for index, assignment in enumerate(assignments):
            members[runs[index % 2]].update(assignment.info.members)
        assert members == {runs[0]: {"n0", "n2"}, runs[1]: {"n1", "n3"}}

    @staticmethod
    def _join_late(first: StoreRendezvous, late: StoreRendezvous) -> tuple[Assignment, Assignment]:
        """``late`` joins on another thread while ``first`` runs a round; once ``first``
        sees that round end (within 10 s), it joins the next one: both assignments."""
        joined: list[Assignment] = []
        thread = threading.Thread(target=lambda: joined.append(late.next_round()), daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while first.nodes_waiting() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.nodes_waiting() == 1, "the late node did not end the running round"
        again = first.next_round()
        thread.join(30)
        assert joined, "the late node did not join the next round"
        return again, joined[0]

    def test_a_late_node_ends_the_round_when_there_is_room(self, connect: Connect) -> None:
        from rallypoint.rendezvous import records
        from rallypoint.rendezvous.keys import Keys

        run_id = uuid.uuid4().hex
        state = Keys("/rallypoint", run_id).state()
        first = self._node(connect, run_id, "a", 1, 2, last_call_timeout=0.5)
        late = self._node(connect, run_id, "b", 1, 2, last_call_timeout=0.5)
        reader = connect()
        try:
            assert first.next_round().info.group_world_size == 1
            assert first.nodes_waiting() == 0
            # Round 0 writes no state: a new job's nodes only read it (absent: round 0).
            assert reader.get(state) is None
            again, joined = self._join_late(first, late)
            assert again.info.group_world_size == 2
            assert joined.info.members == again.info.members
            assert reader.get(state) == records.encode_int(1)
        finally:
            first.close()
            late.close()
            reader.close()

    def test_a_new_node_joins_the_round_the_job_is_in(self, connect: Connect) -> None:
        from rallypoint.rendezvous.keys import Keys

        run_id = uuid.uuid4().hex
        keys = Keys("/rallypoint", run_id)
        first = self._node(connect, run_id, "a", 1, 3, last_call_timeout=0.5)
        late = self._node(connect, run_id, "b", 1, 3, last_call_timeout=0.5)
        reader = connect()
        try:
            assert first.next_round().info.round == 0
            first.request_new_round()  # a local failure: the job moves on to round 1
            assert first.next_round().info.round == 1
            # b starts at round 0 and learns, with the number it takes there, that the job
            # is in round 1: that number is voided (an empty record) and b joins round 1,
            # which ends it for a round 2 with both.
            again, joined = self._join_late(first, late)
            assert again.info.round == 2 and again.info.group_world_size == 2
            assert joined.info.members == again.info.members
            assert reader.get(keys.of_round(0, "node", 2)) == b""
        finally:
            first.close()
            late.close()
            reader.close()

    def test_a_full_job_never_gets_a_second_round(self, connect: Connect) -> None:
        run_id = uuid.uuid4().hex
        members = [self._node(connect, run_id, f"m{i}", 1, 2) for i in range(2)]
        extra = self._node(connect, run_id, "extra", 1, 2, join_timeout=3, last_call_timeout=0.5)
        try:
            assignments = _in_threads(2, lambda i: members[i].next_round())
            assert all(a.info.group_world_size == 2 for a in assignments), assignments
            with pytest.raises(RendezvousTimeout, match="this node was not needed"):
                extra.next_round()
            assert [m.nodes_waiting() for m in members] == [0, 0]
        finally:
            for node in [*members, extra]:
                node.close()

    def _pair(self, connect: Connect, **conf: float) -> list[StoreRendezvous]:
        """Two nodes of a ``1:2`` job that formed their first round together."""
        run_id = uuid.uuid4().hex
        nodes = [self._node(connect, run_id, f"n{i}", 1, 2, **conf) for i in range(2)]
        try:
            assignments = _in_threads(2, lambda i: nodes[i].next_round())
            assert all(a.info.group_world_size == 2 for a in assignments), assignments
        except BaseException:
            for node in nodes:
                node.close()
            raise
        return nodes

    def test_a_dead_node_is_detected_and_the_survivor_reforms(self, connect: Connect) -> None:
        nodes = self._pair(connect, heartbeat_timeout=2.0, last_call_timeout=0.5)
        try:
            nodes[1]._stop_heartbeats()  # n1 dies: it stops keeping itself alive
            began = time.monotonic()
            while nodes[0].nodes_waiting() == 0:
                assert time.monotonic() - began < 15, "the dead node was never detected"
                time.sleep(0.1)
            again = nodes[0].next_round()
            assert again.info.members == ("n0",)
        finally:
            for node in nodes:
                node.close()

    def test_a_node_that_leaves_is_seen_gone_at_once(self, connect: Connect) -> None:
        # heartbeat_timeout and last call far longer than the bound: the survivor's round
        # can only close in time if the node that left is seen gone at once.
        nodes = self._pair(connect, heartbeat_timeout=60.0, last_call_timeout=40.0)
        try:
            began = time.monotonic()
            nodes[1].close()  # n1 leaves (its agent was stopped by a SIGTERM, say)
            nodes[0].request_new_round()  # n0's workers failed with n1's
            again = nodes[0].next_round()
            took = time.monotonic() - began
            assert again.info.members == ("n0",)
            assert took < 15, f"the survivor waited {took:.1f} s for a node that had left"
        finally:
            for node in nodes:
                node.close()

    def test_a_leader_that_died_before_closing_does_not_block_the_round(
        self, connect: Connect
    ) -> None:
        from rallypoint.rendezvous import records
        from rallypoint.rendezvous.keys import Keys

        run_id = uuid.uuid4().hex
        keys = Keys("/rallypoint", run_id)
        ghost = connect()  # a node that took join number 1, wrote its record and died
        try:
            ghost.compare_set(keys.state(), None, records.encode_int(0))
            assert ghost.add(keys.of_round(0, "joined"), 1) == 1
            record = records.NodeRecord("ghost", "127.0.0.1", 2, 1, run_id=run_id)
            ghost.set(keys.of_round(0, "node", 1), records.encode(record))
        finally:
            ghost.close()
        conf = {"heartbeat_timeout": 1.5, "last_call_timeout": 0.5, "join_timeout": 30.0}
        nodes = [self._node(connect, run_id, f"n{i}", 2, 3, **conf) for i in range(2)]
        try:
            began = time.monotonic()
            assignments = _in_threads(2, lambda i: nodes[i].next_round())
            took = time.monotonic() - began
        finally:
            for node in nodes:
                node.close()
        assert all(isinstance(a, Assignment) for a in assignments), assignments
        assert {a.info.members for a in assignments} == {("n0", "n1")}
        assert took < 15, f"the dead leader held the round up for {took:.1f} s"

    @pytest.mark.parametrize("token", [None, b"conformance token"], ids=["open", "sealed"])
    def test_a_job_that_finished_cleanly_leaves_no_key(
        self, connect: Connect, token: bytes | None
    ) -> None:
        from rallypoint.rendezvous.keys import Keys

        run_id = uuid.uuid4().hex
        nodes = [self._sealed_node(connect, run_id, f"n{i}", 2, 2, token) for i in range(2)]
        try:
            assignments = _in_threads(2, lambda i: nodes[i].next_round())
            assert all(isinstance(a, Assignment) for a in assignments), assignments
            _in_threads(2, lambda i: nodes[i].exit_barrier(30))
        finally:
            for node in nodes:
                node.close()
        keys = Keys("/rallypoint", run_id)
        probe = [keys.state(), keys.of_round(0, "closed"), keys.of_round(0, "node", 1)]
        probe += [keys.of_round(0, "left"), keys.heartbeat("n0"), keys.heartbeat("n1")]
        probe += [keys.of_round(0, "left", 0), keys.of_round(0, "done", "all"), keys.token_key]
        probe += [keys.heartbeat("n0") + "/mark"]
        reader = connect()
        try:
            assert reader.get_many(probe) == [None] * len(probe)
        finally:
            reader.close()

    def test_a_job_that_did_not_finish_keeps_its_keys(self, connect: Connect) -> None:
        from rallypoint.rendezvous.keys import Keys

        run_id = uuid.uuid4().hex
        nodes = [self._node(connect, run_id, f"n{i}", 2, 2) for i in range(2)]
        try:
            assignments = _in_threads(2, lambda i: nodes[i].next_round())
            assert all(isinstance(a, Assignment) for a in assignments), assignments
            nodes[0].exit_barrier(0.5)  # n1 never finishes: it may still come back
        finally:
            for node in nodes:
                node.close()
        reader = connect()
        try:
            assert reader.get(Keys("/rallypoint", run_id).of_round(0, "closed")) is not None
        finally:
            reader.close()

    def test_malformed_state_is_a_clear_error(self, connect: Connect) -> None:
        run_id = uuid.uuid4().hex
        writer = connect()
        try:
            writer.set(f"/rallypoint/{run_id}/state", b"\x80\x04K\x00.")  # a pickle
        finally:
            writer.close()
        node = self._node(connect, run_id, "a", 1, 1)
        try:
            with pytest.raises(StoreError, match="is not JSON"):
                node.next_round()
        finally:
            node.close()


class StoreConformance(StoreOperations, ProtocolOverStore):
    """Subclass with a ``connect`` fixture; every test runs against the real store: its
    operations (``StoreOperations``) and the protocol on it (``ProtocolOverStore``)."""

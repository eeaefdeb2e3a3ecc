"""Hang evidence across nodes: what a node's ranks wait for is shared through the
rendezvous (``HangWatch.shared``, ``rendezvous.boards.WaitBoard``), and a node that holds a
suspect reads it (``wanted``): timelines with no real time, then the board between two
real handlers on one store."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hangs import CEILING, FLOOR, Job, trained

from rallypoint.agent.monitoring.hangs import COLLECTIVE, SILENT, STUCK
from rallypoint.rendezvous.boards import MAX_WAITS_BYTES
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.memory_store import MemoryStore


def step_together(nodes: dict[str, Job], seconds: float) -> dict[str, list[Any]]:
    """The nodes' timelines side by side, half a second at a time; each reads what the
    others shared the half second before (a heartbeat's delay, and more)."""
    found: dict[str, list[Any]] = {name: [] for name in nodes}
    for _ in range(round(seconds / 0.5)):
        shared = {name: job.watch.shared(job.now) for name, job in nodes.items()}
        for name, job in nodes.items():
            job.peers = {
                other: said
                for other, said in shared.items()
                if other != name and said is not None and job.watch.wanted(job.now)
            }
            found[name] += job.run(0.5)
    return found


def test_a_rank_stuck_on_one_node_is_found_from_its_peer_waiting_on_another() -> None:
    """One rank per node: node a's rank 0 stops, node b's rank 1 waits in all_reduce. Alone,
    a sees work and b a rank waiting alone (the ceiling); together, a's rank is stuck."""
    a, b = trained(Job(ranks=1, world_size=2)), trained(Job(ranks=1, world_size=2, first=1))
    stalled_at = a.now
    b.progress()
    b.enter(0)
    assert a.watch.shared(a.now) is None and not b.watch.wanted(b.now)
    found = step_together({"a": a, "b": b}, 3 * FLOOR)
    assert found["b"] == []
    (at, verdict), *_ = found["a"]
    assert verdict.kind == STUCK and verdict.kill == (0,)
    assert stalled_at + FLOOR <= at <= stalled_at + FLOOR + 1.0
    assert verdict.sentence(at, {0: "data.py:120 in read()"}) == (
        "rank 0 made no progress for 10 s while rank 1 waited in all_reduce (train.py:88); "
        "rank 0 was at data.py:120 in read()"
    )


def test_a_collective_every_node_waits_in_is_found_whole_before_the_ceiling() -> None:
    a, b = trained(Job(ranks=2, world_size=4)), trained(Job(ranks=2, world_size=4, first=2))
    for job, ops in ((a, ("all_reduce", "all_reduce")), (b, ("broadcast", "broadcast"))):
        job.progress()
        for r, op in enumerate(ops):
            job.enter(r, op, f"train.py:{88 if op == 'all_reduce' else 90}")
    found = step_together({"a": a, "b": b}, 2 * FLOOR)
    for name in ("a", "b"):
        (at, verdict), *_ = found[name]
        assert verdict.kind == COLLECTIVE and verdict.kill == (0, 1)
        assert at < CEILING
        assert verdict.sentence(at) == (  # the same on both nodes
            "every rank waited in different collectives for 10 s: ranks 0-1 waited in "
            "all_reduce (train.py:88), ranks 2-3 waited in broadcast (train.py:90)"
        )


def test_without_the_other_nodes_a_node_waits_for_the_ceiling() -> None:
    """Node b's ranks never said anything: node a's all-waiting ranks are only a part of
    the job, and stay until the ceiling."""
    a = trained(Job(ranks=2, world_size=4))
    for r in (0, 1):
        a.enter(r)
    start = a.now
    at, verdict = a.run(2 * CEILING)[0]
    assert verdict.kind == SILENT and at - start == pytest.approx(CEILING)


def test_a_node_shares_nothing_where_the_job_is_all_on_it_or_none_waits_long() -> None:
    job = trained(Job(ranks=2))  # world size 2: the whole job is here
    job.enter(0)
    job.run(2 * FLOOR)
    assert job.watch.shared(job.now) is None and not job.watch.wanted(job.now)
    job = trained(Job(ranks=2, world_size=4))
    job.enter(0)
    job.run(FLOOR - 1)
    assert job.watch.shared(job.now) is None  # under the floor: nothing to say yet
    job.run(1)
    assert job.watch.shared(job.now) == {
        "waits": [{"op": "all_reduce", "site": "train.py:88", "ranks": [0], "waited": FLOOR}],
        "late": [0],
    }


HOSTILE = [
    {"waits": [{"op": "all_reduce", "site": "x", "ranks": [7], "waited": 50.0}], "late": []},
    {"waits": [{"op": "all_reduce", "site": "x", "ranks": [1], "waited": -50.0}], "late": []},
    {"waits": [{"op": "all_reduce", "site": "x", "ranks": [1], "waited": 1e400}], "late": []},
    {"waits": [{"op": 3, "site": "x", "ranks": [1], "waited": 50.0}], "late": []},
    {"waits": [{"op": "a", "site": "x", "ranks": [1], "waited": 50.0}] * 5, "late": []},
    {"waits": [{"op": "a", "site": "x", "ranks": [True], "waited": 50.0}], "late": []},
    {"waits": [], "late": [1]},
    {"waits": "all", "late": [1]},
    [1, 2],
    "waiting",
]


@pytest.mark.parametrize("said", HOSTILE)
def test_what_a_peer_says_out_of_shape_is_no_evidence(said: object) -> None:
    """Ranks outside the job, negative or endless waits, too many places: the summary is
    dropped whole, and the stuck rank waits for the ceiling as if nobody had said a word."""
    job = trained(Job(ranks=1, world_size=2))
    job.peers = {"b": said}
    verdicts = job.run(3 * FLOOR)
    assert all(v.kind not in (STUCK, COLLECTIVE) for _, v in verdicts), verdicts


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["waits", "late", "op", "site", "ranks", "waited"]), inner
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=4), JSON, max_size=3))
def test_whatever_the_peers_say_a_verdict_never_raises(peers: dict[str, Any]) -> None:
    job = trained(Job(ranks=1, world_size=2))
    job.peers = peers
    for _, verdict in job.run(3 * FLOOR):
        assert verdict.sentence(job.now)


# --- the board: two real handlers on one store ------------------------------------------


class Source:
    """A node's hang detection as the board sees it: what it shares, whether it wants."""

    def __init__(self) -> None:
        self.said: Mapping[str, Any] | None = None
        self.want = False

    def shared(self) -> Mapping[str, Any] | None:
        return self.said

    def wanted(self) -> bool:
        return self.want


def until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_heartbeat_shares_a_node_s_waits_with_a_node_that_wants_them() -> None:
    from rallypoint.builtins.rank_assigners import register_rank_assigners
    from rallypoint.extensions import NodeSpec
    from rallypoint.rendezvous.protocol import StoreRendezvous
    from rallypoint.rendezvous.settings import Settings

    store = MemoryStore()
    ordered = register_rank_assigners()[0]
    conf = {"last_call_timeout": 0.2, "heartbeat_timeout": 0.6}  # a beat every 0.2 s
    settings_ = Settings.from_conf(2, 2, conf)
    sources = {"a": Source(), "b": Source()}
    a, b = (
        StoreRendezvous(
            store, "job", NodeSpec(name, host="h"), 1, ordered, settings_, waits=sources[name]
        )
        for name in ("a", "b")
    )
    key = Keys("/rallypoint", "job").of_round(0, "waits", "a")
    try:
        joined = threading.Thread(target=b.next_round)
        joined.start()
        a.next_round()
        joined.join(10)
        said = {"waits": [{"op": "all_reduce", "site": "t.py:1", "ranks": [0], "waited": 61.0}]}
        sources["a"].said = said
        until(lambda: store.get(key) is not None)
        assert b.waits() == {}  # b did not want them: it read nothing
        sources["b"].want = True
        until(lambda: b.waits() == {"a": said})
        sources["a"].said = None  # a's ranks wait no longer: it says so once
        until(lambda: store.get(key) == b"")
        until(lambda: b.waits() == {})
        for hostile in (b"[1]", b"{not json", b"{" + b" " * MAX_WAITS_BYTES + b"}"):
            store.set(key, hostile)
            time.sleep(0.5)  # two beats of b's
            assert b.waits() == {}, hostile
        sources["b"].want = False
        store.set(key, json.dumps(said).encode())
        time.sleep(0.5)
        assert b.waits() == {} and a.waits() == {}
    finally:
        a.close()
        b.close()

"""The protocol's side of cheap joins and departures, on the in-memory store: a newcomer
waits beside a running round until its agent says it is ready; a node told to stop gives
the round notice, and the next round does not wait for it."""

from __future__ import annotations

import threading
import time

import pytest

from rallypoint.builtins.rank_assigners import register_rank_assigners
from rallypoint.extensions import NodeSpec
from rallypoint.interfaces import Assignment, RendezvousTimeout
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.memory_store import MemoryStore
from rallypoint.rendezvous.protocol import StoreRendezvous
from rallypoint.rendezvous.settings import Settings
from rallypoint.rendezvous.status import read_status

CONF = {"last_call_timeout": 0.2, "heartbeat_timeout": 3, "join_timeout": 20}


def handler(store: MemoryStore, name: str, **conf: float) -> StoreRendezvous:
    settings = Settings.from_conf(1, 2, {**CONF, **conf})
    ordered = register_rank_assigners()[0]
    return StoreRendezvous(store, "job", NodeSpec(name, host="h"), 1, ordered, settings)


def in_thread(call: object) -> tuple[threading.Thread, list[object]]:
    results: list[object] = []

    def run() -> None:
        try:
            results.append(call())  # type: ignore[operator]
        except Exception as error:  # the test reads it
            results.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, results


def test_a_newcomer_gets_ready_beside_the_running_round_then_joins() -> None:
    store = MemoryStore()
    a = handler(store, "a")
    first = a.next_round()
    assert first.info.members == ("a",)
    ready = threading.Event()
    asked: list[object] = []

    def getting_ready(offers: object) -> str | None:
        asked.append(offers)
        return None if ready.is_set() else "importing torch"

    b = StoreRendezvous(
        store, "job", NodeSpec("b", host="h"), 1, register_rank_assigners()[0],
        Settings.from_conf(1, 2, {**CONF, "last_call_timeout": 10}), ready=getting_ready,
    )  # fmt: skip
    try:
        joining, results = in_thread(b.next_round)
        deadline = time.monotonic() + 10
        while not read_status(store, Keys("/rallypoint", "job"), "job", 3)["getting_ready"]:
            assert time.monotonic() < deadline, "b never said it was getting ready"
            time.sleep(0.05)
        status = read_status(store, Keys("/rallypoint", "job"), "job", 3)
        assert status["getting_ready"] == [{"node_id": "b", "doing": "importing torch"}]
        time.sleep(0.5)
        assert a.nodes_waiting() == 0, "the running round ended before b was ready"
        ready.set()
        while not a.nodes_waiting():  # b, ready, ended the round
            assert time.monotonic() < deadline + 10, "b never joined"
            time.sleep(0.05)
        assert a.noticed(None) is None  # a proposes no step: none is written
        assert a.noticed(41) == 41  # a newcomer ended the round: the first proposal holds
        assert a.noticed(45) == 41
        assert a.next_round().info.members == ("a", "b")
        joining.join(10)
        (second,) = results
        assert isinstance(second, Assignment), second
        assert second.info.members == ("a", "b")
        assert asked and all(offers == () for offers in asked)  # a offered nothing
        assert read_status(store, Keys("/rallypoint", "job"), "job", 3)["getting_ready"] == []
    finally:
        a.close()
        b.close()


def test_a_newcomer_never_ready_gives_up_with_a_sentence() -> None:
    store = MemoryStore()
    a = handler(store, "a")
    a.next_round()
    b = StoreRendezvous(
        store, "job", NodeSpec("b", host="h"), 1, register_rank_assigners()[0],
        Settings.from_conf(1, 2, {**CONF, "ready_timeout": 0.3}),
        ready=lambda offers: "importing torch",
    )  # fmt: skip
    try:
        with pytest.raises(
            RendezvousTimeout, match=r"not ready .* ready_timeout=0.3 s \(still importing torch\)"
        ):
            b.next_round()
        assert a.nodes_waiting() == 0
    finally:
        a.close()
        b.close()


def test_a_node_told_to_stop_gives_notice_and_is_not_waited_for() -> None:
    store = MemoryStore()
    a, b = handler(store, "a"), handler(store, "b")
    try:
        joined, _ = in_thread(b.next_round)
        a.next_round()
        joined.join(10)
        if a.state.view.record is not None and len(a.state.view.record.node_ids) < 2:
            a.next_round()  # b came after a's round closed: the next one has both
        assert a.state.view.record is not None and len(a.state.view.record.node_ids) == 2
        assert a.noticed(5) is None  # the round goes on: nothing to save
        assert b.give_notice(17) == 17
        assert a.give_notice(30) == 17  # the first notice written is everyone's
        deadline = time.monotonic() + 10
        while not a.nodes_waiting():
            assert time.monotonic() < deadline, "the round did not end"
            time.sleep(0.05)
        assert a.noticed() == 17
        assert a.noticed(99) == 17
        began = time.monotonic()
        alone = a.next_round()  # b is alive (it holds its workers at the save) but leaving
        assert alone.info.members == ("a",)
        assert time.monotonic() - began < 3  # not heartbeat_timeout, nor last_call after it
    finally:
        a.close()
        b.close()

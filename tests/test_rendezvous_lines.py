"""What a node waiting in a rendezvous prints, and how a run id used again is read from
the store: on the in-memory store, with the protocol's own functions."""

from __future__ import annotations

import pytest

from rallypoint.rendezvous import calls, generations, records
from rallypoint.rendezvous.generations import current_generation, inspect_run
from rallypoint.rendezvous.heartbeat import progress_line
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.memory_store import MemoryStore
from rallypoint.rendezvous.settings import Settings

SETTINGS = Settings.from_conf(2, 4, {"last_call_timeout": 30})


@pytest.mark.parametrize(
    ("joined", "line"),
    [
        (1, "rendezvous round 3: 1 of 2:4 nodes joined; waiting for 1 more, 595 s left before join_timeout"),
        (2, "rendezvous round 3: 2 of 2:4 nodes joined, MIN reached; it closes when 4 are in, or when the last call ends (last_call_timeout=30 s)"),
        (4, "rendezvous round 3: 4 of 2:4 nodes joined; closing it"),
        (6, "rendezvous round 3: 4 of 2:4 nodes joined (2 more wait for a later round); closing it"),
    ],
)  # fmt: skip
def test_a_waiting_node_says_what_its_round_waits_for(joined: int, line: str) -> None:
    assert progress_line(3, joined, SETTINGS, left=595.2) == line


def test_the_leader_says_when_its_last_call_ends() -> None:
    line = progress_line(0, 3, SETTINGS, left=500, closes_in=25.4)
    assert (
        line
        == "rendezvous round 0: 3 of 2:4 nodes joined, MIN reached; it closes in 25 s unless 1 more join"
    )


def dead_run(store: MemoryStore, keys: Keys, members: tuple[str, ...], alive: set[str]) -> None:
    """A run left in round 1 by ``members``; those in ``alive`` keep their heartbeat."""
    store.set(keys.state(), records.encode_int(1))
    record = records.RoundRecord(
        0, members, tuple("h" for _ in members), (1,) * len(members), "h", 1, run_id=keys.run_id
    )
    store.set(keys.of_round(0, "closed"), records.encode(record))
    for index, node in enumerate(members, start=1):
        store.add(keys.of_round(1, "joined"), 1)
        node_record = records.NodeRecord(node, "h", 1, 1, run_id=keys.run_id, nnodes="1:2")
        store.set(keys.of_round(1, "node", index), records.encode(node_record))
    for node in alive:
        store.keep_alive(keys.heartbeat(node), 60)


def settle_generation(store: MemoryStore, keys: Keys, nnodes: str) -> Keys:
    return calls.drive(generations.settle(keys, lambda key: calls.alive(key, 60), nnodes), store)


def test_a_run_with_no_agent_alive_starts_afresh_and_loses_its_keys() -> None:
    store, keys = MemoryStore(), Keys("/rallypoint", "job")
    dead_run(store, keys, ("a", "b"), alive=set())
    assert inspect_run(store, keys, 60)[0] == "round 1, 2 nodes, none with a heartbeat"
    fresh = settle_generation(store, keys, "1:2")
    assert fresh.generation == 1 and fresh.root == "/rallypoint/job~1/"
    assert store.get(keys.state()) is None  # the dead generation's keys are gone
    assert current_generation(store, keys).generation == 1
    assert inspect_run(store, fresh, 60) == (None, "")  # a new run: nothing to count


def test_a_run_with_one_agent_alive_is_joined() -> None:
    store, keys = MemoryStore(), Keys("/rallypoint", "job")
    dead_run(store, keys, ("a", "b"), alive={"b"})
    assert settle_generation(store, keys, "1:2").generation == 0
    with pytest.raises(Exception, match="is the id of a running job of --nnodes 1:2"):
        settle_generation(store, keys, "4:4")


def test_records_of_a_later_generation_are_the_run_s_own() -> None:
    keys = Keys("/rallypoint", "job", 3)
    node = records.NodeRecord("a", "h", 1, 1, run_id="job")
    assert records.decode_node(keys.of_round(0, "node", 1), records.encode(node)) == node
    with pytest.raises(records.StoreError, match="belongs to run"):
        records.decode_node(
            Keys("/rallypoint", "other", 3).of_round(0, "node", 1), records.encode(node)
        )

"""Saves on notice across a round: before their workers stop, every node saves at one step.

The node told to stop writes the step to save at into its round (``<round>/notice``,
compare-and-set: when several are told at once, the first step written is everyone's),
marks itself as leaving (``<round>/leaving/<node id>``), and ends the round. Every other
member sees the round end (its heartbeat waits on the next round's ``open`` key), reads
the notice once, and has its workers save at that step before they stop. The next round
does not wait for a leaving node, which may still be holding its workers at the save:
it closes with the others (``Leader._wait_for_survivors``). A round that a newcomer ends
is saved the same way, at the step the first member to see it end proposes: no step is
redone after a join either.
"""

from __future__ import annotations

from rallypoint.interfaces import StoreError
from rallypoint.rendezvous import calls, records
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.joining import advance
from rallypoint.rendezvous.node import NodeState


def give(node: NodeState, step: int) -> Steps[int]:
    """This node was told to stop, its workers at ``step``: give the round notice, mark
    this node as leaving, end the round. The step every node saves at."""
    view = node.view
    round_, record, keys = view.round, view.record, view.keys
    if round_ is None or record is None or len(record.node_ids) < 2:
        return step  # alone: the notice is this node's only
    key = keys.of_round(round_, "notice")
    written = yield from calls.compare_set(key, None, records.encode_int(step))
    yield from calls.set_(keys.leaving(round_, node.node_id), b"1")
    yield from advance(keys, round_, len(record.node_ids) - 1)
    agreed = _step(key, written)
    return step if agreed is None else agreed


def read(node: NodeState, proposal: int | None) -> Steps[int | None]:
    """The step every member of this node's round saves at before its workers stop, once
    the round ended: the notice a node told to stop gave; else, when a newcomer ended it
    (the next round expects more nodes than this one has), the first member's
    ``proposal`` (compare-and-set: the same for all). None: no save on notice."""
    view = node.view
    round_, record, keys = view.round, view.record, view.keys
    if round_ is None or record is None:
        return None
    key = keys.of_round(round_, "notice")
    raw = yield from calls.get(key)
    if raw:
        return _step(key, raw)
    if proposal is None:
        return None
    expected_key = keys.of_round(round_ + 1, "expected")
    expected = yield from calls.get(expected_key)
    if not expected or (_step(expected_key, expected) or 0) <= len(record.node_ids):
        return None  # not for a newcomer: a node lost, or workers failed
    return _step(key, (yield from calls.compare_set(key, None, records.encode_int(proposal))))


def _step(key: str, raw: bytes) -> int | None:
    try:
        return records.decode_int(key, raw)
    except StoreError:
        return None  # not a notice of ours: no save on notice

"""A node's heartbeat: its liveness, its ring neighbour, and the end of its round.

Every ``heartbeat_timeout / 3`` the heartbeat keeps this node alive; in a round it checks
the member it watches (the next one in rank order) and ends the round when that one
stopped beating; between beats it waits on the next round's ``open`` key, so that the
agent learns that the round ended by reading memory (``NodeState.round_ended``). While
the node joins, it prints what the round waits for every ``PROGRESS_INTERVAL``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from rallypoint.rendezvous import calls, records
from rallypoint.rendezvous.boards import Board
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.node import Membership, NodeState, Watch
from rallypoint.rendezvous.rounds import advance, newer_generation, store_lost
from rallypoint.rendezvous.settings import Settings

logger = logging.getLogger("rallypoint.rendezvous")

#: Seconds between "who has joined" lines while a node waits in a rendezvous.
PROGRESS_INTERVAL = 5.0
#: The longest the heartbeat blocks in one store call while a round runs; it bounds how
#: long closing the handler waits for the heartbeat thread.
WAKE_SLICE = 0.5


class Heartbeat:
    """One node's heartbeat; a thread of its own runs ``run``."""

    def __init__(self, node: NodeState, boards: Sequence[Board] = ()) -> None:
        self.node = node
        self.boards = boards  # what this node shares with the round's others on each beat
        self._dropped: Watch | None = None  # the watch whose node this heartbeat found gone
        # The record this node holds, and its bytes as the store had them when compared.
        self._record: tuple[records.RoundRecord, bytes] | None = None

    def run(self, stopped: Callable[[], bool]) -> Steps[None]:
        """Beat until ``stopped()``."""
        node = self.node
        ttl = node.settings.heartbeat_timeout
        # The node renewed its liveness just before it started this (``_start_heartbeats``):
        # the first beat is a third of a ttl after that, not a second renewal at once.
        next_beat = node.kept_at + ttl / 3
        kept: float | None = None  # when this node last renewed its liveness
        progress: tuple[float, float] | None = None  # (join deadline, next progress line)
        while not stopped():
            now = node.clock()
            if now >= next_beat:
                kept = yield from self._beat(kept)
                next_beat = now + ttl / 3
            view = node.view
            joining = view.joining
            if joining is None:
                progress = None
            elif progress is None or progress[0] != joining:
                progress = (joining, now + PROGRESS_INTERVAL)
            elif now >= progress[1]:
                progress = (joining, now + PROGRESS_INTERVAL)
                yield from self._report_progress(view, joining)
            until_beat = max(0.0, next_beat - node.clock())
            round_ = view.round
            if joining is None and round_ is not None and not node.round_ended():
                key = view.keys.of_round(round_ + 1, "open")
                if (yield from calls.wait([key], min(until_beat, WAKE_SLICE))):
                    node.ended = max(node.ended, (view.keys.generation, round_))
            else:
                until = until_beat
                if progress is not None:
                    until = min(until, max(0.0, progress[1] - node.clock()))
                yield from calls.pause(until)

    def _beat(self, kept: float | None) -> Steps[float]:
        """One beat; when this node's liveness was renewed (``kept``: the last time)."""
        node = self.node
        view = node.view
        yield from calls.keep_alive(
            view.keys.heartbeat(node.node_id), node.settings.heartbeat_timeout
        )
        node.renewed()
        if kept is not None:
            node.stalls.note(kept)  # a renewal late by more than heartbeat_timeout: a stall
        kept = node.clock()
        round_ = view.round
        left_behind = round_ is not None and view.joining is None
        if left_behind and (yield from newer_generation(node)) is not None:
            assert round_ is not None
            node.ended = max(node.ended, (view.keys.generation, round_))  # leave the round
        elif round_ is not None and left_behind and not (yield from self._round_kept(view, round_)):
            raise store_lost(round_)  # the record every member read is gone
        yield from self._check_neighbour(view)
        for board in self.boards:
            yield from board.share(view)
        return kept

    def _round_kept(self, view: Membership, round_: int) -> Steps[bool]:
        """Whether the store still has the record of ``round_`` that every member read, and
        the state that took the job there (one read): not gone (the store lost its data;
        or it lost it between the leader's look at the state and its record, which it then
        wrote into an empty store), nor another record (written after a stray deleted it).
        The record is decoded once a round; after that its bytes are compared."""
        keys = view.keys
        key, state = keys.of_round(round_, "closed"), keys.state()
        raw, raw_state = yield from calls.get_many([key, state])
        if raw is None:
            return False
        record = view.record
        if self._record is None or self._record[0] is not record:  # a round joined since
            if record is None or records.decode_round(key, raw) != record:
                return False
            self._record = (record, raw)
        elif raw != self._record[1]:
            return False
        # Absent, the state is round 0: a new job writes nothing there until a round ends.
        return round_ == 0 or (
            raw_state is not None and records.decode_state(state, raw_state) >= round_
        )

    def _check_neighbour(self, view: Membership) -> Steps[None]:
        """End the round if the member this node watches stopped beating."""
        watch = view.watch
        if watch is None or watch == self._dropped:
            return
        if (yield from self.node.alive(watch.node_id, view.keys)):
            return
        logger.warning(
            "node %s (host %s) is gone (no heartbeat within heartbeat_timeout=%g s, or it "
            "left): starting a new round",
            watch.node_id,
            watch.host,
            self.node.settings.heartbeat_timeout,
        )
        self._dropped = watch
        yield from advance(view.keys, watch.round, watch.size - 1)

    def _report_progress(self, view: Membership, deadline: float) -> Steps[None]:
        """While this node waits: who has joined its round, and what the round waits for."""
        s, keys, clock = self.node.settings, view.keys, self.node.clock
        state = records.decode_state(keys.state(), (yield from calls.get(keys.state())))
        round_ = max(state, view.last_joined or 0)
        if round_ > state and (yield from calls.get(keys.of_round(round_, "open"))) is None:
            logger.info(
                "rendezvous round %d: the job runs with %d nodes (MAX); this node waits for "
                "room, %.0f s left before join_timeout",
                round_,
                s.max_nodes,
                max(0.0, deadline - clock()),
            )
            return
        joined = yield from calls.add(keys.of_round(round_, "joined"), 0)
        last_call = view.last_call
        left = deadline - clock()
        closes = last_call[1] - clock() if last_call and last_call[0] == round_ else None
        logger.info("%s", progress_line(round_, joined, s, left, closes))


def progress_line(
    round_: int,
    joined: int,
    settings: Settings,
    left: float,
    closes_in: float | None = None,
) -> str:
    """What a waiting node prints every PROGRESS_INTERVAL: never a count above MAX (the
    nodes beyond it wait for a next round), and once MIN are in, what closes the round
    rather than a join_timeout it no longer waits for. ``closes_in``: the seconds left of
    the leader's last call, when this node leads a new job's round."""
    low, high = settings.min_nodes, settings.max_nodes
    counted = min(joined, high)
    line = f"rendezvous round {round_}: {counted} of {low}:{high} nodes joined"
    if joined > high:
        line += f" ({joined - high} more wait for a later round)"
    if counted < low:
        need = low - counted
        return f"{line}; waiting for {need} more, {max(0.0, left):.0f} s left before join_timeout"
    if counted >= high:
        return f"{line}; closing it"
    if closes_in is not None:
        closes = max(0.0, closes_in)
        return f"{line}, MIN reached; it closes in {closes:.0f} s unless {high - counted} more join"
    return (
        f"{line}, MIN reached; it closes when {high} are in, or when the last call ends "
        f"(last_call_timeout={settings.last_call_timeout:g} s)"
    )

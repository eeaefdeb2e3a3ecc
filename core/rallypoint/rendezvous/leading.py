"""The leader of a round: the node with join number 1 forms the round and closes it.

It waits for MIN usable joiners, then for a new job's last call (closing at once when MAX
are in) or for the last round's survivors, orders the joiners with the rank assigner and
writes the round's record (compare-and-set: a leader taken for gone whose place another
node took may close it too; the first record is the round's). Its waits are on the store
(event-driven), in slices of heartbeat_timeout / 3 between which it asks whether the job
went on without it (``rounds.RunChecks``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from rallypoint.errors import RallypointError
from rallypoint.extensions import NodeSpec, RankAssigner
from rallypoint.interfaces import RendezvousFailed, RendezvousTimeout, StoreError
from rallypoint.registry import RANK_ASSIGNERS, describe, plugin_failure
from rallypoint.rendezvous import calls, records
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.generations import job_round
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.node import NodeState
from rallypoint.rendezvous.rounds import LeaderLost, RunChecks, advance, store_lost
from rallypoint.rendezvous.settings import Settings

logger = logging.getLogger("rallypoint.rendezvous")


class Leader:
    """One node's part as the leader of the rounds it leads (``Joining`` calls ``lead``)."""

    def __init__(
        self,
        node: NodeState,
        assigner: RankAssigner,
        checks: RunChecks,
        master_addr: str | None = None,
    ) -> None:
        self.node = node
        self.settings = node.settings
        self.assigner = assigner
        self.checks = checks
        self.master_addr = master_addr  # given (the static backend), else rank 0's host

    @property
    def keys(self) -> Keys:
        return self.node.view.keys

    def lead(self, round_: int, deadline: float) -> Steps[records.RoundRecord]:
        """As the first joiner: wait for enough nodes, then close the round; its record."""
        s, keys = self.settings, self.keys
        before = yield from self._previous(round_)
        running = before.node_ids if before is not None else ()
        if round_ > 0 and not (yield from self._wait_open(round_, deadline, running)):
            raise RendezvousTimeout(
                f"rendezvous round {round_}: the job kept running with its {s.max_nodes} nodes "
                f"(the maximum) for join_timeout={s.join_timeout:g} s; this node was not needed"
            )
        nodes, read = yield from self._wait_min(round_, deadline)
        # No record of the previous round: its leader died before closing it (or this is
        # the first round): form this one as a new job.
        previous = yield from self._previous(round_)
        if previous is None:
            # A new job: last call for more nodes, closing at once when MAX are in.
            self.node.publish(last_call=(round_, self.node.clock() + s.last_call_timeout))
            yield from calls.wait([keys.of_round(round_, "node", s.max_nodes)], s.last_call_timeout)
            count = yield from self.count(round_)
            nodes, read = yield from self._gather(round_, nodes, read, count)
        else:
            nodes = yield from self._wait_for_survivors(round_, previous, nodes, read)
        if (yield from self.checks.ended(round_)) or not nodes:
            # While this node could not reach the store, the others took it for dead and
            # moved on (the round ended, or every join record of it expired): closing this
            # round would start workers nobody joins.
            raise LeaderLost()
        if round_ > 0 and (yield from job_round(keys)) < round_:
            # Opened, yet the job's state is short of it: the state that opened it is gone
            # (the store lost its data meanwhile). Closing it would start a second job.
            raise store_lost(round_)
        closed = keys.of_round(round_, "closed")
        try:
            record = self._form(round_, nodes)
        except RallypointError as error:
            failed = records.RoundRecord(
                round_, (), (), (), "", 0, error=str(error), run_id=keys.run_id
            )
            yield from calls.compare_set(closed, None, records.encode(failed))
            raise
        # Compare-and-set: a leader taken for gone whose place another node took may still
        # close the round; the first record written is the round's, for both.
        mine = records.encode(record)
        written = yield from calls.compare_set(closed, None, mine)
        if written == mine:
            return record
        theirs = records.decode_round(closed, written)
        if theirs.error:
            raise RendezvousFailed(theirs.error)
        return theirs

    def _wait_min(
        self, round_: int, deadline: float
    ) -> Steps[tuple[list[records.NodeRecord], int]]:
        """As the leader: wait until MIN joiners have usable records; those records, and
        the join numbers read. Usually one wait, for join number MIN's record, and one
        read. A number can be voided (its node moved on, or took the lead of a waiting
        round) or never recorded (its node died between taking and recording it, or a
        join whose reply was lost was retried and counted twice): then the leader reads
        what is there (waiting close_timeout for what is missing) and waits for more."""
        s, node, keys = self.settings, self.node, self.keys
        target = s.min_nodes  # the join number whose record would make MIN
        short = False  # whether a read found fewer than MIN: read again on every slice
        slice_ = s.heartbeat_timeout / 3
        while True:
            left = deadline - node.clock()
            recorded = yield from calls.wait(
                [keys.of_round(round_, "node", target)], min(left, slice_)
            )
            count = yield from self.count(round_, target if recorded else 0)
            if recorded or count >= target or short:
                # From number 1 again: a number found without a record may have one now
                # (its node was slow to write it, frozen say). Only numbers taken: a
                # recorded target is one of them.
                nodes, read = yield from self._gather(round_, [], 0, count)
                if len(nodes) >= s.min_nodes:
                    return nodes, read
                short = True
                target = count + s.min_nodes - len(nodes)
            if left <= slice_:
                raise RendezvousTimeout(
                    f"rendezvous round {round_}: fewer than {s.min_nodes} nodes joined within "
                    f"join_timeout={s.join_timeout:g} s"
                )
            if (yield from self.checks.ended(round_)):
                raise LeaderLost()

    def count(self, round_: int, written: int = 0) -> Steps[int]:
        """How many join numbers of ``round_`` were taken, capped (``most_joins``): at least
        ``written``, a number this node saw recorded, whatever the count says (a stray can
        take from it; a leader that believed it would wait on that record for ever)."""
        count = yield from calls.add(self.keys.of_round(round_, "joined"), 0)
        return min(max(count, written), self.settings.most_joins)

    def _gather(
        self, round_: int, nodes: list[records.NodeRecord], read: int, count: int
    ) -> Steps[tuple[list[records.NodeRecord], int]]:
        """``nodes`` and the usable joiners of numbers ``read + 1..count``, until MAX are
        in; and the join numbers read. Numbers are read in batches of what MAX still has
        room for: at a thousand joiners and MAX 8, the leader reads about 8 records, and
        a voided or unrecorded number costs one more. Missing records are waited for
        close_timeout in all, not per batch: a count a stray added to is read to its cap
        without a wait more."""
        s = self.settings
        until = self.node.clock() + s.close_timeout
        while read < count and len(nodes) < s.max_nodes:
            upto = min(count, read + s.max_nodes - len(nodes))
            seen = {n.node_id for n in nodes}
            fresh = yield from self._joined(round_, upto, start=read + 1, until=until)
            nodes = nodes + [n for n in fresh if n.node_id not in seen]
            read = upto
        return nodes, read

    def _wait_open(self, round_: int, deadline: float, running: tuple[str, ...]) -> Steps[bool]:
        """As the leader of ``round_``, a round after the job's first: wait until it opens
        (``False`` at ``deadline``), and give it up (``LeaderLost``) if the others ended it
        meanwhile, taking this node for dead (it could not reach the store for longer than
        heartbeat_timeout).

        ``running``: the members of the full round this one waits to follow; when none
        of them is alive any more (a job whose agents were all killed, run again before
        their liveness lapsed), nobody is left to end that round: this node ends it."""
        node, slice_ = self.node, self.settings.heartbeat_timeout / 3
        key = self.keys.of_round(round_, "open")
        while True:
            left = deadline - node.clock()
            if (yield from calls.wait([key], min(left, slice_))):
                return True
            if left <= slice_:
                return False
            state = yield from job_round(self.keys)
            if state == round_:
                # The job is in this round, but the node that moved it here died before
                # opening it (two writes): open it, for the members of the last round too.
                yield from calls.set_(key, b"1")
                return True
            if (yield from self.checks.ended(round_, state)):
                raise LeaderLost()
            if running and not (yield from _any_alive(node, running)):
                logger.info(
                    "rendezvous round %d: no member of the round before it is alive: "
                    "starting it without them",
                    round_,
                )
                yield from advance(self.keys, round_ - 1, 0)
                running = ()

    def _previous(self, round_: int) -> Steps[records.RoundRecord | None]:
        if round_ == 0:
            return None
        key = self.keys.of_round(round_ - 1, "closed")
        raw = yield from calls.get(key)
        record = records.decode_round(key, raw) if raw else None
        return record if record and not record.error else None

    def _form(self, round_: int, nodes: list[records.NodeRecord]) -> records.RoundRecord:
        """Order the joiners by the rank assigner's ranks."""
        specs = [
            NodeSpec(
                n.node_id, host=n.host, labels=n.labels, previous_rank=n.previous_rank, pace=n.pace
            )
            for n in nodes
        ]
        who = describe(RANK_ASSIGNERS, self.assigner)
        try:
            ranks = list(self.assigner.assign(specs))
        except RallypointError:  # a deliberate sentence (the static backend's own ranks)
            raise
        except Exception as error:  # a plugin's: the round fails, for every node, in a sentence
            outcome = "the round cannot form, and the job stops on every node"
            failure = plugin_failure(who, "assign", error, outcome)
            raise RendezvousFailed(f"rendezvous round {round_}: {failure}") from None
        if sorted(ranks) != list(range(len(nodes))):
            raise RendezvousFailed(
                f"rendezvous round {round_}: {who} returned {ranks} for {len(nodes)} "
                f"nodes; it must return each of 0..{len(nodes) - 1} once"
            )
        ordered = [node for _, node in sorted(zip(ranks, nodes, strict=True), key=lambda p: p[0])]
        return records.RoundRecord(
            round=round_,
            node_ids=tuple(n.node_id for n in ordered),
            hosts=tuple(n.host for n in ordered),
            nprocs=tuple(n.nproc for n in ordered),
            master_addr=self.master_addr or ordered[0].host,
            master_port=ordered[0].port,
            run_id=self.keys.run_id,
            offers=tuple(n.offer for n in ordered) if any(n.offer for n in ordered) else (),
        )

    def _joined(
        self, round_: int, count: int, start: int = 1, until: float | None = None
    ) -> Steps[list[records.NodeRecord]]:
        """The records of joiners ``start..count``, in one read once they are all written.

        A join number without a record after close_timeout (or by ``until``) is left out:
        its node died between taking the number and writing the record, or a retried
        ``add`` after a lost reply counted one join twice. The round goes on without it.
        """
        keys = [self.keys.of_round(round_, "node", i) for i in range(start, count + 1)]
        if not keys:
            return []
        limit = self.settings.close_timeout
        if until is not None:
            limit = max(0.0, min(limit, until - self.node.clock()))
        complete = yield from calls.wait(keys, limit)
        values = yield from calls.get_many(keys)
        if not complete:
            logger.warning(
                "rendezvous round %d: %d of join numbers %d..%d have no record after "
                "close_timeout=%g s; closing without them",
                round_,
                sum(v is None for v in values),
                start,
                count,
                self.settings.close_timeout,
            )
        return usable_joiners(round_, keys, values)

    def _wait_for_survivors(
        self,
        round_: int,
        previous: records.RoundRecord,
        nodes: list[records.NodeRecord],
        read: int,
    ) -> Steps[list[records.NodeRecord]]:
        """A re-formed round closes once every live member of the last one is back (and the
        newcomers it expects), without waiting out the last call for nodes that died; the
        joiners. ``nodes``: those read so far, from join numbers 1..``read``.

        Joins are awaited on the store (event-driven); between them the leader asks the
        store, every heartbeat_timeout / 3, whether the members still missing are alive.
        """
        s, node, keys = self.settings, self.node, self.keys
        raw = yield from calls.get(keys.of_round(round_, "expected"))
        expected = records.decode_int(keys.of_round(round_, "expected"), raw) if raw else 0
        end = node.clock() + s.last_call_timeout
        written = 0  # the highest join number seen recorded
        while True:
            count = yield from self.count(round_, written)
            nodes, read = yield from self._gather(round_, nodes, read, count)
            if len(nodes) >= s.max_nodes or node.clock() >= end:
                return nodes
            joined = {n.node_id for n in nodes}
            missing = []
            for node_id in previous.node_ids:
                # A member told to stop (it saves, then leaves) is not waited for.
                if (
                    node_id not in joined
                    and (yield from node.alive(node_id, keys))
                    and not (yield from calls.get(keys.leaving(previous.round, node_id)))
                ):
                    missing.append(node_id)
            if survivors_in(previous.node_ids, joined, missing, expected, s):
                return nodes
            slice_ = min(s.heartbeat_timeout / 3, max(0.0, end - node.clock()))
            began = node.clock()
            if (yield from calls.wait([keys.of_round(round_, "node", read + 1)], slice_)):
                written = read + 1
            node.stalls.note(began)


def survivors_in(
    previous: Sequence[str],
    joined: set[str],
    missing_alive: Sequence[str],
    expected: int,
    s: Settings,
) -> bool:
    """Whether a re-formed round may close: no member of the last round that is still
    alive is missing, and as many have joined as the round expects (the survivors back,
    the newcomers it was opened for; at least MIN, at most MAX). ``joined``: the node ids
    of the usable joiners, each once."""
    back = sum(1 for node_id in previous if node_id in joined)
    newcomers = max(0, expected - len(previous))
    wanted = max(s.min_nodes, min(s.max_nodes, back + newcomers))
    return not missing_alive and len(joined) >= wanted


def _any_alive(node: NodeState, node_ids: Sequence[str]) -> Steps[bool]:
    for node_id in node_ids:
        if (yield from node.alive(node_id)):
            return True
    return False


def usable_joiners(
    round_: int, keys: Sequence[str], values: Sequence[bytes | None]
) -> list[records.NodeRecord]:
    """The joiners' records that can be used. One that cannot be read (not JSON, another
    version, a field missing, another job's), or that repeats a node id already in, was
    not written by a node of this job, or not by one that can take part: the round
    closes without it, saying so, rather than failing every node."""
    nodes: list[records.NodeRecord] = []
    seen: set[str] = set()
    for key, value in zip(keys, values, strict=True):
        if not value:
            continue
        try:
            node = records.decode_node(key, value)
        except StoreError as error:
            logger.warning("rendezvous round %d: %s; closing the round without it", round_, error)
            continue
        if node.node_id in seen:
            logger.warning(
                "rendezvous round %d: record %r repeats node %r; closing the round without it",
                round_,
                key,
                node.node_id[:80],
            )
            continue
        seen.add(node.node_id)
        nodes.append(node)
    return nodes

"""Joining a round: the protocol's steps from ``next_round`` to an ``Assignment``.

The layout of the keys is in ``rendezvous.protocol``. Every function here yields its store
calls (``rendezvous.calls``); the handler performs them on the real store, the simulation
on a simulated one.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from rallypoint.errors import RallypointError
from rallypoint.events import RoundInfo
from rallypoint.extensions import NodeSpec, RankAssigner
from rallypoint.interfaces import Assignment, RendezvousFailed, RendezvousTimeout, StoreError
from rallypoint.registry import RANK_ASSIGNERS, describe, plugin_failure
from rallypoint.rendezvous import calls, generations, readiness, records
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.generations import job_round
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.node import NodeState, Watch
from rallypoint.rendezvous.settings import Settings

logger = logging.getLogger("rallypoint.rendezvous")

#: For how many heartbeat_timeouts after a stall a node checks whether the run was started
#: afresh without it (``newer_generation``): a newcomer that read its lapsed liveness may
#: move the generation a little after the stall ended.
STALL_WATCH = 3
#: How many times ``advance`` replaces a state lower than the round it ends.
_STALE_TRIES = 4


class LeaderLost(Exception):
    """The round being formed was ended before it closed: its leader died, or another node
    ended it (having found the leader dead); this node goes on to the next round."""


class Port(Protocol):
    """A master port this node holds until the next round."""

    port: int

    def release(self) -> None: ...


#: Reserve a port: the given one, or a free one (0).
ReservePort = Callable[[int], Port]


def advance(keys: Keys, from_round: int, expected: int) -> Steps[None]:
    """End round ``from_round`` for every node (unless another node already did).

    ``expected`` is how many nodes the next round should wait for before closing; it is
    written before the round changes, so the next leader always finds it.

    The state this node knows the job reached is ``from_round`` at least: a lower one in
    the store was written back there (a stray's copy of an older sealed state) and is
    replaced, so that a replayed state can neither keep a round from ending nor end one
    twice.
    """
    yield from calls.compare_set(keys.of_round(from_round + 1, "expected"), None, _int(expected))
    following = _int(from_round + 1)
    want = _int(from_round) if from_round > 0 else None
    now = b""
    for _ in range(_STALE_TRIES):
        now = yield from calls.compare_set(keys.state(), want, following)
        state = records.decode_state(keys.state(), now or None)
        if not now or state > from_round or now == want:
            break
        want = now  # 0 written out (a round that ended before its first), or a stale state
    # Only an opened round may close: a node that came to a full job waits for this; and
    # only a round the job has reached opens (no node waiting for room starts a job of
    # its own beside the running one).
    if records.decode_state(keys.state(), now or None) > from_round:
        yield from calls.set_(keys.of_round(from_round + 1, "open"), b"1")


def newer_generation(node: NodeState) -> Steps[Keys | None]:
    """The run's keys in its current generation if a node took this one's generation for
    dead (no agent of it alive) and started the next, else None. Only two kinds of node
    can be left behind so, and the key is read only for them: one whose liveness lapsed,
    that is one that stalled (within STALL_WATCH heartbeat_timeouts of it); and one that
    has yet to be in a round, whose join a newcomer can miss while it reads the run."""
    view = node.view
    stalled = node.stalls.stalled_within(STALL_WATCH * node.settings.heartbeat_timeout)
    if not stalled and view.round is not None:
        return None
    keys = view.keys
    now = yield from generations.current(keys)
    return now if now.generation > keys.generation else None


class Joining:
    """One node's way into rounds; its agent's thread is the only one that runs it."""

    def __init__(
        self,
        node: NodeState,
        assigner: RankAssigner,
        reserve_port: ReservePort,
        *,
        master_addr: str | None = None,
        master_port: int | None = None,
        offer: Callable[[], Mapping[str, str]] | None = None,
        pace: Callable[[], float | None] | None = None,
        ready: readiness.Ready | None = None,
    ) -> None:
        self.node = node
        self.settings = node.settings
        self.assigner = assigner
        self.reserve_port = reserve_port
        # Given (the static backend), else group rank 0's host and a free port it holds.
        self.master_addr = master_addr
        self.master_port = master_port
        self.offer = offer
        self.pace = pace
        self.ready = ready  # None: a node joins at once, ready or not
        self.rank: int | None = None
        self.port: Port | None = None
        self.started = False  # whether this node has joined the run before
        self.finished: int | None = None  # the round whose exit barrier every member passed

    @property
    def keys(self) -> Keys:
        return self.node.view.keys

    def next_round(self, start_heartbeat: Callable[[], None]) -> Steps[Assignment]:
        """Join the next round; ``start_heartbeat`` is called once, before the first join,
        with this node kept alive under its keys (see ``Heartbeat``)."""
        node = self.node
        deadline = node.clock() + self.settings.join_timeout
        node.publish(watch=None, joining=deadline)  # the last round's ring no longer applies
        try:
            if not self.started:
                keys = yield from generations.settle(
                    self.keys,
                    node.alive_key,
                    self.settings.nnodes,
                    node.node_id,
                    # Half a ttl: every live agent renews its mark within a third of one.
                    confirm=self.settings.heartbeat_timeout / 2 if node.sealed else 0.0,
                    most=self.settings.most_joins,
                )
                node.publish(keys=keys)
                start_heartbeat()
                self.started = True
                if self.ready is not None:
                    yield from readiness.get_ready(node, self.ready)
                    deadline = node.clock() + self.settings.join_timeout
                    node.publish(joining=deadline)
            elif node.view.round is not None and not (yield from self.follow_generation()):
                yield from self.check_failed()  # a later round: did a node fail the job?
            return (yield from self._rounds(deadline))
        finally:
            node.publish(joining=None)

    def _rounds(self, deadline: float) -> Steps[Assignment]:
        # The round after this node's last (or 0): joining it also reads the job's round,
        # and moves on to that one if the job is further on.
        view = self.node.view
        round_ = (view.round + 1) if view.round is not None else 0
        while True:
            try:
                record = yield from self._join(round_, deadline)
            except LeaderLost:
                if (yield from self.follow_generation()):
                    round_ = 0
                else:
                    last = self.node.view.last_joined or 0
                    round_ = max(last + 1, (yield from job_round(self.keys)))
                continue
            if self.node.node_id in record.node_ids:
                return self._assignment(record)
            # Too late for this round: ask for a new one if there is room, else wait.
            round_ = record.round
            running = len(record.node_ids)
            if running < self.settings.max_nodes:
                yield from advance(self.keys, round_, running + 1)
            round_ += 1

    def follow_generation(self) -> Steps[bool]:
        """Move to the run's current generation if it left this node's behind (see
        ``generations``): this node then joins it as a new node, at round 0."""
        current = yield from newer_generation(self.node)
        if current is None:
            return False
        logger.warning(
            "run %s was started afresh while this node could not reach the rendezvous "
            "store: joining it as a new node",
            current.run_id,
        )
        left = self.keys
        # Alive in the new generation before its first join record there, as a node is
        # before its first join: the heartbeat renews only every heartbeat_timeout / 3,
        # and a member that read the record first would take this node for gone.
        yield from calls.keep_alive(
            current.heartbeat(self.node.node_id), self.settings.heartbeat_timeout
        )
        self.node.publish(keys=current, round=None, record=None, last_joined=None, last_call=None)
        self.finished = None
        # The node that moved the run on deleted the old keys; what this node wrote there
        # since (a join, a counter read) is nobody's: delete it too.
        yield from calls.delete_prefix(left.root)
        return True

    def check_failed(self) -> Steps[None]:
        """Stop when another node failed the job (``fail``)."""
        raw = yield from calls.get(self.keys.failed())
        if raw is None:
            return
        try:
            data = json.loads(raw)
            node, reason = str(data["node"]), str(data["reason"])
        except (ValueError, KeyError, TypeError):
            node, reason = "?", raw.decode("utf-8", "replace")[:200]
        raise RendezvousFailed(f"the job failed on node {node}: {reason}")

    def ended(self, round_: int, state: int | None = None) -> Steps[bool]:
        """Whether the job has moved past ``round_`` (one read of the state, unless the
        caller has just read it: ``state``), or the run was started afresh without this
        node (one more read, after this node stalled). Raises the heartbeat's error if it
        stopped: the others will take this node for gone, and whatever it waits for will
        not come."""
        if self.node.heartbeat_failed is not None:
            raise self.node.heartbeat_failed
        if state is None:
            state = yield from job_round(self.keys)
        if state > round_:
            return True
        return (yield from newer_generation(self.node)) is not None

    def _join(self, round_: int, deadline: float) -> Steps[records.RoundRecord]:
        """Join ``round_``; return its record (without this node if it came too late)."""
        keys, node = self.keys, self.node
        self._reserve_port()
        if node.clock() - node.kept_at > self.settings.heartbeat_timeout / 2:
            # The heartbeat has not renewed this node's liveness lately: the store was out
            # of reach, and it may have lapsed. Renew it before the join record, or a member
            # that reads the record first takes this node for gone.
            yield from calls.keep_alive(
                keys.heartbeat(node.node_id), self.settings.heartbeat_timeout
            )
            node.renewed()
        node.publish(last_joined=round_)
        index, state = yield from calls.add_and_get(
            keys.of_round(round_, "joined"), 1, keys.state()
        )
        ahead = records.decode_state(keys.state(), state)
        if ahead > round_:
            # The job is further on: round_ has ended. The number taken there is void (an
            # empty record, which a leader still closing round_ skips without waiting);
            # join the job's round.
            yield from calls.set_(keys.of_round(round_, "node", index), b"")
            round_ = ahead
            self.node.publish(last_joined=round_)
            index = yield from calls.add(keys.of_round(round_, "joined"), 1)
        assert self.port is not None
        spec = self.node.spec
        mine = records.NodeRecord(
            node_id=spec.node_id,
            host=spec.host,
            nproc=self.node.nproc,
            port=self.port.port,
            labels=dict(spec.labels),
            previous_rank=self.rank,
            run_id=keys.run_id,
            nnodes=self.settings.nnodes,
            offer=dict(self.offer()) if self.offer is not None else {},
            pace=self.pace() if self.pace is not None else None,
        )
        encoded = records.encode(mine)
        yield from calls.set_(keys.of_round(round_, "node", index), encoded)
        if index == 1:
            return (yield from self._lead(round_, deadline))
        return (yield from self._wait_closed(round_, deadline, index, encoded))

    def _wait_closed(
        self, round_: int, deadline: float, index: int, mine: bytes
    ) -> Steps[records.RoundRecord]:
        """The record of ``round_`` once its leader closed it (one read, which the wait
        answers). If the leader dies first (it stopped keeping itself alive), or never
        wrote its join record: in the round the job is forming, end it, so that the others
        form the next one; in a round the job has yet to reach (its nodes wait for room),
        take the lead of it (``_take_lead``)."""
        s, node, keys = self.settings, self.node, self.keys
        closed_key = keys.of_round(round_, "closed")
        leader: bytes | None = None  # the leader's join record, once read
        began = waiting_since = node.clock()
        while True:
            slice_ = min(s.heartbeat_timeout / 3, max(0.0, deadline - node.clock()))
            raw = yield from calls.wait_value(closed_key, slice_)
            if raw is not None:
                record = records.decode_round(closed_key, raw)
                if record.error:
                    raise RendezvousFailed(record.error)
                return record
            node.stalls.note(began)
            began = node.clock()
            if node.clock() >= deadline:
                raise RendezvousTimeout(
                    f"rendezvous round {round_}: fewer than {s.min_nodes} nodes joined "
                    f"within join_timeout={s.join_timeout:g} s"
                )
            if (yield from self.ended(round_)):
                raise LeaderLost()  # another node ended it: its leader is gone
            first = keys.of_round(round_, "node", 1)
            if leader is None:
                leader = yield from calls.get(first)
            if leader == b"":
                continue  # voided: the job is past this round, which ``ended`` will see
            if leader is None:
                if node.clock() - waiting_since < s.close_timeout:
                    continue
                # Join number 1 was taken and never recorded: its node died in between,
                # or a join whose reply was lost was retried and counted twice.
                why = f"has no leader (join number 1 has no record after close_timeout={s.close_timeout:g} s)"
            else:
                name = records.decode_node(first, leader).node_id
                if (yield from node.alive(name, keys)):
                    continue
                why = f"lost its leader, node {name}, before it closed"
            if round_ > (yield from job_round(keys)):
                taken = yield from self._take_lead(round_, leader, index, mine)
                if taken:
                    return (yield from self._lead(round_, deadline))
                leader = None  # another node took it: watch that one
                continue
            logger.warning("rendezvous round %d %s: starting round %d", round_, why, round_ + 1)
            yield from advance(keys, round_, 0)
            raise LeaderLost()

    def _take_lead(self, round_: int, leader: bytes | None, index: int, mine: bytes) -> Steps[bool]:
        """Become the leader of ``round_``, a round the job has yet to reach, in place of
        one that is gone: swap this node's record into join number 1 (compare-and-set, so
        that one node takes it) and void its own number. Ending the round instead would
        move the job's state past a round it runs, or open rounds it has not reached."""
        first = self.keys.of_round(round_, "node", 1)
        if (yield from calls.compare_set(first, leader, mine)) != mine:
            return False
        yield from calls.set_(self.keys.of_round(round_, "node", index), b"")
        logger.warning(
            "rendezvous round %d: its leader is gone; this node leads it in its place", round_
        )
        return True

    def _reserve_port(self) -> None:
        """This round's master port, held until the next round: a free one, taken while the
        previous is still held so that attempts never share a port; or the fixed one."""
        previous, self.port = self.port, None
        if self.master_port and previous is not None:
            previous.release()  # the same port again: let go of it first
            previous = None
        try:
            self.port = self.reserve_port(self.master_port or 0)
        except OSError as error:
            raise RallypointError(
                f"--master-port {self.master_port}: cannot use it on this host "
                f"({error.strerror}); choose another port or leave --master-port out to get a free one."
            ) from None
        finally:
            if previous is not None:
                previous.release()

    def release_port(self) -> None:
        if self.port is not None:
            self.port.release()
            self.port = None

    def _lead(self, round_: int, deadline: float) -> Steps[records.RoundRecord]:
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
            count = yield from self._count(round_)
            nodes, read = yield from self._gather(round_, nodes, read, count)
        else:
            nodes = yield from self._wait_for_survivors(round_, previous, nodes, read)
        if (yield from self.ended(round_)) or not nodes:
            # While this node could not reach the store, the others took it for dead and
            # moved on (the round ended, or every join record of it expired): closing this
            # round would start workers nobody joins.
            raise LeaderLost()
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
            count = yield from self._count(round_)
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
            if (yield from self.ended(round_)):
                raise LeaderLost()

    def _count(self, round_: int) -> Steps[int]:
        """How many join numbers of ``round_`` were taken, capped (``most_joins``)."""
        count = yield from calls.add(self.keys.of_round(round_, "joined"), 0)
        return min(count, self.settings.most_joins)

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
            if (yield from self.ended(round_, state)):
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
        while True:
            count = yield from self._count(round_)
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
            yield from calls.wait([keys.of_round(round_, "node", read + 1)], slice_)
            node.stalls.note(began)

    def _assignment(self, record: records.RoundRecord) -> Assignment:
        self.rank = record.node_ids.index(self.node.node_id)
        if self.rank != 0:
            self.release_port()  # only group rank 0's port is used
        size = len(record.node_ids)
        info = RoundInfo(
            round=record.round,
            group_rank=self.rank,
            group_world_size=size,
            world_size=sum(record.nprocs),
            master_addr=record.master_addr,
            master_port=record.master_port,
            members=record.node_ids,
        )
        self.node.publish(round=record.round, record=record, watch=watch_of(record, self.rank))
        return Assignment(info, record.nprocs, record.offers)

    # --- what the agent asks between rounds ------------------------------------------------

    def gone(self, node_ids: Sequence[str]) -> Steps[list[str]]:
        """Those of ``node_ids`` that did not join the round this node last waited in."""
        round_ = self.node.view.last_joined
        if round_ is None:
            return []
        keys = self.keys
        count = yield from self._count(round_)
        names = [keys.of_round(round_, "node", i) for i in range(1, count + 1)]
        joined = {
            node.node_id
            for key, raw in zip(names, (yield from calls.get_many(names)), strict=True)
            if (node := generations.node_or_none(key, raw)) is not None
        }
        return [n for n in node_ids if n not in joined and n != self.node.node_id]

    def fail(self, reason: str) -> Steps[None]:
        record = json.dumps({"node": self.node.node_id, "reason": reason}).encode()
        with contextlib.suppress(StoreError):  # leaving tells the others it went, at least
            yield from calls.set_(self.keys.failed(), record)

    def request_new_round(self) -> Steps[None]:
        view = self.node.view
        if view.round is not None and view.record is not None:
            yield from advance(view.keys, view.round, len(view.record.node_ids))

    def exit_barrier(self, timeout: float) -> Steps[None]:
        """Wait, at most ``timeout`` s, until every member of this node's round finished.

        Each member writes its own mark (``done/<group rank>``, sealed in a sealed job),
        then counts itself; the count only says when to look: the member that finds every
        mark written says so for all (``done/all``). A count a stray added to makes a
        member look early, never pass early."""
        node = self.node
        view = node.publish(watch=None)  # finished nodes stop beating at different times
        round_, record, keys = view.round, view.record, view.keys
        if round_ is None or record is None or node.node_id not in record.node_ids:
            return
        size = len(record.node_ids)
        yield from calls.set_(
            keys.of_round(round_, "done", record.node_ids.index(node.node_id)), b"1"
        )
        count = yield from calls.add(keys.of_round(round_, "done"), 1)
        marks = [keys.of_round(round_, "done", rank) for rank in range(size)]
        passed = keys.of_round(round_, "done", "all")
        deadline = node.clock() + timeout
        slice_ = self.settings.heartbeat_timeout / 3
        while True:
            if count >= size and all(v is not None for v in (yield from calls.get_many(marks))):
                yield from calls.set_(passed, b"1")
                break
            if (yield from calls.wait([passed], min(slice_, max(0.0, deadline - node.clock())))):
                break
            if (yield from self.ended(round_)):
                # The others went on without this node (they took it for gone while it
                # finished): they will not pass this round's barrier; waiting is for nothing.
                logger.warning(
                    "exit barrier: the job went on to a later round without this node; "
                    "not waiting for the others"
                )
                return
            if node.clock() >= deadline:
                logger.warning("exit barrier: not every node finished within %.0f s", timeout)
                return
            count = yield from calls.add(keys.of_round(round_, "done"), 0)
        self.finished = round_


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


def watch_of(record: records.RoundRecord, rank: int) -> Watch | None:
    """The member the node of group rank ``rank`` watches: the next one, in a ring."""
    size = len(record.node_ids)
    if size < 2:
        return None
    neighbour = (rank + 1) % size
    return Watch(record.round, record.node_ids[neighbour], record.hosts[neighbour], size)


def _any_alive(node: NodeState, node_ids: Sequence[str]) -> Steps[bool]:
    for node_id in node_ids:
        if (yield from node.alive(node_id)):
            return True
    return False


def _int(value: int) -> bytes:
    return records.encode_int(value)


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

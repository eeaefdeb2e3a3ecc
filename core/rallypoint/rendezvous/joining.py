"""Joining a round: the protocol's steps from ``next_round`` to an ``Assignment``.

The layout of the keys is in ``rendezvous.protocol``. Every function here yields its store
calls (``rendezvous.calls``); the handler performs them on the real store, the simulation
on a simulated one.

A node joins the round after its last and either leads it (join number 1: ``leading``) or
waits for its leader's record, taking the leader's place when it is gone. How the job
moves from round to round, and how a node learns it moved on without it, is in
``rounds``; the exit barrier and a job's failure are in ``exits``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from rallypoint.errors import RallypointError
from rallypoint.events import RoundInfo
from rallypoint.extensions import RankAssigner
from rallypoint.interfaces import Assignment, RendezvousFailed, RendezvousTimeout
from rallypoint.rendezvous import calls, generations, readiness, records
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.exits import Exits
from rallypoint.rendezvous.generations import job_round
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.leading import Leader
from rallypoint.rendezvous.node import NodeState, Watch
from rallypoint.rendezvous.rounds import LeaderLost, RunChecks

# Re-exported: the heartbeat and the notices import them from here.
from rallypoint.rendezvous.rounds import advance as advance
from rallypoint.rendezvous.rounds import newer_generation as newer_generation
from rallypoint.rendezvous.world import Port

logger = logging.getLogger("rallypoint.rendezvous")


#: Reserve a port: the given one, or a free one (0); held until the next round
#: (``World.reserve_port``).
ReservePort = Callable[[int], Port]


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
        self.checks = RunChecks(node)
        self.leader = Leader(node, assigner, self.checks, master_addr)
        self.exits = Exits(node, self.checks)

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
                yield from self.exits.check_failed()  # a later round: did a node fail the job?
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
        """Move to the run's current generation if it left this node's behind
        (``RunChecks.follow_generation``); no round of the old one counts as finished."""
        moved = yield from self.checks.follow_generation()
        if moved:
            self.finished = None
        return moved

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
        if index > self.settings.most_joins:
            # No honest run takes this many numbers: a stray added to the count, and the
            # leader reads no record past the cap. Take a free number below it instead.
            index = yield from self._free_number(round_, encoded)
        else:
            yield from calls.set_(keys.of_round(round_, "node", index), encoded)
        if index == 1:
            return (yield from self.leader.lead(round_, deadline))
        return (yield from self._wait_closed(round_, deadline, index, encoded))

    def _free_number(self, round_: int, mine: bytes) -> Steps[int]:
        """The first join number of ``round_`` without a record, taken by writing this
        node's record there (compare-and-set: one node a number; in a sealed job, a
        stray's value there is replaced)."""
        for number in range(1, self.settings.most_joins + 1):
            key = self.keys.of_round(round_, "node", number)
            if (yield from calls.compare_set(key, None, mine)) == mine:
                return number
        raise RendezvousFailed(
            f"rendezvous round {round_}: every join number up to {self.settings.most_joins} "
            "is taken; a process that is not of this job keeps adding to its count"
        )

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
            if (yield from self.checks.ended(round_)):
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
                    return (yield from self.leader.lead(round_, deadline))
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
        count = yield from self.leader.count(round_)
        names = [keys.of_round(round_, "node", i) for i in range(1, count + 1)]
        joined = {
            node.node_id
            for key, raw in zip(names, (yield from calls.get_many(names)), strict=True)
            if (node := generations.node_or_none(key, raw)) is not None
        }
        return [n for n in node_ids if n not in joined and n != self.node.node_id]

    def fail(self, reason: str) -> Steps[None]:
        yield from self.exits.fail(reason)

    def request_new_round(self) -> Steps[None]:
        view = self.node.view
        if view.round is not None and view.record is not None:
            yield from advance(view.keys, view.round, len(view.record.node_ids))

    def exit_barrier(self, timeout: float) -> Steps[None]:
        """Wait, at most ``timeout`` s, until every member of this node's round finished
        (``Exits.exit_barrier``)."""
        passed = yield from self.exits.exit_barrier(timeout)
        if passed is not None:
            self.finished = passed


def watch_of(record: records.RoundRecord, rank: int) -> Watch | None:
    """The member the node of group rank ``rank`` watches: the next one, in a ring."""
    size = len(record.node_ids)
    if size < 2:
        return None
    neighbour = (rank + 1) % size
    return Watch(record.round, record.node_ids[neighbour], record.hosts[neighbour], size)

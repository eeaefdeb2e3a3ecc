"""What must hold in every schedule, checked as it runs and after its last fault.

Safety, always: the members of a round agree on it; it has MIN..MAX nodes; its group rank
0 holds its master port; no node trains long in a round the job has left; no two rounds
train side by side for longer than it takes to notice (a second job beside the running
one); a node passes the exit barrier only once every member finished; a node that gives
up says why in a sentence. Liveness, where the faults allow it: after the last fault every
live node trains in the job's round, and the job then finishes cleanly, leaving nothing
of the run in a store of its own.
"""

from __future__ import annotations

from rallypoint.interfaces import Assignment
from rallypoint.rendezvous import records
from rallypoint.rendezvous.heartbeat import WAKE_SLICE
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.signing import Seal, SignedStore
from rallypoint.testing.simulation.agent import MONITOR, SimAgent
from rallypoint.testing.simulation.stage import RUN_ID, TOKEN, Round, Stage


class Invariants:
    """The checks of one schedule; ``fail`` raises ``Violation``."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.schedule = stage.schedule
        self.rounds: dict[Round, records.RoundRecord] = {}
        self._ends: dict[Round, float] = {}  # round -> when the job left it
        self.epoch = 0  # the store's, when last looked
        self.generation = 0  # the run's current generation, as its markers say
        self._first = Keys(stage.schedule.settings.prefix, RUN_ID)
        self._side_by_side: float | None = None  # since when two rounds train at once
        self._forks: dict[Round, float] = {}  # rounds with two records -> since when
        self._reader: SignedStore | None = None  # how a sealed job reads, this check
        self._viewed = False  # whether its claim was found

    # --- reading the store as the job's nodes do -------------------------------------------

    def read(self, key: str) -> bytes | None:
        """``key``'s value as the job reads it: sealed values opened (with the attempt of
        the run's claim, looked up once per check: ``_reader``), a stray's unsealed ones
        absent."""
        data = self.stage.server.data
        if not self.schedule.token:
            return data.get(key)
        if self._reader is None or self._reader.store is not data:
            self._reader = SignedStore(data, Seal(TOKEN))
            self._viewed = self._reader.view(self._first.token_key)
        return self._reader.get(key) if self._viewed else None

    # --- as it runs ------------------------------------------------------------------------

    def assigned(self, agent: SimAgent, assignment: Assignment) -> None:
        """A node got a round: every member agrees on it; it has MIN..MAX nodes; its group
        rank 0 holds the round's master port."""
        info = assignment.info
        s = self.schedule.settings
        view = agent.state.view
        generation, record = view.keys.generation, view.record
        assert record is not None
        epoch = self.stage.server.epoch
        self.stage.log(f"{agent.node_id} in round {generation}/{info.round}: {info.members}")
        if not self.rounds and self.schedule.quiet_start():
            # Nodes that all start at once, with no fault yet, meet in one round: the
            # leader's last call waits for them.
            want = min(self.schedule.nodes, s.max_nodes)
            if len(record.node_ids) != want:
                self.fail(f"the first round formed with {len(record.node_ids)} nodes, not {want}")
        seen = self.rounds.setdefault((epoch, generation, info.round), record)
        if seen != record and self.schedule.stray_deletes:
            # A stray deleted the record after some members read it, and another leader
            # wrote another: no seal stops that. The members must see it and stop, in a
            # sentence (``check_split``), not train as two jobs.
            self._forks.setdefault((epoch, generation, info.round), self.stage.hub.now)
        elif seen != record:
            self.fail(
                f"round {generation}/{info.round}: {agent.node_id} has {record.node_ids}, "
                f"another member {seen.node_ids}"
            )
        size = len(info.members)
        if not s.min_nodes <= size <= s.max_nodes:
            self.fail(
                f"round {generation}/{info.round} formed with {size} nodes, outside {s.nnodes}"
            )
        if info.members[info.group_rank] != agent.node_id or info.group_world_size != size:
            self.fail(f"{agent.node_id} has group rank {info.group_rank} of {info.members}")
        holder = self.stage.ports.holder(agent.host, record.master_port)
        if info.group_rank == 0 and holder is not agent.world:
            # The workers of every member meet at group rank 0's port: it must be one that
            # node holds, which no other process on its host can have.
            self.fail(
                f"round {generation}/{info.round}: its master port {record.master_port} is "
                f"not held by {agent.node_id}, its group rank 0"
            )
        if len(set(info.members)) != size or info.world_size != sum(record.nprocs):
            self.fail(
                f"round {generation}/{info.round}: members {info.members}, world size "
                f"{info.world_size}"
            )

    def trains(self, agent: SimAgent) -> None:
        """A node's workers take a step: never in a round the job left long ago (a node
        woken from a freeze or back from a cut must notice first)."""
        if agent.training is None:
            return
        ended = self._ends.get(agent.training)
        if ended is None or self.schedule.stray_deletes:
            return  # a stray that deletes keys can hide a round's end: it is seen late
        since = max(ended, agent.world.frozen_until, self._reach_back(agent.index))
        bound = self.notice_bound()
        if self.stage.hub.now - since > bound:
            _, generation, round_ = agent.training
            self.fail(
                f"{agent.node_id} still trains in round {generation}/{round_} "
                f"{self.stage.hub.now - since:.1f} s after the job left it (bound {bound:.1f} s)"
            )

    def notice_bound(self) -> float:
        s = self.schedule
        ttl = s.settings.heartbeat_timeout
        slow = s.slow[2] if s.slow else 0.0
        # A beat, a wait slice, the agent's look, the calls of a beat and of the look
        # (up to 8, each there and back), and the longest backoff of a call retried
        # across an outage (Backoff: 2 s).
        return ttl / 3 + WAKE_SLICE + MONITOR + 16 * (s.latency + slow) + 2.0 + 1.0

    def _reach_back(self, index: int) -> float:
        """When the store was last out of this node's reach (0 if never yet)."""
        s, now = self.schedule, self.stage.hub.now
        spells = [s.outage] if s.outage else []
        spells += [(begin, end) for node, begin, end in s.cuts if node == index]
        spells += [s.loss] if s.loss else []
        spells += [(begin, end or now) for begin, end in self.stage.server.spells]
        return max((end for begin, end in spells if begin <= now), default=0.0)

    def passed(self, agent: SimAgent) -> None:
        """A node passed its round's exit barrier: only once every member wrote its mark
        (its workers finished), whatever the count says."""
        view = agent.state.view
        if agent.handler is None or agent.handler.joining.finished is None:
            return
        if view.record is None or view.round is None or self.stage.data_lost:
            return
        marks = [
            view.keys.of_round(view.round, "done", g) for g in range(len(view.record.node_ids))
        ]
        missing = [g for g, mark in enumerate(marks) if self.read(mark) is None]
        if missing:
            self.fail(
                f"{agent.node_id} passed the exit barrier before group ranks {missing} finished"
            )

    def check(self) -> None:
        """After an event that changed the store or what a node trains in: note when the
        rounds that nodes train in end (the protocol's own sign: the next round's ``open``
        key, or a newer generation of the run), and that no two rounds train for long
        side by side."""
        stage = self.stage
        if not stage.server.dirty:
            return
        stage.server.dirty = False
        self._reader = None  # the claim may have changed: look it up again
        first = self._first
        if stage.server.epoch != self.epoch:  # the store lost its data: a run begins again
            self.epoch, self.generation = stage.server.epoch, 0
        # The hint, then the markers after it (``generations.current``), as dict reads.
        raw = self.read(first.generation_key)
        generation = records.decode_int(first.generation_key, raw) if raw else 0
        while self.read(first.born(generation + 1)) is not None:
            generation += 1
        self.generation = max(self.generation, generation)
        for training in [t for t in stage.training if t not in self._ends]:
            epoch, generation_, round_ = training
            if epoch != self.epoch:
                continue  # its store lost it: nothing there says it ended (the split check)
            keys = first.at(generation_)
            if generation_ < generation or self.read(keys.of_round(round_ + 1, "open")):
                self._ends[training] = stage.hub.now
        current = [t for t in stage.training if t not in self._ends]
        if len(current) <= 1:
            self._side_by_side = None
        elif self._side_by_side is None:
            self._side_by_side = stage.hub.now

    def check_split(self) -> None:
        """No second job beside a running one: two rounds that train at once, neither
        known to the store as left, for longer than a node takes to notice; nor two
        records of one round."""
        now = self.stage.hub.now
        for fork, began in self._forks.items():
            groups = {
                a.state.view.record.node_ids
                for a in self.stage.agents
                if a.training == fork and a.state.view.record is not None
            }
            if len(groups) > 1 and now - began > self.notice_bound():
                self.fail(f"round {fork} trains as two jobs, {sorted(groups)}")
        since = self._side_by_side
        if since is None:
            return
        now = self.stage.hub.now
        bound = self.notice_bound() + self.schedule.settings.heartbeat_timeout
        if now - since <= bound:
            return
        # A node that the store was out of reach of lately cannot know yet: it trains on,
        # as it should, until retry_timeout; its round does not count here.
        rounds = {
            a.training
            for a in self.stage.agents
            if a.training is not None
            and a.training not in self._ends
            and now - self._reach_back(a.index) > bound
        }
        if len(rounds) > 1:
            self.fail(f"rounds {sorted(rounds)} have trained side by side for {now - since:.1f} s")

    def job_round(self) -> Round:
        """The newest round formed in the run's current generation."""
        formed = [r for e, g, r in self.rounds if (e, g) == (self.epoch, self.generation)]
        return self.epoch, self.generation, max(formed, default=-1)

    def fail(self, what: str) -> None:
        self.stage.fail(what)

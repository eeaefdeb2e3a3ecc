"""One schedule run to its end: the nodes started, the faults made, the invariants checked."""

from __future__ import annotations

import random
import sys
from functools import partial

from rallypoint.extensions import RankAssigner
from rallypoint.interfaces import StoreUnavailable
from rallypoint.rendezvous import protocol
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.records import RoundRecord
from rallypoint.testing.simulation.agent import SimAgent
from rallypoint.testing.simulation.hub import Hub
from rallypoint.testing.simulation.invariants import Invariants
from rallypoint.testing.simulation.schedule import Schedule
from rallypoint.testing.simulation.stage import RUN_ID, Round, Stage
from rallypoint.testing.simulation.store import Server
from rallypoint.testing.simulation.stray import Stray
from rallypoint.testing.simulation.world import Ports

#: Events at one instant past which a node is spinning (every real wait takes time).
SPIN = 50_000


class Simulation:
    """One schedule, run to its end; ``run`` raises ``Violation`` at the first broken
    invariant."""

    def __init__(self, schedule: Schedule, trace: bool = False) -> None:
        from rallypoint.builtins.rank_assigners import register_rank_assigners

        self.schedule = schedule
        self.rng = random.Random(schedule.seed ^ 0x5EED)
        self.trace = trace
        self.hub = Hub()
        server = Server(self.hub, self.rng, schedule.network, schedule.backend, self.log, trace)
        assigner: RankAssigner = register_rank_assigners()[0]
        self.stage = Stage(schedule, self.hub, Ports(), server, assigner, self.log)
        self.server = server
        self.generation = 0  # how many times every agent was killed and the job run again
        self.stray: Stray | None = None
        self.invariants = Invariants(self.stage)
        self.stage.observer = self.invariants

    @property
    def agents(self) -> list[SimAgent]:
        return self.stage.agents

    @property
    def events(self) -> int:
        return self.hub.events

    @property
    def rounds(self) -> dict[Round, RoundRecord]:
        return self.invariants.rounds

    def log(self, line: str) -> None:
        if self.trace:
            print(f"{self.hub.now:9.3f} {line}", file=sys.stderr)

    def fail(self, what: str) -> None:
        self.stage.fail(what)

    # --- the run ----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._plan()
            self._run_until(self.schedule.end)
            if self.check_settled():
                self.finish()
        finally:
            for agent in self.agents:  # no thread outlives its schedule
                agent.world.kill()
            if self.stray is not None:
                self.stray.world.kill()

    def _plan(self) -> None:
        s, at = self.schedule, self.hub.at
        for i in range(s.nodes):
            at(s.starts[i], partial(self._start, i))
        for node, when, length in s.freezes:
            at(when, partial(self._freeze, node, length))
        for node, when, back in s.crashes:
            at(when, partial(self._crash, node, back))
        for node, when in s.stops:
            at(when, partial(self._stop, node))
        for node, when in s.failures:
            at(when, partial(self._fail_workers, node, when))
        for node, when, seconds in s.steps:
            at(when, partial(self._step_clock, node, seconds))
        for node, begin, _ in s.cuts:
            at(begin, partial(self._reset, f"n{node} cut off from the store", node))
        if s.rerun is not None:
            at(s.rerun, self._rerun)
        if s.outage is not None:
            at(s.outage[0], partial(self._reset, "the store is unreachable", None))
        if s.loss is not None:
            at(s.loss[0], self._lose_data)
        if s.stray:
            self.stray = Stray(self.stage, s.stray, self.invariants.job_round)
            at(1.0, self.stray.start)
            at(s.quiet, self.stray.stop)
        at(s.end, lambda: None)

    def _run_until(self, end: float) -> None:
        hub, invariants = self.hub, self.invariants
        still, since = 0, hub.now  # events without time going on: a loop that never waits
        while (when := hub.next_at()) is not None and when <= end:
            hub.step()
            invariants.check()
            invariants.check_split()
            if hub.now > since:
                still, since = 0, hub.now
            elif (still := still + 1) > SPIN:
                self.fail(f"{SPIN} store calls and wake-ups without time passing: a busy loop")

    # --- the faults ---------------------------------------------------------------------------

    def _start(self, index: int, suffix: str = "") -> None:
        agent = SimAgent(self.stage, index, f"n{index}{suffix}")
        self.agents.append(agent)
        self.log(f"{agent.node_id} starts")
        agent.start()

    def _latest(self, index: int) -> SimAgent | None:
        for agent in reversed(self.agents):
            if agent.index == index:
                return agent if agent.alive else None
        return None

    def _freeze(self, index: int, length: float) -> None:
        if agent := self._latest(index):
            self.log(f"{agent.node_id} frozen for {length:g} s")
            agent.freeze(length)

    def _crash(self, index: int, back: float) -> None:
        if not (agent := self._latest(index)):
            return
        self.log(f"{agent.node_id} crashes; a new agent in {back:g} s")
        agent.crash()
        if self.schedule.backend == "c10d" and index == 0:
            self.stage.data_lost = True
        generation = self.generation
        again = sum(1 for a in self.agents if a.index == index)
        self.hub.at(
            self.hub.now + back,
            lambda: self._start(index, f"#{again}") if generation == self.generation else None,
        )

    def _stop(self, index: int) -> None:
        if agent := self._latest(index):
            self.log(f"{agent.node_id} stopped (SIGTERM)")
            agent.stop()
            if self.schedule.backend == "c10d" and index == 0:
                self.stage.data_lost = True  # the store ends with it

    def _fail_workers(self, index: int, when: float) -> None:
        if agent := self._latest(index):
            agent.fail_due.append(when)

    def _step_clock(self, index: int, seconds: float) -> None:
        if agent := self._latest(index):
            self.log(f"{agent.node_id}'s wall clock steps {seconds:+g} s")
            agent.world.wall_offset += seconds

    def _rerun(self) -> None:
        self.log("every agent killed; the job runs again under the same run id")
        for agent in self.agents:
            if agent.alive:
                agent.crash()
        self.generation += 1
        delay = self.rng.choice((0.5, 3.0, 10.0))
        for i in range(self.schedule.nodes):
            if not any(i == node for node, _ in self.schedule.stops):
                self.hub.at(
                    self.hub.now + delay + self.rng.uniform(0, 2), partial(self._start, i, "~")
                )

    def _reset(self, why: str, index: int | None) -> None:
        """The store out of reach (of every node, or of one): waits it held fail."""
        self.log(why)
        self.server.reset(StoreUnavailable(why), index)

    def _lose_data(self) -> None:
        self.stage.data_lost = True
        self.server.lose_data()

    # --- after the last fault -------------------------------------------------------------------

    def _may_give_up(self, agent: SimAgent) -> bool:
        """A store out of reach for longer than retry_timeout, or one that lost its data,
        is a reason; nothing else, here. Out of reach: unreachable, cut off, or so slow
        that a call in flight spans the gap between two such spells."""
        if self.stage.data_lost or self.schedule.stray_deletes:
            return True  # what cannot hold ends in a sentence (``SimAgent._ended``)
        s = self.schedule
        spells = [s.outage] if s.outage else []
        spells += [(b, e) for node, b, e in s.cuts if node == agent.index]
        slow = s.slow[2] if s.slow else 0.0
        reach = 2 * (s.latency + slow) + 2.0  # a call there and back, and a backoff
        longest, begin, end = 0.0, None, None
        for b, e in sorted(spells):
            if end is not None and b <= end + reach:
                end = max(end, e)
            else:
                begin, end = b, e
            assert begin is not None
            longest = max(longest, end - begin + reach)
        retry = s.settings.retry_timeout
        return longest >= retry and "retry_timeout" in (agent.gave_up or "")

    def check_settled(self) -> bool:
        """After the last fault, every live node is in the job's round (or waits while the
        job runs with MAX), no gone node is, and every node that gave up had cause;
        whether there is a round to finish."""
        s = self.schedule.settings
        for agent in self.agents:
            if agent.gave_up is not None and not self._may_give_up(agent):
                self.fail(f"{agent.node_id} gave up: {agent.gave_up}")
        if self.stage.data_lost or self.schedule.stray_deletes:
            return False  # what is left to hold: no split, and a sentence for each failure
        live = [a for a in self.agents if a.alive and a.gave_up is None]
        if len(live) < s.min_nodes:
            return False  # they wait for more nodes, until join_timeout
        job = self.invariants.job_round()
        _, generation, round_ = job
        current = self.invariants.rounds.get(job)
        members = set(current.node_ids) if current is not None else set()
        training = [a for a in live if a.training == job and a.node_id in members]
        want = min(len(live), s.max_nodes)
        quiet = self.schedule.end - self.schedule.quiet
        dead = members - {a.node_id for a in live}
        if dead:
            self.fail(
                f"{quiet:.0f} s after the last fault, the job's round {generation}/{round_} "
                f"still counts {sorted(dead)}, which are gone"
            )
        if len(training) < want:
            states = ", ".join(
                f"{a.node_id}: {'trains in ' + str(a.training) if a.training else 'joining'}"
                for a in live
            )
            self.fail(
                f"{quiet:.0f} s after the last fault, {len(training)} of {len(live)} live "
                f"nodes train in the job's round {generation}/{round_} (want {want}): {states}"
            )
        # A clean finish is checked where every live node is a member: one that waits
        # beside a job of MAX nodes would wait on after the job ended, until join_timeout.
        return bool(members) and len(training) == len(members) == len(live)

    def finish(self) -> None:
        """The job ends cleanly: every member of its round passes the exit barrier within
        its timeout and closes its rendezvous; then nothing of the run is left in a store
        of its own (etcd's, Redis's: the last to leave deletes the run)."""
        job = self.invariants.job_round()
        members = [a for a in self.agents if a.alive and a.training == job]
        s = self.schedule
        slow = s.slow[2] if s.slow else 0.0
        timeout = 2 * s.settings.heartbeat_timeout + 20 * (s.latency + slow) + 5
        self.log(f"the job finishes: {[a.node_id for a in members]}")
        # Workers end at different times (a stream of its own: the other draws stay as
        # they were): a member waits at the barrier for the others.
        ends = random.Random(f"finish {s.seed}")
        for agent in members:
            agent.finish(self.hub.now + ends.uniform(0, 3), timeout)
        bound = 3 + timeout + protocol.LEAVE_GRACE + 30 * (s.latency + slow) + 10
        self._run_until(self.hub.now + bound)
        for agent in members:
            if not agent.finished:
                self.fail(f"{agent.node_id} has not finished {timeout:.0f} s after its workers")
        if s.backend == "c10d":
            return  # the store ended with its host
        keys = Keys(s.settings.prefix, RUN_ID)
        left = [key for key in self.server.kept_keys() if key.startswith(keys.prefixes)]
        if left:
            self.fail(f"after a clean finish {len(left)} keys of the run are left: {left[:5]}")

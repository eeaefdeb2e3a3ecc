"""The rendezvous protocol under deterministic simulation: seeded schedules of faults.

N simulated agents run the protocol's own steps (``rendezvous.joining``,
``rendezvous.heartbeat``, ``rendezvous.generations``: the code the handler runs) on one
``MemoryStore`` whose clock is the simulation's, with no thread and no sleep: every store
call and every wait of every agent is an event in one queue, ordered by simulated time,
and everything random (the order of concurrent calls, latencies, faults) is drawn from
one seed. A schedule replays exactly from its seed::

    python -m rallypoint.testing.simulation --seed 1234 --trace

Faults drawn per schedule: store latency; lost responses (a write applied, its reply
lost, so the protocol's retry applies it again: a join counted twice); a store outage
and its return; an agent frozen (as by SIGSTOP) and woken; an agent crashed (SIGKILL)
and started again; an agent stopped on purpose (SIGTERM: it gives the round notice,
``rendezvous.notices``, and leaves); nodes arriving late, which get ready beside the
running job for a while first (``rendezvous.readiness``);
every agent killed, then the job run again under the same run id; one agent's clock fast
or slow. After every event the invariants (``Invariants``) are checked.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import itertools
import logging
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rallypoint.errors import RallypointError
from rallypoint.extensions import NodeSpec, RankAssigner
from rallypoint.interfaces import Assignment, StoreError, StoreUnavailable
from rallypoint.rendezvous import calls, notices, protocol, records
from rallypoint.rendezvous.calls import Call, Steps
from rallypoint.rendezvous.heartbeat import WAKE_SLICE, Heartbeat
from rallypoint.rendezvous.joining import Joining
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.memory_store import MemoryStore
from rallypoint.rendezvous.node import NodeState
from rallypoint.rendezvous.retrying import Backoff
from rallypoint.rendezvous.settings import Settings

RUN_ID = "sim"
#: How often a simulated agent looks at its round while its workers train (the agent's
#: monitor interval).
MONITOR = 0.5
#: Calls that change the store: a lost reply to one of them leaves the change made.
WRITES = frozenset({"set", "add", "add_and_get", "compare_set", "delete_prefix"})


class Violation(AssertionError):
    """An invariant failed; the message says which, when, and how to replay it."""


@dataclass
class Schedule:
    """One seed's job and faults, all drawn in ``Schedule.draw``."""

    seed: int
    settings: Settings
    nodes: int
    starts: list[float]  # when each node's agent starts (late arrivals)
    latency: float  # the longest store latency, each way
    lose: float  # the chance that a write's reply is lost
    outage: tuple[float, float] | None  # the store unreachable from, until
    freezes: list[tuple[int, float, float]]  # node, at, for
    crashes: list[tuple[int, float, float]]  # node, at, back after (a new agent)
    stops: list[tuple[int, float]]  # node, at: SIGTERM, it leaves for good
    failures: list[tuple[int, float]]  # node, at: its workers fail, it asks a new round
    rerun: float | None  # every agent killed at, then all started again
    skews: dict[int, float]  # node -> its clock's rate
    ready: dict[int, float]  # node -> seconds it takes to get ready beside a running job
    quiet: float  # when the last fault is over
    end: float  # when the schedule is checked for the last time
    most: int | None = None  # drawn as a job of up to this many nodes (--nodes)

    @classmethod
    def draw(cls, seed: int, most: int | None = None) -> Schedule:
        """Seed ``seed``'s schedule; ``most``: a job of up to that many nodes (the usual
        few where None; the draws of a given ``most`` stay the same)."""
        rng = random.Random(seed)
        settings, nodes = _job(rng) if most is None else _large_job(random.Random(seed), most)
        low, ttl = settings.min_nodes, settings.heartbeat_timeout
        horizon = 120.0
        # Nodes started together (a job's launch) within a second (its own stream: the
        # other draws stay as they were), the others late.
        jitter = random.Random(f"starts {seed}")
        starts = [
            jitter.uniform(0, 1) if i < low or rng.random() < 0.5 else rng.uniform(0, 60)
            for i in range(nodes)
        ]
        rate = rng.random()
        latency = rng.choice((0.0, 0.005, 0.05, 0.2)) if rate < 0.8 else 0.0
        lose = rng.choice((0.0, 0.01, 0.05)) if rng.random() < 0.4 else 0.0
        outage = None
        if rng.random() < 0.25:
            begin = rng.uniform(5, horizon - 40)
            outage = (begin, begin + rng.choice((1.0, ttl * 1.5, 10.0, 70.0)))
        freezes = [
            (rng.randrange(nodes), rng.uniform(5, horizon - 30), rng.choice((0.5, ttl / 2, ttl * 2, 20.0)))
            for _ in range(rng.choice((0, 0, 1, 2)))
        ]  # fmt: skip
        crashes = [
            (rng.randrange(nodes), rng.uniform(5, horizon - 30), rng.choice((0.5, ttl, 15.0)))
            for _ in range(rng.choice((0, 0, 1, 2)))
        ]
        stops = (
            [(rng.randrange(nodes), rng.uniform(5, horizon - 30))] if rng.random() < 0.15 else []
        )
        failures = [
            (rng.randrange(nodes), rng.uniform(5, horizon - 30))
            for _ in range(rng.choice((0, 0, 1, 3)))
        ]
        rerun = rng.uniform(20, horizon - 30) if rng.random() < 0.15 else None
        skews = {rng.randrange(nodes): rng.uniform(0.8, 1.25)} if rng.random() < 0.3 else {}
        # Drawn from a stream of its own: the other draws stay as they were.
        getting = random.Random(f"ready {seed}")
        ready = {i: getting.choice((0.0, 0.5, 3.0, 10.0)) for i in range(nodes)}
        ends = [horizon]
        if outage:
            ends.append(outage[1])
        ends += [at + d for _, at, d in freezes] + [at + d for _, at, d in crashes]
        quiet = max(ends)
        # Time enough after the last fault for every live node to be in one round: a dead
        # member lapses (ttl), its neighbour sees it (ttl / 3), the survivors wait out the
        # last call, join numbers without a record are waited for (close_timeout, twice).
        settle = 2 * ttl + settings.last_call_timeout + 2 * settings.close_timeout
        end = quiet + settle + 30 * latency + 20 + max(ready.values())
        return cls(
            seed, settings, nodes, starts, latency, lose, outage, freezes, crashes, stops,
            failures, rerun, skews, ready, quiet, end, most,
        )  # fmt: skip

    @property
    def nodes_flag(self) -> str:
        """The ``--nodes`` that draws this schedule again (none for the usual few)."""
        return "" if self.most is None else f" --nodes {self.most}"

    def quiet_start(self) -> bool:
        """Whether every node starts at once, and no fault comes before the first round
        can form (its last call, with room for the store's latency)."""
        s = self.settings
        formed = s.last_call_timeout + s.close_timeout + 40 * self.latency + 1
        faults = [at for _, at, _ in self.freezes] + [at for _, at, _ in self.crashes]
        faults += [at for _, at in self.stops] + [at for _, at in self.failures]
        faults += [self.outage[0]] if self.outage else []
        faults += [self.rerun] if self.rerun is not None else []
        together = all(start <= 1 for start in self.starts)
        return together and not self.lose and min(faults, default=1e9) > formed

    def describe(self) -> str:
        s = self.settings
        parts = [
            f"seed {self.seed}: {self.nodes} nodes, --nnodes {s.nnodes}, ttl {s.heartbeat_timeout:g} s",
            f"latency {self.latency:g} s" if self.latency else "",
            f"lost replies {self.lose:.0%}" if self.lose else "",
            f"outage {self.outage[0]:.1f}-{self.outage[1]:.1f} s" if self.outage else "",
            f"freezes {self.freezes}" if self.freezes else "",
            f"crashes {self.crashes}" if self.crashes else "",
            f"stops {self.stops}" if self.stops else "",
            f"worker failures {self.failures}" if self.failures else "",
            f"rerun at {self.rerun:.1f} s" if self.rerun else "",
            f"skews {self.skews}" if self.skews else "",
        ]
        return ", ".join(p for p in parts if p)


def _job(rng: random.Random) -> tuple[Settings, int]:
    """A job's size and settings: timeouts short enough for many schedules a second."""
    low = rng.choice((1, 2, 2, 3))
    high = rng.choice(range(low, 5))
    nodes = rng.randint(max(low, 2), high + 1)
    ttl = rng.choice((3.0, 6.0))
    settings = Settings(
        min_nodes=low,
        max_nodes=high,
        join_timeout=100_000.0,  # no join gives up within a schedule, but for cause
        last_call_timeout=rng.choice((3.0, 5.0)),
        close_timeout=2.0,
        heartbeat_timeout=ttl,
        retry_timeout=rng.choice((20.0, 60.0)),
        ready_timeout=100_000.0,  # likewise: a node gets ready within the drawn time
        prefix="/rallypoint",
    )
    return settings, nodes


def _large_job(rng: random.Random, most: int) -> tuple[Settings, int]:
    """A job of up to ``most`` nodes: at least half of them needed, the rest may come."""
    high = rng.randint(max(2, most // 2), most)
    low = rng.randint(max(1, high // 2), high)
    settings, _ = _job(rng)
    return Settings(
        min_nodes=low,
        max_nodes=high,
        join_timeout=settings.join_timeout,
        last_call_timeout=settings.last_call_timeout,
        close_timeout=settings.close_timeout,
        heartbeat_timeout=settings.heartbeat_timeout,
        retry_timeout=settings.retry_timeout,
        ready_timeout=settings.ready_timeout,
        prefix=settings.prefix,
    ), rng.randint(low, most)


@dataclass
class _Port:
    """A master port an agent holds on its host, as ``PortReservation`` does with a
    socket: until ``release``, or until its process dies."""

    port: int
    host: str
    sim: Simulation

    def release(self) -> None:
        self.sim.held.get(self.host, {}).pop(self.port, None)


@dataclass
class Actor:
    """One strand of a simulated agent (its joining, or its heartbeat): the steps it runs
    and the call it waits on."""

    name: str
    agent: SimAgent
    store: MemoryStore
    steps: Steps[Any]
    done: Callable[[Any, BaseException | None], None]
    dead: bool = False
    call: Call | None = None
    deadline: float = 0.0  # a wait's end (simulated time)
    backoff: Backoff | None = None
    waiting: bool = False


@dataclass
class SimAgent:
    """One agent process: its node's state, joining and heartbeat, and what it did."""

    index: int
    node_id: str
    sim: Simulation
    rate: float = 1.0
    frozen_until: float = 0.0
    alive: bool = True  # False once crashed or stopped
    gave_up: str | None = None
    training: tuple[int, int] | None = None  # (generation, round) its workers run in
    fail_due: list[float] = field(default_factory=list)
    actors: list[Actor] = field(default_factory=list)
    heartbeat_stopped: bool = False
    finishing: bool = False

    def trains_in(self, training: tuple[int, int] | None) -> None:
        """Its workers now run in ``training`` (None: none run), counted by the simulation
        so that its checks after each event look at each round once, not at each node."""
        if training == self.training:
            return
        counts = self.sim.training
        if self.training is not None:
            counts[self.training] -= 1
            if not counts[self.training]:
                del counts[self.training]
        if training is not None:
            counts[training] += 1
        self.training = training
        self.sim.dirty = True

    def __post_init__(self) -> None:
        sim = self.sim
        born = sim.now
        self.state = NodeState(
            NodeSpec(self.node_id, host=f"h{self.index}"),
            1,
            sim.schedule.settings,
            Keys(sim.schedule.settings.prefix, RUN_ID),
            lambda: born + (sim.now - born) * self.rate,
        )
        # A node that comes to a running job gets ready beside it first (its agent's
        # preloaded interpreter, a checkpoint fetched): for ``ready_in`` simulated seconds.
        ready_in = sim.schedule.ready.get(self.index, 0.0)
        self.joining = Joining(
            self.state,
            sim.assigner,
            lambda port: sim.reserve(self, port),
            ready=lambda _offers: "importing" if sim.now < born + ready_in else None,
        )
        self.conn = sim.store.clone()
        self.beat_conn = sim.store.clone()

    def start(self) -> None:
        self.sim.spawn(self, "agent", self.conn, self._run(), self._ended)

    def _run(self) -> Steps[None]:
        while True:
            assignment = yield from self.joining.next_round(self._start_heartbeat)
            self._wake_heartbeat()
            self.sim.assigned(self, assignment)
            view = self.state.view
            self.trains_in((view.keys.generation, assignment.info.round))
            while True:
                yield from calls.pause(MONITOR)
                if self.state.heartbeat_failed is not None:
                    raise self.state.heartbeat_failed
                self.sim.trains(self)
                if self.state.round_ended():
                    break
                if self.fail_due and self.fail_due[0] <= self.sim.now:
                    self.fail_due.pop(0)
                    yield from self.joining.request_new_round()
                    break
            self.trains_in(None)

    def _ended(self, _: Any, error: BaseException | None) -> None:
        self._wake_heartbeat()
        self.trains_in(None)
        if error is None:
            return
        if isinstance(error, RallypointError) and str(error).strip():
            self.gave_up = f"{type(error).__name__}: {error}"
            self.sim.log(f"{self.node_id} gives up: {self.gave_up}")
            return
        raise Violation(f"{self.node_id} failed without a sentence: {error!r}") from error

    def _start_heartbeat(self) -> None:
        key = self.state.view.keys.heartbeat(self.node_id)
        self.beat_conn.keep_alive(key, self.sim.schedule.settings.heartbeat_timeout)
        self.state.renewed()
        beat = Heartbeat(self.state)
        self.sim.spawn(self, "heartbeat", self.beat_conn, beat.run(self._stopped), self._beat_ended)

    def _stopped(self) -> bool:
        return self.heartbeat_stopped

    def _beat_ended(self, _: Any, error: BaseException | None) -> None:
        if isinstance(error, StoreError):
            self.state.heartbeat_failed = error
        elif error is not None:
            raise Violation(f"{self.node_id}'s heartbeat failed: {error!r}") from error

    def _wake_heartbeat(self) -> None:
        for actor in self.actors:
            if (
                actor.name == "heartbeat"
                and actor.call is not None
                and actor.call.method == "pause"
            ):
                self.sim.wake(actor)

    @property
    def host(self) -> str:
        return f"h{self.index}"

    def crash(self) -> None:
        """SIGKILL: nothing more runs, nothing is closed; its liveness lapses, and the
        ports it held are free (its sockets die with it)."""
        self.alive = False
        self.trains_in(None)
        for actor in self.actors:
            actor.dead = True
        self.sim.release_ports(self)

    def finish(self, timeout: float) -> None:
        """Its workers finished: as the agent, it passes the exit barrier (still beating),
        then closes its rendezvous: the heartbeat stops, then it leaves."""
        for actor in self.actors:
            if actor.name == "agent":
                actor.dead = True
        self.finishing = True

        def finished(_: Any, error: BaseException | None) -> None:
            self.finishing = False
            self.alive = False
            if error is not None:
                raise Violation(f"{self.node_id} failed to finish: {error!r}") from error

        self.sim.spawn(self, "finish", self.conn, self._finish(timeout), finished)

    def _finish(self, timeout: float) -> Steps[None]:
        yield from self.joining.exit_barrier(timeout)
        self.sim.passed(self)
        self.heartbeat_stopped = True  # StoreRendezvous.close: heartbeats stop first
        for actor in self.actors:
            if actor.name == "heartbeat":
                actor.dead = True
        yield from protocol.leave(self.joining, None)  # a store of its own: keeps what is left

    def stop(self) -> None:
        """SIGTERM: it stops its heartbeat, leaves, and closes its connections."""
        self.alive = False
        self.trains_in(None)
        self.heartbeat_stopped = True
        for actor in self.actors:
            actor.dead = True
        self.beat_conn.close()

        def closed(_: Any, error: BaseException | None) -> None:
            self.conn.close()

        self.sim.spawn(self, "leave", self.conn, self._leave(), closed)

    def _leave(self) -> Steps[None]:
        """As the agent told to stop: notice to the round (its workers save), then leave."""
        yield from notices.give(self.state, 0)
        yield from protocol.leave(self.joining, None)


class Simulation:
    """One schedule, run to its end; ``run`` raises ``Violation`` at the first broken
    invariant."""

    def __init__(self, schedule: Schedule, trace: bool = False) -> None:
        self.schedule = schedule
        self.rng = random.Random(schedule.seed ^ 0x5EED)
        self.now = 0.0
        self.trace = trace
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.store = MemoryStore(clock=lambda: self.now)
        self.agents: list[SimAgent] = []
        self.rounds: dict[tuple[int, int], records.RoundRecord] = {}
        self._waiters: list[Actor] = []
        self._generation = 0  # how many times every agent was killed and the job run again
        self.events = 0
        self._ends: dict[tuple[int, int], float] = {}  # round -> when the job left it
        self._generation_seen = 0  # the run's current generation
        self.held: dict[str, dict[int, SimAgent]] = {}  # host -> port -> the agent holding it
        self.training: collections.Counter[tuple[int, int]] = collections.Counter()
        self.dirty = True  # the store or what nodes train in changed since the last check
        self._first = Keys(schedule.settings.prefix, RUN_ID)
        self._next_port: dict[str, int] = {}
        from rallypoint.builtins.rank_assigners import register_rank_assigners

        self.assigner: RankAssigner = register_rank_assigners()[0]

    # --- the event queue ------------------------------------------------------------------

    def at(self, when: float, what: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (when, next(self._seq), what))

    def log(self, line: str) -> None:
        if self.trace:
            print(f"{self.now:9.3f} {line}", file=sys.stderr)

    def run(self) -> None:
        s = self.schedule
        for i in range(s.nodes):
            self.at(s.starts[i], partial(self._start, i))
        for node, when, length in s.freezes:
            self.at(when, partial(self._freeze, node, length))
        for node, when, back in s.crashes:
            self.at(when, partial(self._crash, node, back))
        for node, when in s.stops:
            self.at(when, partial(self._stop, node))
        for node, when in s.failures:
            self.at(when, partial(self._fail_workers, node, when))
        if s.rerun is not None:
            self.at(s.rerun, self._rerun)
        if s.outage is not None:
            self.at(s.outage[0], self._outage_begins)
        self.at(s.end, lambda: None)
        self._run_until(s.end)
        if self.check_settled():
            self.finish()

    def _run_until(self, end: float) -> None:
        while self._queue:
            when, _, what = self._queue[0]
            if when > end:
                break
            heapq.heappop(self._queue)
            self.now = max(self.now, when)
            what()
            self.events += 1
            self.check()

    # --- agents ---------------------------------------------------------------------------

    def _start(self, index: int, suffix: str = "") -> None:
        name = f"n{index}{suffix}"
        agent = SimAgent(index, name, self, rate=self.schedule.skews.get(index, 1.0))
        self.agents.append(agent)
        self.log(f"{name} starts")
        agent.start()

    def _latest(self, index: int) -> SimAgent | None:
        for agent in reversed(self.agents):
            if agent.index == index:
                return agent
        return None

    def _freeze(self, index: int, length: float) -> None:
        agent = self._latest(index)
        if agent is not None and agent.alive:
            self.log(f"{agent.node_id} frozen for {length:g} s")
            agent.frozen_until = max(agent.frozen_until, self.now + length)

    def _crash(self, index: int, back: float) -> None:
        agent = self._latest(index)
        if agent is None or not agent.alive:
            return
        self.log(f"{agent.node_id} crashes; a new agent in {back:g} s")
        agent.crash()
        generation = self._generation
        again = sum(1 for a in self.agents if a.index == index)
        self.at(
            self.now + back,
            lambda: self._start(index, f"#{again}") if generation == self._generation else None,
        )

    def _stop(self, index: int) -> None:
        agent = self._latest(index)
        if agent is not None and agent.alive:
            self.log(f"{agent.node_id} stopped (SIGTERM)")
            agent.stop()

    def _fail_workers(self, index: int, when: float) -> None:
        agent = self._latest(index)
        if agent is not None and agent.alive:
            agent.fail_due.append(when)

    def _rerun(self) -> None:
        self.log("every agent killed; the job runs again under the same run id")
        for agent in self.agents:
            if agent.alive:
                agent.crash()
        self._generation += 1
        delay = self.rng.choice((0.5, 3.0, 10.0))
        for i in range(self.schedule.nodes):
            if not any(i == node for node, _ in self.schedule.stops):
                self.at(self.now + delay + self.rng.uniform(0, 2), partial(self._start, i, "~"))

    def _outage_begins(self) -> None:
        self.log("the store is unreachable")
        for actor in list(self._waiters):  # a blocked wait fails with the connection
            self._waiters.remove(actor)
            self._deliver(actor, None, StoreUnavailable("simulated outage"), 0.0)

    def _outage(self) -> bool:
        outage = self.schedule.outage
        return outage is not None and outage[0] <= self.now < outage[1]

    # --- the hosts' ports -------------------------------------------------------------------

    def reserve(self, agent: SimAgent, port: int) -> _Port:
        """A port on ``agent``'s host, as binding a socket gives one: ``port``, or a free
        one (0); a port another holds cannot be had (EADDRINUSE)."""
        held = self.held.setdefault(agent.host, {})
        if not port:
            port = self._next_port.get(agent.host, 29500)
            while port in held:
                port += 1
            self._next_port[agent.host] = port + 1
        elif port in held:
            raise OSError(98, "Address already in use")
        held[port] = agent
        return _Port(port, agent.host, self)

    def release_ports(self, agent: SimAgent) -> None:
        held = self.held.get(agent.host, {})
        for port in [port for port, holder in held.items() if holder is agent]:
            del held[port]

    # --- running steps --------------------------------------------------------------------

    def spawn(
        self,
        agent: SimAgent,
        name: str,
        store: MemoryStore,
        steps: Steps[Any],
        done: Callable[[Any, BaseException | None], None],
    ) -> None:
        actor = Actor(name, agent, store, steps, done)
        agent.actors.append(actor)
        self.at(self.now, lambda: self._resume(actor, None, None))

    def _resume(self, actor: Actor, value: Any, error: BaseException | None) -> None:
        if actor.dead:
            return
        agent = actor.agent
        if self.now < agent.frozen_until:  # SIGSTOP: it runs on when woken
            self.at(agent.frozen_until, lambda: self._resume(actor, value, error))
            return
        actor.call = None
        try:
            call = actor.steps.send(value) if error is None else actor.steps.throw(error)
        except StopIteration as stop:
            actor.dead = True
            actor.done(stop.value, None)
            return
        except Violation:
            raise
        except Exception as raised:
            actor.dead = True
            actor.done(None, raised)
            return
        actor.call = call
        actor.backoff = None
        actor.deadline = self.now + self._seconds(agent, call)
        self._issue(actor)

    def _seconds(self, agent: SimAgent, call: Call) -> float:
        """A wait's or pause's length in simulated time: the agent's clock may run fast
        or slow."""
        if call.method in ("wait", "wait_value", "pause"):
            return float(call.args[-1]) / agent.rate
        return 0.0

    def _latency(self) -> float:
        return self.rng.uniform(0, self.schedule.latency) if self.schedule.latency else 0.0

    def _issue(self, actor: Actor) -> None:
        call = actor.call
        assert call is not None
        if call.method == "pause":
            actor.waiting = True
            deadline = actor.deadline
            self.at(deadline, lambda: self._pause_over(actor, deadline))
            return
        self.at(self.now + self._latency(), lambda: self._apply(actor))

    def _pause_over(self, actor: Actor, deadline: float) -> None:
        if actor.waiting and actor.call is not None and actor.deadline == deadline:
            actor.waiting = False
            self._resume(actor, None, None)

    def wake(self, actor: Actor) -> None:
        if actor.waiting and actor.call is not None and actor.call.method == "pause":
            actor.waiting = False
            actor.deadline = -1.0
            self.at(self.now, lambda: self._resume(actor, None, None))

    def _apply(self, actor: Actor) -> None:
        """The call reaches the store."""
        if actor.dead:
            return
        call = actor.call
        assert call is not None
        if self._outage():
            self._deliver(actor, None, StoreUnavailable("simulated outage"), self._latency())
            return
        if call.method in ("wait", "wait_value"):
            if self._wait_done(actor):
                return
            self._waiters.append(actor)
            deadline = actor.deadline
            self.at(deadline, lambda: self._wait_over(actor, deadline))
            return
        result = getattr(actor.store, call.method)(*call.args)
        self.dirty = self.dirty or call.method in WRITES
        self.log(
            f"{actor.agent.node_id}/{actor.name} {call.method}{_short(call.args)} -> {_short(result)}"
        )
        self._changed()
        if call.method in WRITES and self.schedule.lose and self.rng.random() < self.schedule.lose:
            self.log(f"{actor.agent.node_id}/{actor.name}: reply lost")
            self._deliver(actor, None, StoreUnavailable("simulated lost reply"), self._latency())
            return
        self._deliver(actor, result, None, self._latency())

    def _wait_done(self, actor: Actor) -> bool:
        call = actor.call
        assert call is not None
        if call.method == "wait":
            found = all(v is not None for v in actor.store.get_many(call.args[0]))
            if found:
                self._deliver(actor, True, None, self._latency())
            return found
        value = actor.store.get(call.args[0])
        if value is not None:
            self._deliver(actor, value, None, self._latency())
        return value is not None

    def _wait_over(self, actor: Actor, deadline: float) -> None:
        if actor in self._waiters and actor.deadline == deadline:
            self._waiters.remove(actor)
            call = actor.call
            assert call is not None
            self._deliver(actor, False if call.method == "wait" else None, None, 0.0)

    def _changed(self) -> None:
        for actor in list(self._waiters):
            if self._wait_done(actor):
                self._waiters.remove(actor)

    def _deliver(self, actor: Actor, value: Any, error: BaseException | None, after: float) -> None:
        """The reply reaches the agent ``after`` seconds from now. An unreachable store is
        retried as ``RetryingStore`` does (``Backoff``), on the agent's clock."""
        call = actor.call
        assert call is not None
        if isinstance(error, StoreUnavailable):
            if actor.backoff is None:
                actor.backoff = Backoff(self.schedule.settings.retry_timeout)
            try:
                delay = actor.backoff.failed(actor.agent.state.clock(), error)
            except StoreError as given_up:
                failure: StoreError = given_up
                self.at(self.now + after, lambda: self._resume(actor, None, failure))
                return
            self.at(self.now + after + delay / actor.agent.rate, lambda: self._issue(actor))
            return
        self.at(self.now + after, lambda: self._resume(actor, value, error))

    # --- the invariants -------------------------------------------------------------------

    def assigned(self, agent: SimAgent, assignment: Assignment) -> None:
        """A node got a round: every member agrees on it; it has MIN..MAX nodes."""
        info = assignment.info
        s = self.schedule.settings
        generation = agent.state.view.keys.generation
        record = agent.state.view.record
        assert record is not None
        self.log(f"{agent.node_id} in round {generation}/{info.round}: {info.members}")
        if not self.rounds and self.schedule.quiet_start():
            # Nodes that all start at once, with no fault yet, meet in one round: the
            # leader's last call waits for them.
            want = min(self.schedule.nodes, s.max_nodes)
            if len(record.node_ids) != want:
                self.fail(f"the first round formed with {len(record.node_ids)} nodes, not {want}")
        seen = self.rounds.setdefault((generation, info.round), record)
        if seen != record:
            self.fail(
                f"round {generation}/{info.round}: {agent.node_id} has {record.node_ids}, another member {seen.node_ids}"
            )
        size = len(info.members)
        if not s.min_nodes <= size <= s.max_nodes:
            self.fail(
                f"round {generation}/{info.round} formed with {size} nodes, outside {s.nnodes}"
            )
        if info.members[info.group_rank] != agent.node_id or info.group_world_size != size:
            self.fail(f"{agent.node_id} has group rank {info.group_rank} of {info.members}")
        if (
            info.group_rank == 0
            and self.held.get(agent.host, {}).get(record.master_port) is not agent
        ):
            # The workers of every member meet at group rank 0's port: it must be one that
            # node holds, which no other process on its host can have.
            self.fail(
                f"round {generation}/{info.round}: its master port {record.master_port} is "
                f"not held by {agent.node_id}, its group rank 0"
            )
        if len(set(info.members)) != size or info.world_size != sum(record.nprocs):
            self.fail(
                f"round {generation}/{info.round}: members {info.members}, world size {info.world_size}"
            )

    def trains(self, agent: SimAgent) -> None:
        """A node's workers take a step: never in a round the job left long ago (a node
        woken from a freeze must notice first), nor at a world size that is not its round's."""
        if agent.training is None:
            return
        generation, round_ = agent.training
        ended = self._ends.get(agent.training)
        if ended is None:
            return
        since = max(ended, agent.frozen_until, self._outage_end())
        bound = self._notice_bound()
        if self.now - since > bound:
            self.fail(
                f"{agent.node_id} still trains in round {generation}/{round_} "
                f"{self.now - since:.1f} s after the job left it (bound {bound:.1f} s)"
            )

    def _notice_bound(self) -> float:
        s = self.schedule
        ttl = s.settings.heartbeat_timeout
        # A beat, a wait slice, the agent's look, a few calls' latency, and the longest
        # backoff of a call retried across an outage (Backoff: 2 s).
        return ttl / 3 + WAKE_SLICE + MONITOR + 10 * s.latency + 2.0 + 1.0

    def _outage_end(self) -> float:
        outage = self.schedule.outage
        return outage[1] if outage is not None and outage[0] <= self.now else 0.0

    def check(self) -> None:
        """After every event that changed the store or what a node trains in: note when
        the rounds that nodes train in end (the protocol's own sign: the next round's
        ``open`` key, or a newer generation of the run)."""
        if not self.dirty:
            return
        self.dirty = False
        first = self._first
        # The hint, then the markers after it (``generations.current``), as dict reads.
        raw = self.store.get(first.generation_key)
        generation = records.decode_int(first.generation_key, raw) if raw else 0
        while self.store.get(first.born(generation + 1)) is not None:
            generation += 1
        self._generation_seen = generation
        for training in [t for t in self.training if t not in self._ends]:
            keys = first.at(training[0])
            if training[0] < generation or self.store.get(keys.of_round(training[1] + 1, "open")):
                self._ends[training] = self.now

    def job_round(self) -> tuple[int, int]:
        """The newest round formed in the run's current generation."""
        generation = self._generation_seen
        formed = [r for g, r in self.rounds if g == generation]
        return generation, max(formed, default=-1)

    def check_settled(self) -> bool:
        """After the last fault, every live node is in the job's round (or waits while the
        job runs with MAX), no gone node is, and every node that gave up had cause;
        whether there is a round to finish."""
        s = self.schedule.settings
        live = [a for a in self.agents if a.alive and a.gave_up is None]
        for agent in self.agents:
            if agent.gave_up is not None and not self._may_give_up(agent):
                self.fail(f"{agent.node_id} gave up: {agent.gave_up}")
        if len(live) < s.min_nodes:
            return False  # they wait for more nodes, until join_timeout
        generation, round_ = self.job_round()
        current = self.rounds.get((generation, round_))
        members = set(current.node_ids) if current is not None else set()
        training = [a for a in live if a.training == (generation, round_) and a.node_id in members]
        want = min(len(live), s.max_nodes)
        dead = members - {a.node_id for a in live}
        if dead:
            self.fail(
                f"{self.schedule.end - self.schedule.quiet:.0f} s after the last fault, the "
                f"job's round {generation}/{round_} still counts {sorted(dead)}, which are gone"
            )
        if len(training) < want:
            states = ", ".join(
                f"{a.node_id}: {'trains in ' + str(a.training) if a.training else 'joining'}"
                for a in live
            )
            self.fail(
                f"{self.schedule.end - self.schedule.quiet:.0f} s after the last fault, "
                f"{len(training)} of {len(live)} live nodes train in the job's round "
                f"{generation}/{round_} (want {want}): {states}"
            )
        # A clean finish is checked where every live node is a member: one that waits
        # beside a job of MAX nodes would wait on after the job ended, until join_timeout.
        return bool(members) and len(training) == len(members) == len(live)

    def passed(self, agent: SimAgent) -> None:
        """A node passed its round's exit barrier: only once every member wrote its mark
        (its workers finished), whatever the count says."""
        view = agent.state.view
        if agent.joining.finished is None or view.record is None or view.round is None:
            return
        marks = [
            view.keys.of_round(view.round, "done", g) for g in range(len(view.record.node_ids))
        ]
        missing = [g for g, mark in enumerate(marks) if self.store.get(mark) is None]
        if missing:
            self.fail(
                f"{agent.node_id} passed the exit barrier before group ranks {missing} finished"
            )

    def finish(self) -> None:
        """The job ends cleanly: every member of its round passes the exit barrier within
        its timeout and leaves; then nothing of the run is left in the store (a store of
        its own, as etcd's and Redis's: the last to leave deletes the run)."""
        generation, round_ = self.job_round()
        members = [a for a in self.agents if a.alive and a.training == (generation, round_)]
        timeout = 2 * self.schedule.settings.heartbeat_timeout + 20 * self.schedule.latency + 5
        self.log(f"the job finishes: {[a.node_id for a in members]}")
        # Workers end at different times (a stream of its own: the other draws stay as
        # they were): a member waits at the barrier for the others.
        ends = random.Random(f"finish {self.schedule.seed}")
        for agent in members:
            self.at(self.now + ends.uniform(0, 3), partial(agent.finish, timeout))
        bound = 3 + timeout + protocol.LEAVE_GRACE + 30 * self.schedule.latency + 10
        self._run_until(self.now + bound)
        for agent in members:
            if agent.finishing:
                self.fail(f"{agent.node_id} has not finished {timeout:.0f} s after its workers")
            if agent.joining.finished != round_:
                self.fail(f"{agent.node_id} did not pass the exit barrier of round {round_}")
        keys = Keys(self.schedule.settings.prefix, RUN_ID)
        left = [key for key in self.store.keys() if key.startswith(keys.prefixes)]  # noqa: SIM118
        if left:
            self.fail(f"after a clean finish {len(left)} keys of the run are left: {left[:5]}")

    def _may_give_up(self, agent: SimAgent) -> bool:
        """Only a store out of reach for longer than retry_timeout is a reason, here."""
        outage = self.schedule.outage
        long_outage = (
            outage is not None and outage[1] - outage[0] >= self.schedule.settings.retry_timeout
        )
        return long_outage and "retry_timeout" in (agent.gave_up or "")

    def fail(self, what: str) -> None:
        raise Violation(
            f"{what} (at {self.now:.3f} s)\n  {self.schedule.describe()}\n"
            f"  replay: python -m rallypoint.testing.simulation --seed {self.schedule.seed}"
            f"{self.schedule.nodes_flag} --trace"
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 120 else text[:117] + "..."


@dataclass
class Outcome:
    seed: int
    error: str | None
    events: int
    seconds: float


def run_seed(seed: int, trace: bool = False, nodes: int | None = None) -> Outcome:
    """Run one seed's schedule (of up to ``nodes`` nodes, when given); its violation, if
    any, as text."""
    began = time.perf_counter()
    sim = Simulation(Schedule.draw(seed, nodes), trace=trace)
    log = logging.getLogger("rallypoint.rendezvous")
    quiet, log.disabled = log.disabled, not trace  # a schedule's faults are what it is for
    try:
        sim.run()
        error = None
    except Violation as violation:
        error = str(violation)
    except Exception as crash:
        error = (
            f"seed {seed}: the simulation failed: {crash!r}\n"
            f"  replay: python -m rallypoint.testing.simulation --seed {seed}"
            f"{'' if nodes is None else f' --nodes {nodes}'} --trace"
        )
    finally:
        log.disabled = quiet
    return Outcome(seed, error, sim.events, time.perf_counter() - began)


def run_seeds(seeds: Iterator[int] | range, nodes: int | None = None) -> Iterator[Outcome]:
    for seed in seeds:
        yield run_seed(seed, nodes=nodes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rallypoint.testing.simulation",
        description="Run the rendezvous protocol under seeded fault schedules.",
    )
    parser.add_argument("--seed", type=int, help="replay this one seed")
    parser.add_argument("--trace", action="store_true", help="print every event of --seed")
    parser.add_argument("--schedules", type=int, default=1000, help="how many seeds to run")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--nodes", type=int, help="jobs of up to this many nodes (default: 2 to 5)")
    args = parser.parse_args(argv)
    if args.seed is not None:
        outcome = run_seed(args.seed, args.trace, args.nodes)
        print(outcome.error or f"seed {args.seed}: no violation ({outcome.events} events)")
        return 1 if outcome.error else 0
    seeds = range(args.first, args.first + args.schedules)
    began = time.perf_counter()
    if args.processes > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
            outcomes = pool.map(partial(run_seed, nodes=args.nodes), seeds, chunksize=50)
    else:
        outcomes = list(run_seeds(seeds, args.nodes))
    failed = [o for o in outcomes if o.error]
    for outcome in failed[:5]:
        print(outcome.error)
    took = time.perf_counter() - began
    cpu = sum(o.seconds for o in outcomes)
    print(
        f"{len(outcomes)} schedules (seeds {seeds.start}..{seeds.stop - 1}): "
        f"{len(failed)} with a violation; {took:.1f} s, {cpu / len(outcomes) * 1000:.1f} ms "
        f"per schedule, {sum(o.events for o in outcomes) / len(outcomes):.0f} events each"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

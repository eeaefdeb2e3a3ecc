"""A schedule: one seed's job, its store and its faults, all drawn in ``Schedule.draw``.

Each kind of fault has a random stream of its own (named for it, with the seed), so that
adding a kind leaves the draws of the others as they were.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

from rallypoint.rendezvous.settings import Settings
from rallypoint.testing.simulation.store import BACKENDS, Network

#: The stray's moves (``stray.Stray``): those that only write are always drawn together;
#: deleting keys is drawn apart, since it can stop a job (never split it).
STRAY_MOVES = ("unsealed", "replayed", "counters", "heartbeats")


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
    most: int | None = None  # drawn as a job of this many nodes (--nodes)
    backend: str = "redis"  # whose store and liveness (``store.BACKENDS``)
    token: bool = False  # whether the job seals its records (--rdzv-conf token_file)
    slow: tuple[float, float, float] | None = None  # from, until, seconds each way
    cuts: list[tuple[int, float, float]] = field(default_factory=list)  # node, from, until
    loss: tuple[float, float] | None = None  # the store down from, until, then empty
    steps: list[tuple[int, float, float]] = field(default_factory=list)  # node, at, seconds
    stray: tuple[str, ...] = ()  # what a stray client does (``STRAY_MOVES``, "deletes")

    @classmethod
    def draw(cls, seed: int, most: int | None = None) -> Schedule:
        """Seed ``seed``'s schedule; ``most``: a job of that many nodes (the usual
        few where None; the draws of a given ``most`` stay the same)."""
        rng = random.Random(seed)
        settings, nodes = _job(rng) if most is None else _large_job(random.Random(seed), most)
        low, ttl = settings.min_nodes, settings.heartbeat_timeout
        # A large job's faults come sooner: its schedule is as rich, in fewer events.
        horizon = 120.0 if most is None else 60.0
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
        extra = _more_faults(seed, nodes, horizon, ttl, settings.retry_timeout)
        quiet = _quiet(horizon, outage, freezes + crashes, extra)
        # Time enough after the last fault for every live node to be in one round: a dead
        # member lapses (ttl), its neighbour sees it (ttl / 3), the survivors wait out the
        # last call, join numbers without a record are waited for (close_timeout, twice).
        settle = 2 * ttl + settings.last_call_timeout + 2 * settings.close_timeout
        slow = extra["slow"][2] if extra["slow"] else 0.0
        end = quiet + settle + 30 * (latency + slow) + 20 + max(ready.values())
        return cls(
            seed, settings, nodes, starts, latency, lose, outage, freezes, crashes, stops,
            failures, rerun, skews, ready, quiet, end, most, **extra,
        )  # fmt: skip

    @property
    def stray_deletes(self) -> bool:
        return "deletes" in self.stray

    @property
    def network(self) -> Network:
        return Network(self.latency, self.lose, self.outage, self.slow, self.cuts, self.loss)

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
        faults += [at for _, at, _ in self.cuts] + [at for _, at, _ in self.steps]
        faults += [self.slow[0]] if self.slow else []
        faults += [self.loss[0]] if self.loss else []
        together = all(start <= 1 for start in self.starts)
        return together and not self.lose and min(faults, default=1e9) > formed

    def describe(self) -> str:
        s = self.settings
        sealed = ", sealed" if self.token else ""
        parts = [
            f"seed {self.seed}: {self.backend}{sealed}, {self.nodes} nodes, --nnodes {s.nnodes}, "
            f"ttl {s.heartbeat_timeout:g} s",
            f"latency {self.latency:g} s" if self.latency else "",
            f"lost replies {self.lose:.0%}" if self.lose else "",
            f"outage {self.outage[0]:.1f}-{self.outage[1]:.1f} s" if self.outage else "",
            f"freezes {self.freezes}" if self.freezes else "",
            f"crashes {self.crashes}" if self.crashes else "",
            f"stops {self.stops}" if self.stops else "",
            f"worker failures {self.failures}" if self.failures else "",
            f"rerun at {self.rerun:.1f} s" if self.rerun else "",
            f"skews {self.skews}" if self.skews else "",
            f"slow store {self.slow}" if self.slow else "",
            f"cut off {self.cuts}" if self.cuts else "",
            f"data lost {self.loss}" if self.loss else "",
            f"clock steps {self.steps}" if self.steps else "",
            f"stray {self.stray}" if self.stray else "",
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
    """A job of ``most`` nodes, --nnodes MIN:MAX drawn below it: some may wait for room."""
    high = rng.randint(max(2, most // 2), most)
    low = rng.randint(max(1, high // 2), high)
    settings, _ = _job(rng)
    return dataclasses.replace(settings, min_nodes=low, max_nodes=high), most


def _quiet(
    horizon: float,
    outage: tuple[float, float] | None,
    spells: list[tuple[int, float, float]],
    extra: dict[str, Any],
) -> float:
    """When the last fault is over: ``spells`` are (node, from, for how long)."""
    ends = [horizon] + [at + length for _, at, length in spells]
    ends += [outage[1]] if outage else []
    ends += [until for _, _, until in extra["cuts"]]
    ends += [extra["slow"][1]] if extra["slow"] else []
    ends += [extra["loss"][1]] if extra["loss"] else []
    return max(ends)


def _more_faults(seed: int, nodes: int, horizon: float, ttl: float, retry: float) -> dict[str, Any]:
    """The faults added after the first kinds, each from a stream of its own."""
    backend = random.Random(f"backend {seed}").choice(BACKENDS)
    token = random.Random(f"token {seed}").random() < 0.5
    rng = random.Random(f"slow {seed}")
    slow = None
    if rng.random() < 0.1:
        begin = rng.uniform(5, horizon - 40)
        slow = (begin, begin + rng.choice((20.0, 60.0, 120.0)), rng.choice((0.5, 2.0, ttl)))
    rng = random.Random(f"cuts {seed}")
    cuts = [
        (rng.randrange(nodes), begin := rng.uniform(5, horizon - 30), begin + rng.choice((1.0, ttl, 2 * ttl, retry + 5)))
        for _ in range(rng.choice((0, 0, 0, 1, 2)))
    ]  # fmt: skip
    rng = random.Random(f"loss {seed}")
    loss = None
    if rng.random() < 0.08:
        begin = rng.uniform(10, horizon - 30)
        loss = (begin, begin + rng.choice((0.5, 3.0)))
    rng = random.Random(f"steps {seed}")
    steps = [
        (rng.randrange(nodes), rng.uniform(5, horizon - 30), rng.choice((-3600.0, -30.0, -1.0, 2.0, 600.0)))
        for _ in range(rng.choice((0, 0, 0, 1, 2)))
    ]  # fmt: skip
    rng = random.Random(f"stray {seed}")
    stray: tuple[str, ...] = ()
    if token and rng.random() < 0.4:
        stray = STRAY_MOVES + (("deletes",) if rng.random() < 0.25 else ())
    return {
        "backend": backend, "token": token, "slow": slow, "cuts": cuts, "loss": loss,
        "steps": steps, "stray": stray,
    }  # fmt: skip

"""What every part of one schedule's run shares: the schedule, the hub, the hosts' ports,
the store's server, the rank assigner, and who watches the agents (the invariants).

Data flows one way: ``run`` builds the stage, the agents and the stray act on it, and the
invariants, handed in as an ``Observer``, see what the agents report.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from rallypoint.extensions import RankAssigner
from rallypoint.interfaces import Assignment
from rallypoint.testing.simulation.hub import Hub
from rallypoint.testing.simulation.schedule import Schedule
from rallypoint.testing.simulation.store import Server
from rallypoint.testing.simulation.world import Ports

RUN_ID = "sim"
#: The job token of a sealed schedule (any bytes: every node of the job has the same).
TOKEN = b"simulated job token, 32 bytes.."
#: A round as the simulation knows it: the store's epoch (``store.Server.epoch``: a store
#: that lost its data starts a new one), the run's generation, the round.
Round = tuple[int, int, int]


class Violation(AssertionError):
    """An invariant failed; the message says which, when, and how to replay it."""


class Observer(Protocol):
    """What the agents report to (``invariants.Invariants``)."""

    def assigned(self, agent: Any, assignment: Assignment) -> None: ...

    def trains(self, agent: Any) -> None: ...

    def passed(self, agent: Any) -> None: ...


@dataclass
class Stage:
    schedule: Schedule
    hub: Hub
    ports: Ports
    server: Server
    assigner: RankAssigner
    log: Callable[[str], None]
    #: How many nodes' workers run in each round (the agents keep it up to date).
    training: collections.Counter[Round] = field(default_factory=collections.Counter)
    observer: Observer | None = None
    #: Every agent process started, in order (``agent.SimAgent``).
    agents: list[Any] = field(default_factory=list)
    #: The store lost its data: what cannot hold then may end in a sentence.
    data_lost: bool = False

    def observe(self) -> Observer:
        assert self.observer is not None
        return self.observer

    def fail(self, what: str) -> NoReturn:
        raise Violation(
            f"{what} (at {self.hub.now:.3f} s)\n  {self.schedule.describe()}\n"
            f"  replay: python -m rallypoint.testing.simulation --seed {self.schedule.seed}"
            f"{self.schedule.nodes_flag} --trace"
        )

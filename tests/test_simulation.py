"""The rendezvous protocol under deterministic simulation (``rallypoint.testing.simulation``):
the simulated nodes run the handler that ships; seeded schedules of faults keep every
invariant; a schedule replays exactly from its seed; a job of 1,024 nodes runs; and the
simulation catches real defects put back into the code (``simulation_mutants``).
``make soak`` runs 10,000 schedules, 200 of 64 nodes, and measures every mutant."""

from __future__ import annotations

import pytest
from simulation_mutants import MUTANTS, Mutant, applied, first_caught

from rallypoint.rendezvous.liveness import CounterLiveness
from rallypoint.rendezvous.protocol import StoreRendezvous
from rallypoint.rendezvous.retrying import RetryingStore
from rallypoint.rendezvous.signing import SignedStore
from rallypoint.testing.simulation import Schedule, Simulation, Violation, main, run_seed
from rallypoint.testing.simulation.store import BACKENDS

#: make test's share: about a minute on two cores (``make soak`` runs 10,000).
SCHEDULES = 1200
CHUNKS = 12
#: The first seeds that draw each kind of fault (``Schedule.draw``); checked below.
FIRST_SEEDS = range(400)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_seeded_schedules_keep_every_invariant(chunk: int) -> None:
    size = SCHEDULES // CHUNKS
    failures = [
        outcome.error
        for seed in range(chunk * size, (chunk + 1) * size)
        if (outcome := run_seed(seed)).error is not None
    ]
    assert not failures, "\n".join(failures[:3])


def test_the_schedules_draw_every_fault() -> None:
    """Among make test's seeds: each backend's store and liveness, sealed and open jobs,
    and each fault of the production world, the stray included."""
    schedules = [Schedule.draw(seed) for seed in FIRST_SEEDS]
    assert {s.backend for s in schedules} == set(BACKENDS)
    assert {s.token for s in schedules} == {True, False}
    drawn = {
        "partition": any(s.cuts for s in schedules),
        "data loss": any(s.loss for s in schedules),
        "slow store": any(s.slow for s in schedules),
        "lost replies": any(s.lose for s in schedules),
        "outage": any(s.outage for s in schedules),
        "clock step": any(s.steps for s in schedules),
        "clock skew": any(s.skews for s in schedules),
        "stray": any(s.stray and not s.stray_deletes for s in schedules),
        "stray that deletes": any(s.stray_deletes for s in schedules),
        "c10d host lost": any(
            s.backend == "c10d" and any(node == 0 for node, _, _ in s.crashes) for s in schedules
        ),
    }
    assert all(drawn.values()), [kind for kind, seen in drawn.items() if not seen]
    assert all(not s.stray or s.token for s in schedules)  # a stray only meets a sealed job


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_nodes_run_the_handler_that_ships(backend: str) -> None:
    """Each simulated node's rendezvous is ``StoreRendezvous`` itself, over
    ``RetryingStore``, over ``SignedStore`` in a sealed job, with its backend's liveness:
    TCPStore's counters (``CounterLiveness``), Redis's and etcd's expiry in the store."""
    seed = next(
        seed
        for seed in FIRST_SEEDS
        if (s := Schedule.draw(seed)).backend == backend and s.token and not s.stray
    )
    sim = Simulation(Schedule.draw(seed))
    sim.run()
    handlers = [agent.handler for agent in sim.agents]
    assert handlers and all(type(h) is StoreRendezvous for h in handlers)
    for handler in handlers:
        assert handler is not None
        assert type(handler.store) is RetryingStore
        assert type(handler.store.store) is SignedStore
        connection = handler.store.store.store
        assert isinstance(connection, CounterLiveness) == (backend == "c10d")


def test_a_schedule_replays_exactly_from_its_seed() -> None:
    first, second = Simulation(Schedule.draw(7)), Simulation(Schedule.draw(7))
    first.run()
    second.run()
    assert first.events == second.events > 1000
    assert first.rounds == second.rounds and len(first.rounds) >= 1
    assert Schedule.draw(7) != Schedule.draw(8)


def test_a_job_of_1024_nodes_keeps_every_invariant() -> None:
    """Two crashes, a freeze, a SIGTERM and failing workers in a sealed etcd job of 1,024
    nodes, then a clean finish (about 1.5 million events; under 30 s on one core)."""
    schedule = Schedule.draw(0, 1024)
    assert schedule.nodes == 1024 and schedule.crashes and schedule.stops
    outcome = run_seed(0, nodes=1024)
    assert outcome.error is None, outcome.error


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_a_defect_put_back_is_caught(mutant: Mutant) -> None:
    """At the seed recorded for it; without the defect, the same seed keeps every
    invariant (it is among the schedules above, or make soak's)."""
    assert first_caught(mutant, range(mutant.caught_at, mutant.caught_at + 1)) == mutant.caught_at
    assert run_seed(mutant.caught_at).error is None


def test_a_violation_says_how_to_replay_it(capsys: pytest.CaptureFixture[str]) -> None:
    mutant = next(m for m in MUTANTS if m.name == "frozen-node-alive")
    with applied(mutant), pytest.raises(Violation) as raised:
        Simulation(Schedule.draw(mutant.caught_at)).run()
    replay = f"python -m rallypoint.testing.simulation --seed {mutant.caught_at} --trace"
    assert replay in str(raised.value)
    with applied(mutant):
        assert main(["--seed", str(mutant.caught_at)]) == 1
    assert replay in capsys.readouterr().out
    assert main(["--schedules", "3", "--first", "100"]) == 0
    assert "3 schedules (seeds 100..102): 0 with a violation" in capsys.readouterr().out

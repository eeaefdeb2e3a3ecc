"""The rendezvous protocol under deterministic simulation (``rallypoint.testing.simulation``):
seeded schedules of faults keep every invariant, a schedule replays exactly from its
seed, and the simulation catches real defects put back into the protocol
(``simulation_mutants``). ``make soak`` runs 10,000 schedules and measures every mutant."""

from __future__ import annotations

import pytest
from simulation_mutants import MUTANTS, Mutant, applied, first_caught

from rallypoint.testing.simulation import Schedule, Simulation, Violation, main, run_seed

#: make test's share: about a minute on two cores (``make soak`` runs 10,000).
SCHEDULES = 2400
CHUNKS = 12


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_seeded_schedules_keep_every_invariant(chunk: int) -> None:
    size = SCHEDULES // CHUNKS
    failures = [
        outcome.error
        for seed in range(chunk * size, (chunk + 1) * size)
        if (outcome := run_seed(seed)).error is not None
    ]
    assert not failures, "\n".join(failures[:3])


def test_a_schedule_replays_exactly_from_its_seed() -> None:
    first, second = Simulation(Schedule.draw(7)), Simulation(Schedule.draw(7))
    first.run()
    second.run()
    assert first.events == second.events > 1000
    assert first.rounds == second.rounds and len(first.rounds) >= 1
    assert Schedule.draw(7) != Schedule.draw(8)


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

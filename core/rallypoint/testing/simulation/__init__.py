"""The rendezvous protocol under deterministic simulation: seeded schedules of faults.

N simulated agent processes run the handler that ships (``protocol.StoreRendezvous`` over
``RetryingStore``, ``SignedStore`` when the schedule draws a job token, and the backend's
liveness: TCPStore's counters, Redis's TTL keys, etcd's leases) on one simulated store
and clock. Each process has a world of its own (``rendezvous.world``): its threads are
real threads that take turns, one at a time, at the points where they block (a store
call, a pause, a wait), so every store call and every wait of every node is an event in
one queue, ordered by simulated time, and everything random (latencies, faults, the
order of concurrent calls) is drawn from one seed. A schedule replays exactly::

    python -m rallypoint.testing.simulation --seed 1234 --trace

Faults drawn per schedule (``schedule.Schedule``): store latency; lost replies (a write
applied, its reply lost: the retry applies it again); an outage of the store; a slow
store, for minutes; a partition that cuts nodes off the store while the others go on;
the store's data lost (a Redis restarted empty, a c10d host's death); an agent frozen
(SIGSTOP), crashed (SIGKILL) and started again, stopped (SIGTERM: notice, then it
leaves); its workers failing; nodes arriving late, getting ready beside the running job
first; every agent killed and the job run again under the same run id; a clock fast or
slow, and a wall clock that steps; a stray client that writes unsealed and replayed
records, bumps counters, forges liveness and deletes keys. The invariants are in
``invariants``.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

from rallypoint.testing.simulation.run import Simulation
from rallypoint.testing.simulation.schedule import Schedule
from rallypoint.testing.simulation.stage import Violation

__all__ = ["Outcome", "Schedule", "Simulation", "Violation", "main", "run_seed", "run_seeds"]


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
    parser.add_argument("--nodes", type=int, help="jobs of this many nodes (default: 2 to 5)")
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

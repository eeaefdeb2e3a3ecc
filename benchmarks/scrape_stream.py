"""The synthetic event stream of bench_scrape.py: a job of several nodes as their agents
report it, built with rallypoint's own event types.

Every node's workers report progress at every step and every rank saves a checkpoint every
``save_every`` steps (0.5 s, 0.1 s of it blocking training); now and then a worker fails:
every node restarts its workers, which load the newest checkpoint and redo the steps
after it; now and then a node is named a straggler.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from rallypoint import events as ev
from rallypoint.events import Event, RunInfo

STEP_SECONDS = 0.5


@dataclass(frozen=True)
class Shape:
    """The job: ``nodes`` nodes of ``ranks`` workers, a failure every ``fail_every`` steps."""

    nodes: int = 4
    ranks: int = 8
    save_every: int = 100
    fail_every: int = 8_000
    straggler_every: int = 5_000
    seed: int = 38


def stream(shape: Shape, start: float) -> Iterator[Event]:
    """The job's events in time order, from ``start`` on, without end."""
    runs = [RunInfo("bench-38", f"node-{n}", f"host-{n}", "trainer") for n in range(shape.nodes)]
    chance = random.Random(shape.seed)
    at, round_, step, saved = start, 0, 0, -1
    for run in runs:
        yield Event(ev.AGENT_STARTED, run, {"min_nodes": shape.nodes}, at)
    for run in runs:
        yield Event(ev.RENDEZVOUS_STARTED, run, {"restart_count": 0}, at + 0.1)
    at += 2.0
    while True:
        yield from _round(shape, runs, round_, at, saved)
        at += 5.0 if saved >= 0 else 15.0  # the workers import, and load a checkpoint
        step = saved + 1
        for _ in range(chance.randint(shape.fail_every // 2, shape.fail_every * 3 // 2)):
            at += STEP_SECONDS
            for node, run in enumerate(runs):
                yield Event(
                    ev.PROGRESS,
                    run,
                    {"step": step, "step_seconds": STEP_SECONDS},
                    at + 0.001 * node,
                )
            if step % shape.straggler_every == 0:
                yield _straggler(runs, chance.randrange(len(runs)), at)
            if step % shape.save_every == 0:
                yield from _saves(shape, runs, step, at)
                saved = step
            step += 1
        at += 0.3
        yield from _failure(runs, chance.randrange(len(runs)), at, chance)
        round_ += 1
        at += 1.0


def _round(
    shape: Shape, runs: list[RunInfo], round_: int, at: float, saved: int
) -> Iterator[Event]:
    """Rendezvous round ``round_`` completes and the workers start (loading ``saved``)."""
    world = {
        "round": round_,
        "world_size": shape.nodes * shape.ranks,
        "group_world_size": shape.nodes,
    }
    for run in runs:
        yield Event(ev.RENDEZVOUS_COMPLETED, run, {**world, "duration_seconds": 0.5}, at)
    for run in runs:
        yield Event(ev.WORKERS_STARTED, run, {**world, "pids": list(range(shape.ranks))}, at + 0.5)
    if saved < 0:
        return
    for node, run in enumerate(runs):
        for rank in range(shape.ranks):
            data = {"step": saved, "seconds": 2.0, "source": "durable", "rank": rank, "skipped": 0}
            yield Event(ev.CHECKPOINT_LOADED, run, data, at + 4.0 + _tick(shape, node, rank))


def _saves(shape: Shape, runs: list[RunInfo], step: int, at: float) -> Iterator[Event]:
    for node, run in enumerate(runs):
        for rank in range(shape.ranks):
            data = {
                "step": step, "rank": rank, "seconds": 0.5, "blocked_seconds": 0.1,
                "bytes": 1 << 30, "asynchronous": True,
            }  # fmt: skip
            yield Event(ev.CHECKPOINT_SAVED, run, data, at + 0.25 + _tick(shape, node, rank))


def _tick(shape: Shape, node: int, rank: int) -> float:
    """A moment apart for each rank of each node, in the order they are reported."""
    return 0.0001 * (node * shape.ranks + rank)


def _straggler(runs: list[RunInfo], node: int, at: float) -> Event:
    data = {"node": runs[node].node_id, "pace": 0.75, "median": 0.5, "ratio": 1.5}
    return Event(ev.STRAGGLER, runs[node], data, at + 0.01)


def _failure(runs: list[RunInfo], node: int, at: float, chance: random.Random) -> Iterator[Event]:
    """A worker of ``node`` fails; every node restarts its workers."""
    signal = chance.choice(["SIGKILL", None])
    failure = {
        "local_rank": 1, "rank": 1, "pid": 12, "exit_code": None if signal else 1,
        "signal": signal, "message": "", "timestamp": at - 0.2, "detected": at - 0.05,
    }  # fmt: skip
    yield Event(ev.WORKER_FAILED, runs[node], failure, at)
    for run in runs:
        yield Event(ev.WORKERS_RESTARTED, run, {"restart_count": 1, "cause": "failure"}, at + 0.1)
    for run in runs:
        yield Event(ev.RENDEZVOUS_STARTED, run, {"restart_count": 1}, at + 0.2)


def stopping(runs: list[RunInfo], at: float) -> list[Event]:
    return [Event(ev.AGENT_STOPPING, run, {"exit_code": 0, "reason": "done"}, at) for run in runs]

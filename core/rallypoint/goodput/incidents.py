"""The job's failures: one per round left for a failure, however many nodes saw it, with
its earliest cause and the time it took to detect and to recover from."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rallypoint.goodput.account import MEMBERSHIP, Incident
from rallypoint.goodput.attempts import Run
from rallypoint.goodput.timeline import NodeTimeline

Rounds = Mapping[int, list[tuple[str, Run]]]  # round -> (node, its attempt) of every node


def incidents(nodes: Iterable[NodeTimeline]) -> list[Incident]:
    """One per round left for a failure: its earliest failure over ``nodes`` (in the order
    of the account: a tie goes to the node that started first)."""
    by_round: dict[int, list[tuple[str, Run]]] = {}
    redone: dict[int, int] = {}  # round -> steps redone in it
    for node in nodes:
        for run in node.runs:
            round_ = run.attempt.round
            by_round.setdefault(round_, []).append((node.node, run))
            steps = run.steps_redone()
            if steps is not None:
                redone[round_] = max(redone.get(round_, 0), steps)
    rounds = sorted(by_round)
    found = []
    for position, round_ in enumerate(rounds):
        failed = [(n, r) for n, r in by_round[round_] if r.attempt.failure is not None]
        if not failed or _grew(by_round, rounds, position):
            continue  # no failure, or only a node joining: no failure either
        # A worker's failure is the cause; a membership change only when no worker failed.
        name, run = min(failed, key=lambda nr: _order(nr[1]))
        assert run.attempt.failure is not None
        cause, at, noticed = run.attempt.failure
        later = (r for each in rounds[position + 1 :] for _, r in by_round[each])
        resumed = [r.first_mark[0] for r in later if r.first_mark and r.first_mark[0] > at]
        found.append(
            Incident(
                round=round_,
                at=at,
                node=name,
                cause=cause,
                detect_seconds=None if noticed is None else noticed - at,
                recover_seconds=min(resumed) - at if resumed else None,
                steps_redone=redone.get(rounds[position + 1])
                if position + 1 < len(rounds)
                else None,
            )
        )
    return found


def _order(run: Run) -> tuple[bool, float]:
    failure = run.attempt.failure
    assert failure is not None
    return failure[0] == MEMBERSHIP, failure[1]


def _grew(by_round: Rounds, rounds: list[int], at: int) -> bool:
    """Whether round ``rounds[at]`` ended only for the job's nodes changing (no worker
    failed on any node) and the next round is larger: a node joined, nothing failed."""
    runs = [r for _, r in by_round[rounds[at]]]
    worker_failed = any(r.attempt.failure and r.attempt.failure[2] is not None for r in runs)
    if at + 1 >= len(rounds) or worker_failed:
        return False
    size = max(r.attempt.world_size for r in runs)
    return max(r.attempt.world_size for _, r in by_round[rounds[at + 1]]) > size

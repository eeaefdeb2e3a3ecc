"""What the agent does with a verdict of ``HangWatch``: take every rank's stacks, say what
it found in one line, and kill the culprits, whose failure then restarts the job as any
other failure does.

The stacks come first, from every local rank (the culprits and those that waited), so that
the sentence can say where each culprit was; the dumps stay in each worker's
``stacks.txt`` in the run directory, and the culprit's main thread becomes its failure's
traceback. Work (every rank busy outside collectives) is logged with the same evidence and
nothing is killed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from rallypoint import events
from rallypoint.agent.monitoring.eventbus import EventBus
from rallypoint.agent.monitoring.hangs import WORK, HangWatch, Verdict
from rallypoint.agent.monitoring.stacks import RankStacks, capture, keep_flight_records
from rallypoint.agent.processes.workers import Worker, WorkerGroup
from rallypoint.worker import variables

logger = logging.getLogger("rallypoint.agent")


class HungRanks:
    """Acts on the hang verdicts of one node's attempts."""

    def __init__(self, hangs: HangWatch, bus: EventBus) -> None:
        self.hangs = hangs
        self.bus = bus

    def kill(
        self, group: WorkerGroup, now: float, peers: Mapping[str, object] | None = None
    ) -> bool:
        """Kill the ranks found hung now, once their stacks are taken; whether any were.
        ``peers``: what the round's other nodes shared of their waits (``HangWatch.verdict``)."""
        running = {w.spec.local_rank: w for w in group.running()}
        verdict = self.hangs.verdict(running, now, peers)
        if verdict is None:
            return False
        stacks = _stacks(running, {r.local_rank: r.thread for r in self.hangs.ranks()})
        places = {local_rank: found.place() for local_rank, found in stacks.items()}
        sentence = verdict.sentence(now, places)
        folder = _folder(running)
        if verdict.kind == WORK:
            logger.warning("%s; not killed (stacks in %s)", sentence, folder)
            return False
        culprits = [running[local_rank] for local_rank in verdict.kill]
        wall_since = time.time() - (now - min(verdict.since.values(), default=now))
        flight = keep_flight_records([w.spec.rank for w in culprits], wall_since, folder)
        logger.warning(
            "hang: %s; killing %s (stacks%s in %s)",
            sentence,
            ", ".join(f"rank {w.spec.rank} (pid {w.pid})" for w in culprits),
            " and NCCL flight records" if flight else "",
            folder,
        )
        self.bus.emit(
            events.HANG_DETECTED,
            kind=verdict.kind,
            ranks=[w.spec.rank for w in culprits],
            sentence=sentence,
            stacks=str(folder),
        )
        for worker in culprits:
            _mark(worker, verdict, sentence, stacks.get(worker.spec.local_rank), now)
        group.kill(culprits)
        return True


def _stacks(running: dict[int, Worker], mains: dict[int, int | None]) -> dict[int, RankStacks]:
    """Only ranks that reported are asked: their reporter registered the stacks signal,
    whose default action would end any other process (a --no-python program's)."""
    asked = {
        local_rank: worker
        for local_rank, worker in running.items()
        if local_rank in mains and worker.spec.env.get(variables.STACKS_FILE)
    }
    files = {
        local_rank: Path(worker.spec.env[variables.STACKS_FILE])
        for local_rank, worker in asked.items()
    }
    pids = {local_rank: worker.pid for local_rank, worker in asked.items()}
    return capture(pids, files, mains)


def _folder(running: dict[int, Worker]) -> Path:
    """The attempt's directory in the run directory, where each rank's stacks.txt lies."""
    for worker in running.values():
        path = worker.spec.env.get(variables.STACKS_FILE)
        if path:
            return Path(path).parent.parent
    return Path(".")


def _mark(
    worker: Worker, verdict: Verdict, sentence: str, stacks: RankStacks | None, now: float
) -> None:
    """What the failure report says of a rank killed for a hang."""
    worker.stalled_since = verdict.since.get(worker.spec.local_rank, now)
    worker.stalled_for = now - worker.stalled_since
    worker.hang = sentence
    if stacks is not None:
        worker.stack = stacks.traceback()

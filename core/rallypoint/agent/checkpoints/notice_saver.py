"""The agent's part in a save on notice: the round's step, then the workers held at it.

``rallypoint.agent.checkpoints.save_notice`` holds the notice file and picks the step; this
is the agent's side of the exchange before its workers stop, bounded by
``--shutdown-timeout``.
"""

from __future__ import annotations

import logging
import time

from rallypoint.agent.checkpoints.node_memory import NodeMemory
from rallypoint.agent.checkpoints.save_notice import SaveNotice, notice_step
from rallypoint.agent.monitoring.steps import Progress
from rallypoint.agent.processes.workers import WorkerGroup
from rallypoint.config import LaunchConfig
from rallypoint.errors import RallypointError
from rallypoint.interfaces import RendezvousHandler

logger = logging.getLogger("rallypoint.agent")


class NoticeSaver:
    """Has this node's workers save at one step before they stop, when they watch for
    notices (``notice``: None when the job has no checkpoints)."""

    def __init__(
        self,
        config: LaunchConfig,
        notice: SaveNotice | None,
        handler: RendezvousHandler,
        progress: Progress,
        memory: NodeMemory | None,
    ) -> None:
        self.config = config
        self.notice = notice
        self.handler = handler
        self.progress = progress
        self.memory = memory

    def save(self, group: WorkerGroup, *, told: bool) -> None:
        """Before the workers stop for a new round: when a node of the round was told to
        stop (this one: ``told``) or a newcomer ended it, every worker saves at one step
        and holds there, so that the next round loses nothing. A node told to stop also
        sends its last save to its peer before it leaves. Bounded by --shutdown-timeout."""
        notice = self.notice
        if notice is None or not notice.watched(running_ranks(group)):
            return  # no checkpoints, or a script that never asks should_save
        began, reached = time.monotonic(), self.progress.step()
        if reached is None:
            return  # not one step yet: nothing to save
        step = self._step(reached, told=told)
        if step is None:
            return
        notice.give(step)
        timeout = self.config.shutdown_timeout
        late, held = notice.wait_held(step, lambda: running_ranks(group), timeout)
        if late:
            logger.warning(
                "local rank %s did not save at step %d within %g s (--shutdown-timeout)",
                ", ".join(map(str, late)), step, timeout,
            )  # fmt: skip
        elif (
            told
            and self.memory is not None
            and not self.memory.flush(max(0.0, began + timeout - time.monotonic()))
        ):
            logger.warning("the save of step %d was not sent to a peer in time", step)
        logger.info("saved on notice at step %d in %.2f s", held, time.monotonic() - began)

    def _step(self, reached: int, *, told: bool) -> int | None:
        """The round's step to save at: this node's proposal, given to the round when it was
        ``told`` to stop; else the one another node gave, if any (None: no save)."""
        several = self.config.max_nodes > 1
        proposal = notice_step(reached, self.progress.step_seconds(), several=several)
        if told:
            try:
                step = self.handler.give_notice(proposal)
            except RallypointError as error:  # the store out of reach: this node saves alone
                logger.warning("the other nodes were not given notice: %s", error)
                step = proposal
            logger.info("saving at step %d before this node stops (a save on notice)", step)
            return step
        noticed = self.handler.noticed(proposal)
        if noticed is not None:
            logger.info("the round ends: saving at step %d before the workers stop", noticed)
        return noticed


def running_ranks(group: WorkerGroup) -> list[int]:
    """The local ranks of ``group``'s workers still running."""
    group.reap()
    return [w.spec.local_rank for w in group.running()]

"""Watching a running attempt: how it ends, the steps it reaches, and who is slow.

The monitor wakes every ``--monitor-interval`` (every second at most while hang detection
is on, sooner for a signal or a worker's exit) to ask, in order: a signal? a worker failed?
all done? a rank hung (``monitoring.hangs``: its stacks taken, then killed, a failure)? a
node waiting to join (a membership change)? In between it reports the attempt's progress,
this node's pace, and the round's stragglers.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping
from typing import Any

from rallypoint import events
from rallypoint.agent.monitoring.eventbus import EventBus
from rallypoint.agent.monitoring.hangs import HangSettings, HangWatch
from rallypoint.agent.monitoring.hung_ranks import HungRanks
from rallypoint.agent.monitoring.steps import Progress
from rallypoint.agent.monitoring.stragglers import Pace, stragglers
from rallypoint.agent.processes.workers import WorkerGroup
from rallypoint.agent.statemachine.signals import SignalWatch
from rallypoint.config import LaunchConfig
from rallypoint.interfaces import RendezvousHandler

logger = logging.getLogger("rallypoint.agent")


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    MEMBERSHIP_CHANGED = "membership_changed"
    SIGNALLED = "signalled"


def hang_watch(config: LaunchConfig) -> HangWatch:
    """This node's hang detection, as the flags set it."""
    return HangWatch(
        HangSettings(
            config.hang_detection, config.hang_floor, config.hang_ceiling, config.watchdog_timeout
        )
    )


class WorkerMonitor:
    """This node's view of the running attempt: its steps (``progress``) and its ranks'
    hangs (``hangs``), both fed by the workers' progress reports, its pace and the round's
    stragglers."""

    def __init__(
        self,
        config: LaunchConfig,
        node_id: str,
        handler: RendezvousHandler,
        bus: EventBus,
        signals: SignalWatch,
        pace: Pace,
        hangs: HangWatch,
    ) -> None:
        self.config = config
        self.node_id = node_id
        self.handler = handler
        self.bus = bus
        self.signals = signals
        self.pace = pace  # shared with the rendezvous, which hands it to the other nodes
        self.hangs = hangs  # shared with the rendezvous too, which tells the others its waits
        self.hung = HungRanks(self.hangs, bus)
        self.progress = Progress()
        self.stragglers: tuple[str, ...] = ()  # the nodes found slow in this attempt
        self._named = False  # whether this node was named a straggler in this attempt
        self._nodes_waiting = 0  # as the last nodes_waiting event said

    def report(self, data: Mapping[str, Any]) -> None:
        """A worker's progress report (the worker channel's receiver thread)."""
        self.progress.report(data)
        self.hangs.report(data, time.monotonic())

    def watch(self, now: float, world_size: int) -> None:
        """A new attempt's workers start at ``now`` (monotonic), in a job of ``world_size``
        ranks: forget the last one's."""
        self.progress.watch(now)
        self.hangs.watch(now, world_size)
        self.pace.reset()
        self.stragglers, self._named = (), False
        self._nodes_waiting = 0  # those that waited are in the round that starts

    def outcome(self, group: WorkerGroup) -> Outcome:
        """Watch the workers until they all succeed, one fails, a node arrives or a signal."""
        while True:
            if self.signals.signalled is not None:
                return Outcome.SIGNALLED
            group.reap()
            if any(w.returncode not in (None, 0) for w in group.workers):
                return Outcome.FAILED
            if not group.running():
                return Outcome.SUCCEEDED
            if self.hung.kill(group, time.monotonic(), self.handler.waits()):
                return Outcome.FAILED
            waiting = self.handler.nodes_waiting()
            if waiting != self._nodes_waiting:
                self._nodes_waiting = waiting
                self.bus.emit(events.NODES_WAITING, nodes_waiting=waiting)
            if waiting > 0:
                return Outcome.MEMBERSHIP_CHANGED
            self.report_progress(group)
            timeout = min(self.config.monitor_interval, self.hangs.seconds_left())
            group.wait(timeout, self.signals.fileno())
            self.signals.drain()

    def report_progress(self, group: WorkerGroup, *, final: bool = False) -> None:
        """A ``progress`` event when one is due; then this node's pace, and stragglers."""
        data = self.progress.due(time.monotonic(), final=final)
        if data is None:
            return
        self.bus.emit(events.PROGRESS, **data)
        self.pace.sample(group.pids, data["step"])
        factor = self.config.straggler_factor
        if not factor or final:
            return
        found = stragglers({**self.handler.paces(), **self._own_pace()}, factor)
        self.stragglers = tuple(sorted(found))
        mine = found.get(self.node_id)
        if mine is not None and not self._named:
            self._named = True
            logger.warning(
                "this node is a straggler: its workers work %.3f s per step, %.1f times the "
                "median of the round's other nodes (%.3f s; --straggler-factor %g)",
                mine["pace"],
                mine["ratio"],
                mine["median"],
                factor,
            )
            self.bus.emit(events.STRAGGLER, **mine)

    def _own_pace(self) -> dict[str, float]:
        seconds = self.pace.seconds()
        return {} if seconds is None else {self.node_id: seconds}

"""Watching a running attempt: how it ends, the steps it reaches, and who is slow.

The monitor wakes every ``--monitor-interval`` (sooner for a signal, a worker's exit or a
watchdog deadline) to ask, in order: a signal? a worker failed? all done? a worker stalled
(``--watchdog-timeout``: killed, a failure)? a node waiting to join (a membership change)?
In between it reports the attempt's progress, this node's pace, and the round's stragglers.
"""

from __future__ import annotations

import enum
import logging
import time

from rallypoint import events
from rallypoint.agent.monitoring.eventbus import EventBus
from rallypoint.agent.monitoring.steps import Progress
from rallypoint.agent.monitoring.stragglers import Pace, stragglers
from rallypoint.agent.monitoring.watchdog import Watchdog
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


class WorkerMonitor:
    """This node's view of the running attempt: its steps (``progress``, fed by the worker
    channel's heartbeats), its pace, the watchdog's deadlines and the round's stragglers."""

    def __init__(
        self,
        config: LaunchConfig,
        node_id: str,
        handler: RendezvousHandler,
        bus: EventBus,
        signals: SignalWatch,
        pace: Pace,
    ) -> None:
        self.config = config
        self.node_id = node_id
        self.handler = handler
        self.bus = bus
        self.signals = signals
        self.pace = pace  # shared with the rendezvous, which hands it to the other nodes
        self.watchdog = Watchdog(config.watchdog_timeout) if config.watchdog_timeout else None
        # Heartbeats (the step reached) go to progress, and on to the watchdog.
        self.progress = Progress(None if self.watchdog is None else self.watchdog.beat)
        self.stragglers: tuple[str, ...] = ()  # the nodes found slow in this attempt
        self._named = False  # whether this node was named a straggler in this attempt
        self._nodes_waiting = 0  # as the last nodes_waiting event said

    def watch(self, now: float) -> None:
        """A new attempt's workers start at ``now`` (monotonic): forget the last one's."""
        self.progress.watch(now)
        self.pace.reset()
        self.stragglers, self._named = (), False
        self._nodes_waiting = 0  # those that waited are in the round that starts
        if self.watchdog is not None:
            self.watchdog.watch(now)

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
            if self._kill_stalled(group):
                return Outcome.FAILED
            waiting = self.handler.nodes_waiting()
            if waiting != self._nodes_waiting:
                self._nodes_waiting = waiting
                self.bus.emit(events.NODES_WAITING, nodes_waiting=waiting)
            if waiting > 0:
                return Outcome.MEMBERSHIP_CHANGED
            self.report_progress(group)
            timeout = self.config.monitor_interval
            if self.watchdog is not None:
                ranks = [w.spec.local_rank for w in group.running()]
                timeout = min(timeout, self.watchdog.seconds_left(ranks, time.monotonic()))
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

    def _kill_stalled(self, group: WorkerGroup) -> bool:
        """Kill the running workers the watchdog finds overdue; return whether there were any."""
        if self.watchdog is None:
            return False
        now = time.monotonic()
        overdue = self.watchdog.overdue([w.spec.local_rank for w in group.running()], now)
        stalled = [w for w in group.running() if w.spec.local_rank in overdue]
        for worker in stalled:
            worker.stalled_since = overdue[worker.spec.local_rank]
            worker.stalled_for = now - worker.stalled_since
            logger.warning(
                "rank %d (pid %d) made no progress for %.1f s (--watchdog-timeout %g): killing it",
                worker.spec.rank,
                worker.pid,
                worker.stalled_for,
                self.watchdog.timeout,
            )
        group.kill(stalled)
        return bool(stalled)

"""The agent's state machine.

    rendezvous -> start workers -> monitor --(all exited 0)--> exit barrier -> stop
        ^  |                          |
        |  +--(a failure, no node     +--(a worker failed)--> next round
        |      lost: restart policy        |
        |      --(give up)--> stop)        |
        +-------------------------------+--+--(a node joined or left)

A membership change restarts the workers without using up a restart. A worker failure in a
round of several nodes may be the loss of a node (its workers' death fails ours), so it is
judged once the next round tells who is still there: a node lost is a membership change,
whatever the restart policy says; only a failure with every node still there is put to the
policy. Every transition is an event (see ``EventBus``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rallypoint import events
from rallypoint.agent.checkpoints.node_memory import NodeMemory
from rallypoint.agent.checkpoints.notice_saver import NoticeSaver
from rallypoint.agent.checkpoints.save_notice import SaveNotice
from rallypoint.agent.monitoring.eventbus import EventBus
from rallypoint.agent.monitoring.failures import write_error_record
from rallypoint.agent.monitoring.hangs import SharedWaits
from rallypoint.agent.monitoring.sinks import create_sinks
from rallypoint.agent.monitoring.stragglers import Pace
from rallypoint.agent.processes.workers import WorkerGroup
from rallypoint.agent.statemachine.judge import (
    EXIT_SUCCESS,
    EXIT_WORKER_FAILURE,
    RestartJudge,
    Stop,
)
from rallypoint.agent.statemachine.monitor import Outcome, WorkerMonitor, hang_watch
from rallypoint.agent.statemachine.rendezvous_handler import create_handler
from rallypoint.agent.statemachine.restarts import MEMBERSHIP, Failure, Restarts
from rallypoint.agent.statemachine.signals import SignalWatch
from rallypoint.agent.statemachine.supervisor import WorkerSupervisor
from rallypoint.config import LaunchConfig
from rallypoint.errors import RallypointError
from rallypoint.events import RoundInfo, RunInfo
from rallypoint.extensions import NodeSpec
from rallypoint.interfaces import Assignment, RendezvousFailed, RendezvousHandler, RendezvousTimeout
from rallypoint.plugins import PluginManager
from rallypoint.rendezvous.endpoints import node_address
from rallypoint.worker.channel import Receiver
from rallypoint.worker.record import error_record

__all__ = ["EXIT_SUCCESS", "EXIT_WORKER_FAILURE", "Agent", "Outcome"]

logger = logging.getLogger("rallypoint.agent")


class Agent:
    """Runs one node's share of a job until it succeeds, fails for good or is signalled.

    The round loop is here; its collaborators hold the rest: ``SignalWatch`` the signals,
    ``WorkerSupervisor`` the worker groups it starts and their failures, ``WorkerMonitor``
    a running attempt, ``NoticeSaver`` the saves on notice, ``RestartJudge`` the restart
    policy and the failure reports."""

    def __init__(self, config: LaunchConfig, pm: PluginManager) -> None:
        self.config = config
        self.pm = pm
        hostname = socket.gethostname()
        self.node_id = f"{hostname}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.run = RunInfo(config.rdzv_id, self.node_id, hostname, config.role)
        host = node_address(config.local_addr, config.max_nodes)
        pace = Pace()
        hangs = hang_watch(config)
        # The other nodes' waits are evidence of a hang here, and this node's for theirs.
        waits = SharedWaits(hangs, time.monotonic) if config.max_nodes > 1 else None
        # First, so that a rendezvous that cannot start leaves nothing behind; it takes
        # what this node offers each round (its memory checkpoints), and its pace.
        self.handler: RendezvousHandler = create_handler(
            config,
            NodeSpec(self.node_id, host=host, labels=config.node_labels),
            offer=self._offer if config.checkpoint_memory else None,
            pace=pace.seconds if config.straggler_factor else None,
            ready=self._getting_ready,
            waits=waits,
        )
        self.run_dir, self._temporary_run_dir = _run_directory(config)
        sinks, self.metrics_dir = create_sinks(config, self.run, self.run_dir)
        self.bus = EventBus(self.run, pm, sinks, config.event_log)
        self.signals = SignalWatch()
        self.monitor = WorkerMonitor(
            config, self.node_id, self.handler, self.bus, self.signals, pace, hangs
        )
        self.memory = _node_memory(config, host, self.bus)
        # Saves on notice (SIGTERM): when there are checkpoints to save. The file goes in
        # node memory when there is some (never a network file system, gone with it).
        self.notice: SaveNotice | None = None
        if config.checkpoint_dir or config.checkpoint_memory:
            self.notice = SaveNotice(self.run_dir if self.memory is None else self.memory.path)
        # Workers report checkpoint saves and loads here; they reach the bus like ours.
        # Their progress reports go to the monitor (steps, and hang detection).
        self._worker_events = Receiver(
            self._worker_event,
            progress=self.monitor.report,
            notice=None if self.notice is None else self.notice.message,
        )
        self.supervisor = WorkerSupervisor(
            config,
            self.node_id,
            self.run_dir,
            self.bus,
            self._worker_events,
            metrics_dir=self.metrics_dir,
            memory_path=None if self.memory is None else self.memory.path,
            notice=self.notice,
            interrupted=lambda: self.signals.signalled is not None,
        )
        self.saver = NoticeSaver(
            config, self.notice, self.handler, self.monitor.progress, self.memory
        )
        # torchrun's parent error file: the root cause of a job that fails goes there too.
        self._parent_error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        self.judge = RestartJudge(
            config, self.handler, self.bus, self.signals, self.run_dir, self._parent_error_file
        )

    def _getting_ready(self, offers: Sequence[Mapping[str, str]]) -> str | None:
        """Before this node enters a running job: what it still does to start workers at
        once (its preloaded interpreter, the newest memory checkpoint); None when ready."""
        doing = self.supervisor.getting_ready()
        if self.memory is not None:
            fetching = self.memory.getting_ready(offers, last=doing is None)
            doing = doing if fetching is None else f"{doing}; {fetching}" if doing else fetching
        return doing

    def _worker_event(self, name: str, data: dict[str, Any]) -> None:
        self.bus.emit(name, **data)
        if name == events.CHECKPOINT_SAVED and self.memory is not None:
            self.memory.saved(data)

    def _offer(self) -> Mapping[str, str]:
        """What this node offers each round it joins: where its memory checkpoints are."""
        return self.memory.offer() if self.memory is not None else {}

    # --- the run ------------------------------------------------------------------------

    def run_job(self) -> int:
        """Run until done; return the exit code for ``rallypoint run``."""
        self.signals.install(self.config.signals_to_handle)
        exit_code, reason = EXIT_WORKER_FAILURE, "the agent failed"
        try:
            exit_code, reason = self._loop()
        except RallypointError as error:
            exit_code, reason = error.exit_code, str(error)  # as the console will say
            if self._parent_error_file:  # as torchrun's @record on its main
                write_error_record(self._parent_error_file, error_record(error))
            raise
        finally:
            if self.memory is not None:  # the newest memory checkpoint made durable first
                self.memory.close(reason)
            self.supervisor.release()  # whatever the workers left running goes with it
            self.bus.emit(events.AGENT_STOPPING, exit_code=exit_code, reason=reason)
            self.handler.close()
            self.supervisor.close()  # its keeper is gone by now: it went while the handler closed
            self._worker_events.close()
            if self.notice is not None:
                self.notice.close()
            self.bus.close()
            if self.metrics_dir is not None:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)
            self.signals.close()
            if exit_code == EXIT_SUCCESS and self._temporary_run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)
        return exit_code

    def _loop(self) -> tuple[int, str]:
        """rendezvous -> judge the last failure -> start -> watch, until a way out."""
        config = self.config
        for note in config.notes:
            logger.info("%s", note)
        self.bus.emit(
            events.AGENT_STARTED,
            nproc_per_node=config.nproc_per_node,
            min_nodes=config.min_nodes,
            max_nodes=config.max_nodes,
        )
        restarts = Restarts()
        previous: RoundInfo | None = None
        self.supervisor.keeper()  # it and the preloaded interpreter start while the rendezvous runs
        while True:
            assignment = self._rendezvous(restarts, previous)
            if assignment is None:
                assert self.signals.signalled is not None
                logger.info(
                    "received %s while in the rendezvous: leaving", self.signals.signalled.name
                )
                return self.signals.exit()
            previous = assignment.info
            stop = self.judge.judge(restarts, assignment.info, self.monitor.stragglers)
            if stop is not None:
                return stop
            resume = None if self.memory is None else self.memory.resume_step(assignment)
            self.monitor.watch(time.monotonic(), assignment.info.world_size)
            group = self.supervisor.start(assignment, restarts.count, restarts.attempts, resume)
            restarts.attempts += 1
            started = time.monotonic()
            self.bus.emit(events.WORKERS_STARTED, assignment.info, pids=list(group.pids))
            try:
                outcome = self.monitor.outcome(group)
            except BaseException:
                group.stop(signal.SIGTERM, config.shutdown_timeout)  # e.g. the store is gone
                raise
            finally:
                self.monitor.report_progress(group, final=True)  # the step the attempt reached
            if outcome is Outcome.SUCCEEDED:
                return self._finish(group)
            if outcome is Outcome.SIGNALLED:
                return self._stop_on_signal(group)
            if outcome is Outcome.MEMBERSHIP_CHANGED:
                if self.memory is not None:
                    self.memory.round_ends()
                self.saver.save(group, told=False)
                group.stop(signal.SIGTERM, config.shutdown_timeout)
                self.judge.restarted(restarts, MEMBERSHIP)
                continue
            stop = self._failed(group, restarts, assignment.info, time.monotonic() - started)
            if stop is not None:
                return stop
            self.handler.request_new_round()  # every node restarts its workers with us

    def _rendezvous(self, restarts: Restarts, previous: RoundInfo | None) -> Assignment | None:
        """The next round, announced; None when a signal came first. The wait can be long
        (up to ``join_timeout``) and there are no workers to stop yet: a signal interrupts
        it, so that an agent told to stop (a pod deleted, a job cancelled) stops at once."""
        self.bus.emit(events.RENDEZVOUS_STARTED, restart_count=restarts.count)
        began = time.monotonic()
        try:
            assignment = self.signals.interruptible(self.handler.next_round)
        except (RendezvousTimeout, RendezvousFailed) as error:
            if restarts.pending is not None:  # reported with why the next round failed
                self.judge.no_round(restarts.pending, error)
            raise
        if assignment is not None:
            took = time.monotonic() - began
            self._announce_round(assignment.info, took, previous, restarts.pending)
        return assignment

    def _failed(
        self, group: WorkerGroup, restarts: Restarts, info: RoundInfo, uptime: float
    ) -> Stop:
        """A worker failed: stop the others, report it, and put it to the policy now (one
        node) or after the next round (several). The agent's exit when it ends here."""
        report = self.supervisor.failure(group, restarts.count)
        if self.signals.signalled is not None:
            return self._stop_on_signal(group)
        return self.judge.failed(report, restarts, info, uptime, self.monitor.stragglers)

    def _finish(self, group: WorkerGroup) -> tuple[int, str]:
        """Every worker exited 0: collect what they left, then wait for the other nodes."""
        # Reaches processes the workers left behind, which may hold their output.
        group.stop(signal.SIGTERM, self.config.shutdown_timeout)
        group.finish_output()
        self.handler.exit_barrier(self.config.exit_barrier_timeout)
        return EXIT_SUCCESS, "all workers finished"

    def _stop_on_signal(self, group: WorkerGroup) -> tuple[int, str]:
        """Forward the signal to the workers, give them the shutdown timeout, then kill."""
        signalled = self.signals.signalled
        assert signalled is not None
        if signalled is signal.SIGTERM:
            self.saver.save(group, told=True)
        logger.info(
            "received %s: stopping workers (%.0f s before SIGKILL)",
            signalled.name,
            self.config.shutdown_timeout,
        )
        group.stop(signalled, self.config.shutdown_timeout)
        group.finish_output()
        return self.signals.exit()

    def _announce_round(
        self,
        info: RoundInfo,
        took: float,
        previous: RoundInfo | None,
        pending: Failure | None,
    ) -> None:
        """The round's events, and its line on the console: for every round of a job of
        several nodes, naming the nodes that joined it and those that left it."""
        self.bus.emit(events.RENDEZVOUS_COMPLETED, info, duration_seconds=took)
        if self.config.max_nodes > 1:
            logger.info(
                "round %d: %d node%s, world size %d, this node is group rank %d (%.2f s)",
                info.round,
                info.group_world_size,
                "" if info.group_world_size == 1 else "s",
                info.world_size,
                info.group_rank,
                took,
            )
        if previous is None:
            return
        before, now = set(previous.members), set(info.members)
        joined = [node for node in info.members if node not in before]
        left = [node for node in previous.members if node not in now]
        if joined:
            logger.info("node %s joined the job", ", ".join(joined))
        if left and pending is None:  # else the failure's cause names them
            logger.info(
                "node %s left the job (it stopped, or its heartbeat lapsed)", ", ".join(left)
            )
        if len(before) != len(now):
            self.bus.emit(events.SCALE_CHANGED, old_nodes=len(before), new_nodes=len(now))


def _node_memory(config: LaunchConfig, host: str, bus: EventBus) -> NodeMemory | None:
    """This node's memory checkpoints (``--checkpoint-memory``), when asked for."""
    if not config.checkpoint_memory:
        return None
    memory = NodeMemory(config, host, bus.emit)
    server = memory.server
    if server is not None and config.job_token is None:
        logger.warning(
            "serving memory checkpoints to the other nodes on %s without a job token: "
            "any process that reaches this port can fetch or push a checkpoint; give "
            "every node --rdzv-conf token_file=PATH or RALLYPOINT_JOB_TOKEN "
            "(docs/security.md)",
            server.address,
        )
    return memory


def _run_directory(config: LaunchConfig) -> tuple[Path, bool]:
    """Where error files, logs and the failure report of this run go; and if it is temporary."""
    if config.log_dir:
        # --log-dir may be shared and exist already: only the run's own directory is
        # private (0700, like mkdtemp's), as its logs and reports may tell secrets.
        path = Path(config.log_dir) / f"{config.rdzv_id}_{uuid.uuid4().hex[:8]}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
        path.chmod(0o700)  # whatever the umask
        return path, False
    return Path(tempfile.mkdtemp(prefix=f"rallypoint-{config.rdzv_id}-")), True

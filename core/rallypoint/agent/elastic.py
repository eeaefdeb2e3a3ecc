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

import contextlib
import enum
import logging
import math
import os
import select
import shutil
import signal
import socket
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from rallypoint import events
from rallypoint.agent import numa
from rallypoint.agent.environment import worker_environment
from rallypoint.agent.eventbus import EventBus, NamedSink, TorchConsoleEvents
from rallypoint.agent.failures import (
    FailureReport,
    build_report,
    describe_failure,
    failure_of,
    write_error_record,
)
from rallypoint.agent.keeper import Keeper
from rallypoint.agent.logs import STDERR, STDOUT, AttemptLogs, TorchLogsSpecs, default_logs
from rallypoint.agent.node_memory import NodeMemory
from rallypoint.agent.notice import SaveNotice, notice_step
from rallypoint.agent.oom import cgroup_kills, oom_killed
from rallypoint.agent.rendezvous_handler import create_handler
from rallypoint.agent.restarts import FAILURE, MEMBERSHIP, Failure, Restarts, lost_nodes
from rallypoint.agent.steps import Progress
from rallypoint.agent.stragglers import Pace, stragglers
from rallypoint.agent.warm import WarmStart
from rallypoint.agent.watchdog import Watchdog
from rallypoint.agent.workers import Worker, WorkerGroup, WorkerSpec
from rallypoint.config import LaunchConfig
from rallypoint.errors import RallypointError
from rallypoint.events import RoundInfo, RunInfo
from rallypoint.extensions import NodeSpec, RestartDecision, RestartRequest, SinkContext
from rallypoint.interfaces import (
    Assignment,
    RendezvousFailed,
    RendezvousHandler,
    RendezvousTimeout,
)
from rallypoint.plugins import PluginManager
from rallypoint.registry import METRICS_SINKS, RESTART_POLICIES, describe, plugin_failure
from rallypoint.rendezvous.endpoints import node_address
from rallypoint.worker.channel import Receiver
from rallypoint.worker.record import error_record

logger = logging.getLogger("rallypoint.agent")

#: Exit codes of ``rallypoint run``: usage errors are 2; a signal N gives 128 + N.
EXIT_SUCCESS = 0
EXIT_WORKER_FAILURE = 1

#: Seconds a worker that printed a traceback gets to exit on its own after a peer failed.
FINALISING_GRACE = 2.0


class _Interrupted(BaseException):
    """Raised by the signal handler, in the main thread, to leave a rendezvous wait (a
    BaseException, like KeyboardInterrupt, so that no ``except Exception`` of a store
    swallows it)."""


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    MEMBERSHIP_CHANGED = "membership_changed"
    SIGNALLED = "signalled"


class Agent:
    """Runs one node's share of a job until it succeeds, fails for good or is signalled."""

    def __init__(self, config: LaunchConfig, pm: PluginManager) -> None:
        self.config = config
        self.pm = pm
        hostname = socket.gethostname()
        self.node_id = f"{hostname}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.run = RunInfo(config.rdzv_id, self.node_id, hostname, config.role)
        host = node_address(config.local_addr, config.max_nodes)
        self.pace = Pace()
        # First, so that a rendezvous that cannot start leaves nothing behind; it takes
        # what this node offers each round (its memory checkpoints), and its pace.
        self.handler: RendezvousHandler = create_handler(
            config,
            NodeSpec(self.node_id, host=host, labels=config.node_labels),
            offer=self._offer if config.checkpoint_memory else None,
            pace=self.pace.seconds if config.straggler_factor else None,
            ready=self._getting_ready,
        )
        self.run_dir, self._temporary_run_dir = _run_directory(config)
        self.metrics_dir: Path | None = None  # set by _create_sinks when a sink wants it
        self._nodes_waiting = 0
        self.bus = EventBus(self.run, pm, self._create_sinks(), config.event_log)
        self.watchdog = Watchdog(config.watchdog_timeout) if config.watchdog_timeout else None
        self.memory: NodeMemory | None = None
        if config.checkpoint_memory:
            self.memory = NodeMemory(config, host, self.bus.emit)
            server = self.memory.server
            if server is not None and config.job_token is None:
                logger.warning(
                    "serving memory checkpoints to the other nodes on %s without a job token: "
                    "any process that reaches this port can fetch or push a checkpoint; give "
                    "every node --rdzv-conf token_file=PATH or RALLYPOINT_JOB_TOKEN "
                    "(docs/security.md)",
                    server.address,
                )
        # Workers report checkpoint saves and loads here; they reach the bus like ours.
        # Their heartbeats (the step reached) go to progress, and on to the watchdog.
        self.progress = Progress(None if self.watchdog is None else self.watchdog.beat)
        self._stragglers: tuple[str, ...] = ()  # the nodes found slow in this attempt
        self._named = False  # whether this node was named a straggler in this attempt
        # Saves on notice (SIGTERM): when there are checkpoints to save. The file goes in
        # node memory when there is some (never a network file system, gone with it).
        self.notice: SaveNotice | None = None
        if config.checkpoint_dir or config.checkpoint_memory:
            self.notice = SaveNotice(self.run_dir if self.memory is None else self.memory.path)
        self._worker_events = Receiver(
            self._worker_event,
            heartbeat=self.progress.beat,
            notice=None if self.notice is None else self.notice.message,
        )
        self._kept: Keeper | None = None  # started with the first rendezvous: see _keeper
        self.warm = WarmStart(config, lambda: self.signalled is not None)
        self._oom_kills: int | None = None  # the memory cgroup's OOM kills at the last start
        self._logs_specs: TorchLogsSpecs | None = None  # --logs-specs's class, made once
        # torchrun's parent error file: the root cause of a job that fails goes there too.
        self._parent_error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        self.signalled: signal.Signals | None = None
        self._interruptible = False  # in a rendezvous wait: a signal raises _Interrupted
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)

    def _getting_ready(self, offers: Sequence[Mapping[str, str]]) -> str | None:
        """Before this node enters a running job: what it still does to start workers at
        once (its preloaded interpreter, the newest memory checkpoint); None when ready."""
        doing = self.warm.getting_ready(self._keeper())
        if self.memory is not None:
            fetching = self.memory.getting_ready(offers, last=doing is None)
            doing = doing if fetching is None else f"{doing}; {fetching}" if doing else fetching
        return doing

    def _worker_event(self, name: str, data: dict[str, Any]) -> None:
        self.bus.emit(name, **data)
        if name == events.CHECKPOINT_SAVED and self.memory is not None:
            self.memory.saved(data)

    def _create_sinks(self) -> list[NamedSink]:
        sinks: list[NamedSink] = []
        if self.config.event_log_handler == "console":
            sinks.append(NamedSink(TorchConsoleEvents(), "the --event-log-handler console"))
        for chosen in self.config.sinks:
            sink, options = chosen.item, chosen.options
            directory = None
            if sink.worker_metrics:
                # One directory for every sink that reads worker metrics; workers only
                # record metrics (rallypoint.metrics) when there is one.
                if self.metrics_dir is None:
                    self.metrics_dir = self.run_dir / "metrics"
                    shutil.rmtree(self.metrics_dir, ignore_errors=True)
                    self.metrics_dir.mkdir(parents=True)
                directory = str(self.metrics_dir)
            who = describe(METRICS_SINKS, sink)
            try:
                created = sink.create(SinkContext(self.run, options, directory))
            except Exception as error:  # a plugin's: the job goes on without the sink
                outcome = "the job goes on without it"
                logger.warning("%s", plugin_failure(who, "create", error, outcome))
                continue
            sinks.append(NamedSink(created, who))
        return sinks

    # --- the run ------------------------------------------------------------------------

    def run_job(self) -> int:
        """Run until done; return the exit code for ``rallypoint run``."""
        previous = self._install_signal_handlers()
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
            if self._kept is not None:
                self._kept.release()  # whatever the workers left running goes with it
            self.bus.emit(events.AGENT_STOPPING, exit_code=exit_code, reason=reason)
            self.handler.close()
            if self._kept is not None:
                self._kept.close()  # gone by now, or nearly: it went while the handler closed
            self._worker_events.close()
            if self.notice is not None:
                self.notice.close()
            self.bus.close()
            if self.metrics_dir is not None:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._wake_read.close()
            self._wake_write.close()
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
        self._keeper()  # it and the preloaded interpreter start while the rendezvous runs
        while True:
            assignment = self._rendezvous(restarts, previous)
            if assignment is None:
                assert self.signalled is not None
                logger.info("received %s while in the rendezvous: leaving", self.signalled.name)
                return 128 + int(self.signalled), f"stopped by {self.signalled.name}"
            previous = assignment.info
            stop = self._judge(restarts, assignment.info)
            if stop is not None:
                return stop
            resume = None if self.memory is None else self.memory.resume_step(assignment)
            group = self._start_workers(assignment, restarts.count, restarts.attempts, resume)
            restarts.attempts += 1
            started = time.monotonic()
            self.bus.emit(events.WORKERS_STARTED, assignment.info, pids=list(group.pids))
            try:
                outcome = self._monitor(group)
            except BaseException:
                group.stop(signal.SIGTERM, config.shutdown_timeout)  # e.g. the store is gone
                raise
            finally:
                self._report_progress(group, final=True)  # the step the attempt reached
            if outcome is Outcome.SUCCEEDED:
                return self._finish(group)
            if outcome is Outcome.SIGNALLED:
                return self._stop_on_signal(group)
            if outcome is Outcome.MEMBERSHIP_CHANGED:
                if self.memory is not None:
                    self.memory.round_ends()
                self._save_on_notice(group, told=False)
                group.stop(signal.SIGTERM, config.shutdown_timeout)
                self._workers_restarted(restarts, MEMBERSHIP)
                continue
            stop = self._failed(group, restarts, assignment.info, time.monotonic() - started)
            if stop is not None:
                return stop
            self.handler.request_new_round()  # every node restarts its workers with us

    def _rendezvous(self, restarts: Restarts, previous: RoundInfo | None) -> Assignment | None:
        """The next round, announced; None when a signal came first."""
        self.bus.emit(events.RENDEZVOUS_STARTED, restart_count=restarts.count)
        began = time.monotonic()
        try:
            assignment = self._next_round()
        except RendezvousTimeout as error:
            if restarts.pending is not None:  # the failure was the loss of nodes, too many
                self._report_lost(restarts.pending, error)
            raise
        except RendezvousFailed as error:  # another node failed the job, or its assigner
            if restarts.pending is not None:
                self._report(restarts.pending.report, str(error))
            raise
        if assignment is not None:
            took = time.monotonic() - began
            self._announce_round(assignment.info, took, previous, restarts.pending)
        return assignment

    def _judge(self, restarts: Restarts, info: RoundInfo) -> tuple[int, str] | None:
        """What the last failure was, now that this round tells who is still there: a
        membership change if a node of its round is gone, else a failure the policy is
        asked about (unless it was already). The agent's exit when the policy refuses."""
        failure = restarts.pending
        if failure is None:
            return None
        restarts.pending = None
        lost = [] if failure.decided else lost_nodes(failure, info)
        if lost:
            logger.info(
                "the failure followed the loss of node %s: a membership change, which does "
                "not use up a restart",
                ", ".join(lost),
            )
        elif not failure.decided:
            stop = self._ask_policy(failure, restarts)
            if stop is not None:
                return stop
            restarts.count += 1
        cause = MEMBERSHIP if lost else FAILURE
        self._workers_restarted(restarts, cause)
        return None

    def _failed(
        self, group: WorkerGroup, restarts: Restarts, info: RoundInfo, uptime: float
    ) -> tuple[int, str] | None:
        """A worker failed: stop the others, report it, and put it to the policy now (one
        node) or after the next round (several). The agent's exit when it ends here."""
        report = self._handle_failure(group, restarts.count)
        if self.signalled is not None:
            return self._stop_on_signal(group)
        failure = restarts.failed(report, info.members, uptime)
        if info.group_world_size > 1:
            # A peer's death fails our workers too (gloo's "Connection closed by peer"):
            # whether it did is known from the next round.
            logger.info(
                "%s; the next round tells whether a node of this round was lost "
                "before a restart is counted",
                _root(report),
            )
            return None
        stop = self._ask_policy(failure, restarts)
        if stop is None:
            restarts.allowed()  # counted now: the next round's events carry it
        return stop

    def _finish(self, group: WorkerGroup) -> tuple[int, str]:
        """Every worker exited 0: collect what they left, then wait for the other nodes."""
        # Reaches processes the workers left behind, which may hold their output.
        group.stop(signal.SIGTERM, self.config.shutdown_timeout)
        group.finish_output()
        self.handler.exit_barrier(self.config.exit_barrier_timeout)
        return EXIT_SUCCESS, "all workers finished"

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
        self._nodes_waiting = 0  # they are in this round
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

    def _offer(self) -> Mapping[str, str]:
        """What this node offers each round it joins: where its memory checkpoints are."""
        return self.memory.offer() if self.memory is not None else {}

    def _report_lost(self, failure: Failure, error: RendezvousTimeout) -> None:
        """The workers failed, and the next round could not form: nodes of the round were
        lost, too many to go on. The report says so, before the gloo error it caused."""
        lost = tuple(self.handler.gone(failure.members))
        report = replace(failure.report, lost_nodes=lost)
        self._report(report, f"the next round could not form: {error}")

    def _ask_policy(self, failure: Failure, restarts: Restarts) -> tuple[int, str] | None:
        """Ask the restart policy about a failure with no node lost; sleep the delay it
        asks for. The agent's exit code and reason when it refuses (or a signal comes
        during the delay), else None: restart."""
        config = self.config
        policy = config.restart.item
        who = describe(RESTART_POLICIES, policy)
        try:
            decision = policy.decide(
                RestartRequest(
                    restarts_done=restarts.count,
                    max_restarts=config.max_restarts,
                    failure=failure.report.root,
                    options=config.restart_conf,
                    attempt_uptimes=tuple(restarts.uptimes),
                    stragglers=self._stragglers,
                )
            )
        except Exception as error:  # a plugin's: the job ends, cleanly, on every node
            return self._give_up(failure, plugin_failure(who, "decide", error, "the job stops"))
        if not isinstance(decision, RestartDecision):
            wrong = type(decision).__name__
            return self._give_up(
                failure, f"{who} returned {wrong} from decide, not a RestartDecision; the job stops"
            )
        if not decision.restart:
            return self._give_up(failure, decision.reason)
        said = f": {decision.reason}" if decision.reason else ""
        restarts.reason = f"restart policy {policy.name!r}{said}"
        logger.info(
            "%s; restart %d of %d%s (%s)",
            _root(failure.report),
            restarts.count + 1,
            config.max_restarts,
            f" in {decision.delay:.1f} s" if decision.delay else "",
            restarts.reason,
        )
        if self._sleep(decision.delay):
            assert self.signalled is not None
            return 128 + int(self.signalled), f"stopped by {self.signalled.name}"
        return None

    def _next_round(self) -> Assignment | None:
        """The next round; None when a signal comes first. The wait can be long (up to
        ``join_timeout``) and there are no workers to stop yet: a signal interrupts it, so
        that an agent told to stop (a pod deleted, a job cancelled) stops at once."""
        try:
            try:
                self._interruptible = self.signalled is None
                return self.handler.next_round() if self._interruptible else None
            finally:
                self._interruptible = False
        except _Interrupted:
            return None

    def _stop_on_signal(self, group: WorkerGroup) -> tuple[int, str]:
        """Forward the signal to the workers, give them the shutdown timeout, then kill."""
        assert self.signalled is not None
        if self.signalled is signal.SIGTERM:
            self._save_on_notice(group, told=True)
        logger.info(
            "received %s: stopping workers (%.0f s before SIGKILL)",
            self.signalled.name,
            self.config.shutdown_timeout,
        )
        group.stop(self.signalled, self.config.shutdown_timeout)
        group.finish_output()
        return 128 + int(self.signalled), f"stopped by {self.signalled.name}"

    def _save_on_notice(self, group: WorkerGroup, *, told: bool) -> None:
        """Before the workers stop for a new round: when a node of the round was told to
        stop (this one: ``told``) or a newcomer ended it, every worker saves at one step
        and holds there, so that the next round loses nothing. A node told to stop also
        sends its last save to its peer before it leaves. Bounded by --shutdown-timeout."""
        notice = self.notice
        if notice is None or not notice.watched(self._running_ranks(group)):
            return  # no checkpoints, or a script that never asks should_save
        began, reached = time.monotonic(), self.progress.step()
        if reached is None:
            return  # not one step yet: nothing to save
        several = self.config.max_nodes > 1
        proposal = notice_step(reached, self.progress.step_seconds(), several=several)
        if told:
            try:
                step = self.handler.give_notice(proposal)
            except RallypointError as error:  # the store out of reach: this node saves alone
                logger.warning("the other nodes were not given notice: %s", error)
                step = proposal
            logger.info("saving at step %d before this node stops (a save on notice)", step)
        else:
            noticed = self.handler.noticed(proposal)
            if noticed is None:
                return
            step = noticed
            logger.info("the round ends: saving at step %d before the workers stop", step)
        notice.give(step)
        timeout = self.config.shutdown_timeout
        late, held = notice.wait_held(step, lambda: self._running_ranks(group), timeout)
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

    @staticmethod
    def _running_ranks(group: WorkerGroup) -> list[int]:
        group.reap()
        return [w.spec.local_rank for w in group.running()]

    # --- workers ------------------------------------------------------------------------

    def _start_workers(
        self, assignment: Assignment, restarts: int, attempt: int, resume: int | None = None
    ) -> WorkerGroup:
        """Start this node's workers for ``assignment``; ``resume``: the memory checkpoint
        step every worker of the round loads (``NodeMemory.resume_step``)."""
        config = self.config
        attempt_dir = self.run_dir / f"attempt_{attempt}"
        environments = [
            worker_environment(
                config,
                assignment,
                local_rank,
                str(attempt_dir / str(local_rank) / "error.json"),
                node_id=self.node_id,
                restart_count=restarts,
                events_socket=self._worker_events.address,
                metrics_dir=None if self.metrics_dir is None else str(self.metrics_dir),
                checkpoint_memory=None if self.memory is None else str(self.memory.path),
                checkpoint_step=resume,
                save_notice=None if self.notice is None else str(self.notice.path),
            )
            for local_rank in range(config.nproc_per_node)
        ]
        logs = self._attempt_logs(attempt_dir, environments)  # --logs-specs may move files
        cpus = None
        if config.numa_binding:
            cpus = numa.bindings(
                config.numa_binding,
                config.nproc_per_node,
                numa.gpu_numa_nodes(os.environ),
                numa.Topology(),
            )
        specs = [
            WorkerSpec(
                local_rank,
                assignment.rank_offset + local_rank,
                environment,
                output,
                cpus[local_rank] if cpus else None,
            )
            for local_rank, (environment, output) in enumerate(
                zip(environments, logs.workers, strict=True)
            )
        ]
        now = time.monotonic()
        self.progress.watch(now)
        self.pace.reset()
        self._stragglers, self._named = (), False
        if self.watchdog is not None:
            self.watchdog.watch(now)
        self._oom_kills = cgroup_kills()  # a kill counted after this is one of ours
        if self.notice is not None:
            self.notice.reset()
        keeper = self._keeper()
        group = WorkerGroup.start(keeper, self.warm.spawn, specs, logs.filtered, config.role)
        self.warm.started(keeper)
        return group

    def _attempt_logs(self, attempt_dir: Path, environments: list[dict[str, str]]) -> AttemptLogs:
        """Where this attempt's output goes: rallypoint's layout, or --logs-specs's."""
        config = self.config
        filters = {STDOUT: config.duplicate_stdout_filters, STDERR: config.duplicate_stderr_filters}
        if config.logs_specs:
            if self._logs_specs is None:
                self._logs_specs = TorchLogsSpecs(
                    config.logs_specs,
                    config.log_dir,
                    config.redirects,
                    config.tee,
                    config.local_ranks_filter,
                )
            return self._logs_specs.attempt(environments, filters)
        return default_logs(
            attempt_dir,
            config.nproc_per_node,
            config.redirects,
            config.tee,
            config.local_ranks_filter,
            filters,
        )

    def _keeper(self) -> Keeper:
        """The keeper that starts this node's workers (``rallypoint.agent.keeper``); a new
        one if the last was killed (its workers died with it: a worker failure)."""
        if self._kept is not None and self._kept.gone:
            logger.warning("%s; starting a new one", self._kept.death())
            self._kept.close()
            self._kept = None
        if self._kept is None:
            self._kept = Keeper()
            if self.memory is not None:
                self._kept.own(str(self.memory.path))
            # The worker channel's socket, in a directory of its own: gone with the agent.
            self._kept.own(self._worker_events.directory)
            self.warm.prepare(self._kept)
        return self._kept

    def _monitor(self, group: WorkerGroup) -> Outcome:
        """Watch the workers until they all succeed, one fails, a node arrives or a signal."""
        while True:
            if self.signalled is not None:
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
            self._report_progress(group)
            timeout = self.config.monitor_interval
            if self.watchdog is not None:
                ranks = [w.spec.local_rank for w in group.running()]
                timeout = min(timeout, self.watchdog.seconds_left(ranks, time.monotonic()))
            group.wait(timeout, self._wake_read.fileno())
            self._drain_wakeups()

    def _report_progress(self, group: WorkerGroup, *, final: bool = False) -> None:
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
        self._stragglers = tuple(sorted(found))
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

    def _handle_failure(self, group: WorkerGroup, restarts: int) -> FailureReport:
        """Stop the surviving workers, then announce and describe what failed.

        A worker that has printed a traceback but not exited yet (still finalising) is
        failing too, and may be the root cause: it gets a moment to exit on its own, so
        that its own exit code, not our SIGTERM, is reported.
        """
        detected = time.time()  # the failure noticed: its detection ends, the restart begins
        exited = [w for w in group.workers if w.returncode not in (None, 0)]
        first = min((_failed_at(w, math.inf) for w in exited), default=math.inf)
        # One whose traceback began after the first failure is its consequence (a peer
        # lost): it is stopped at once, not waited for.
        failing = [
            w for w in group.running() if w.traceback_seen is not None and w.traceback_seen <= first
        ]
        deadline = time.monotonic() + FINALISING_GRACE
        while any(w.exited is None for w in failing) and time.monotonic() < deadline:
            group.wait(deadline - time.monotonic())
            group.reap()
        failed = [w for w in group.workers if w.returncode not in (None, 0) or w in failing]
        group.stop(signal.SIGTERM, self.config.shutdown_timeout)
        group.finish_output()
        now_wall, now_mono = time.time(), time.monotonic()
        killed = [w.pid for w in failed if w.returncode == -signal.SIGKILL and not w.stalled_since]
        oom = oom_killed(killed, self._oom_kills)
        failures = [
            failure_of(w, now_wall - (now_mono - _failed_at(w, now_mono)), w.pid in oom)
            for w in failed
        ]
        report = build_report(
            group.workers,
            failures,
            run_id=self.config.rdzv_id,
            restart_count=restarts,
            max_restarts=self.config.max_restarts,
        )
        for failure in sorted(failures, key=lambda f: (f is not report.root, f.timestamp)):
            self.bus.emit(events.WORKER_FAILED, failure, detected=detected)  # root cause first
        return report

    def _report(self, report: FailureReport, reason: str) -> None:
        path = self.run_dir / "failure.json"
        report.write(path)
        if self._parent_error_file:
            report.write_parent_error_file(self._parent_error_file)
        logger.error(
            "%s\n  not restarted: %s\n  failure report: %s", report.summary(), reason, path
        )

    # --- signals ------------------------------------------------------------------------

    def _install_signal_handlers(self) -> dict[signal.Signals, Any]:
        previous: dict[signal.Signals, Any] = {}
        for name in self.config.signals_to_handle:
            sig = signal.Signals[name]
            try:
                previous[sig] = signal.signal(sig, self._on_signal)
            except (OSError, ValueError):  # not in the main thread, or not catchable
                continue
        return previous

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled is None:
            self.signalled = signal.Signals(signum)
        with contextlib.suppress(OSError):
            self._wake_write.send(b"\0")
        if self._interruptible:
            self._interruptible = False  # once: the way out (leaving the store) runs on
            raise _Interrupted()

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_read.recv(64):
                pass
        except (BlockingIOError, OSError):
            pass

    def _sleep(self, seconds: float) -> bool:
        """Sleep, waking early on a signal; return whether a signal arrived (before or during)."""
        deadline = time.monotonic() + seconds
        while self.signalled is None and time.monotonic() < deadline:
            select.select([self._wake_read], [], [], max(0.0, deadline - time.monotonic()))
            self._drain_wakeups()
        return self.signalled is not None

    # --- the end of a job, a plugin's failure included ----------------------------------

    def _give_up(self, failure: Failure, reason: str) -> tuple[int, str]:
        """The workers failed and are not restarted, for ``reason``: report it, make the
        job's other nodes stop too, and return the agent's exit code and reason."""
        root = _root(failure.report)
        self._report(failure.report, reason)
        if self.config.max_nodes > 1:
            self.handler.fail(f"{root}; {reason}")  # the other nodes stop too
        return EXIT_WORKER_FAILURE, f"{root}; {reason}"

    def _workers_restarted(self, restarts: Restarts, cause: str) -> None:
        """The ``workers_restarted`` event; its ``reason`` is the restart policy's after a
        failure, else that the job's nodes changed."""
        reason = restarts.reason if cause == FAILURE else "the job's nodes changed"
        self.bus.emit(
            events.WORKERS_RESTARTED, restart_count=restarts.count, cause=cause, reason=reason
        )


def _root(report: FailureReport) -> str:
    return f"rank {report.root.rank} {describe_failure(report.root)}"


def _failed_at(worker: Worker, default: float) -> float:
    """When a worker failed (monotonic): its last heartbeat when the watchdog killed it,
    else its first traceback line, else its exit."""
    if worker.stalled_since is not None:
        return worker.stalled_since
    times = [t for t in (worker.traceback_seen, worker.exited) if t is not None]
    return min(times, default=default)


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

"""This node's worker groups: starting one for a round, and describing how one failed.

Workers start through the keeper (``rallypoint.agent.processes.keeper``), warm or cold
(``processes.warm``), each with its environment, its output routed for the attempt
(``processes.worker_logs``) and its CPUs (``--numa-binding``). When one fails, the rest are
stopped and the failure is described, root cause first (``rallypoint.agent.monitoring.failures``).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from rallypoint import events
from rallypoint.agent.checkpoints.save_notice import SaveNotice
from rallypoint.agent.monitoring.eventbus import EventBus
from rallypoint.agent.monitoring.failures import FailureReport, build_report, failure_of
from rallypoint.agent.processes import numa
from rallypoint.agent.processes.environment import worker_environment
from rallypoint.agent.processes.keeper import Keeper
from rallypoint.agent.processes.oom import cgroup_kills, oom_killed
from rallypoint.agent.processes.warm import WarmStart
from rallypoint.agent.processes.worker_logs import (
    STDERR,
    STDOUT,
    AttemptLogs,
    TorchLogsSpecs,
    default_logs,
)
from rallypoint.agent.processes.workers import Worker, WorkerGroup, WorkerSpec
from rallypoint.config import LaunchConfig
from rallypoint.interfaces import Assignment
from rallypoint.worker.channel import Receiver

logger = logging.getLogger("rallypoint.agent")

#: Seconds a worker that printed a traceback gets to exit on its own after a peer failed.
FINALISING_GRACE = 2.0


class WorkerSupervisor:
    """Starts this node's workers for each attempt, and stops and describes them on a failure.

    What the workers are handed comes from the agent: the worker channel (``receiver``),
    the metrics directory, the node memory's path and the save-notice file, when there are.
    """

    def __init__(
        self,
        config: LaunchConfig,
        node_id: str,
        run_dir: Path,
        bus: EventBus,
        receiver: Receiver,
        *,
        metrics_dir: Path | None,
        memory_path: Path | None,
        notice: SaveNotice | None,
        interrupted: Callable[[], bool],
    ) -> None:
        self.config = config
        self.node_id = node_id
        self.run_dir = run_dir
        self.bus = bus
        self.receiver = receiver
        self.metrics_dir = metrics_dir
        self.memory_path = memory_path
        self.notice = notice
        self.warm = WarmStart(config, interrupted)
        self._kept: Keeper | None = None  # started with the first rendezvous: see keeper
        self._oom_kills: int | None = None  # the memory cgroup's OOM kills at the last start
        self._logs_specs: TorchLogsSpecs | None = None  # --logs-specs's class, made once

    def getting_ready(self) -> str | None:
        """What this node still does to start warm workers at once; None when ready."""
        return self.warm.getting_ready(self.keeper())

    def start(
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
                events_socket=self.receiver.address,
                metrics_dir=None if self.metrics_dir is None else str(self.metrics_dir),
                memory_tier_dir=None if self.memory_path is None else str(self.memory_path),
                checkpoint_step=resume,
                save_notice=None if self.notice is None else str(self.notice.path),
                stacks_file=str(_stacks_file(attempt_dir, local_rank)),
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
        self._oom_kills = cgroup_kills()  # a kill counted after this is one of ours
        if self.notice is not None:
            self.notice.reset()
        keeper = self.keeper()
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

    def keeper(self) -> Keeper:
        """The keeper that starts this node's workers (``rallypoint.agent.processes.keeper``); a new
        one if the last was killed (its workers died with it: a worker failure)."""
        if self._kept is not None and self._kept.gone:
            logger.warning("%s; starting a new one", self._kept.death())
            self._kept.close()
            self._kept = None
        if self._kept is None:
            self._kept = Keeper()
            if self.memory_path is not None:
                self._kept.own(str(self.memory_path))
            # The worker channel's socket, in a directory of its own: gone with the agent.
            self._kept.own(self.receiver.directory)
            self.warm.prepare(self._kept)
        return self._kept

    def release(self) -> None:
        """The agent stops: whatever the workers left running goes with the keeper."""
        if self._kept is not None:
            self._kept.release()

    def close(self) -> None:
        """After ``release``: the keeper is gone by now, or nearly."""
        if self._kept is not None:
            self._kept.close()

    def failure(self, group: WorkerGroup, restarts: int) -> FailureReport:
        """Stop the surviving workers, then announce and describe what failed.

        A worker that has printed a traceback but not exited yet (still finalising) is
        failing too, and may be the root cause: it gets a moment to exit on its own, so
        that its own exit code, not our SIGTERM, is reported.
        """
        detected = time.time()  # the failure noticed: its detection ends, the restart begins
        failed = self._failed_workers(group)
        group.stop(signal.SIGTERM, self.config.shutdown_timeout)
        group.finish_output()
        now_wall, now_mono = time.time(), time.monotonic()
        killed = [w.pid for w in failed if w.returncode == -signal.SIGKILL and not w.stalled_since]
        oom = oom_killed(killed, self._oom_kills)
        failures = [
            failure_of(w, now_wall - (now_mono - failed_at(w, now_mono)), w.pid in oom)
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

    @staticmethod
    def _failed_workers(group: WorkerGroup) -> list[Worker]:
        """The workers that failed, once those still finalising (a traceback printed before
        the first failure) exited, or had FINALISING_GRACE to."""
        exited = [w for w in group.workers if w.returncode not in (None, 0)]
        first = min((failed_at(w, math.inf) for w in exited), default=math.inf)
        # One whose traceback began after the first failure is its consequence (a peer
        # lost): it is stopped at once, not waited for.
        failing = [
            w for w in group.running() if w.traceback_seen is not None and w.traceback_seen <= first
        ]
        deadline = time.monotonic() + FINALISING_GRACE
        while any(w.exited is None for w in failing) and time.monotonic() < deadline:
            group.wait(deadline - time.monotonic())
            group.reap()
        return [w for w in group.workers if w.returncode not in (None, 0) or w in failing]


def failed_at(worker: Worker, default: float) -> float:
    """When a worker failed (monotonic): its last progress signal when it was killed for a
    hang, else its first traceback line, else its exit."""
    if worker.stalled_since is not None:
        return worker.stalled_since
    times = [t for t in (worker.traceback_seen, worker.exited) if t is not None]
    return min(times, default=default)


def _stacks_file(attempt_dir: Path, local_rank: int) -> Path:
    """Where a worker's faulthandler writes its stacks when asked (``monitoring.stacks``):
    beside its error file, in a directory made now, since the worker only appends."""
    folder = attempt_dir / str(local_rank)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "stacks.txt"

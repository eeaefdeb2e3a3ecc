"""Warm start: workers forked from an interpreter that has already imported torch.

The keeper starts the preloaded interpreter (``rallypoint.agent.processes.zygote``) when the agent
starts, so that its imports run while the rendezvous does: torch and rallypoint when the
worker's program imports them (``rallypoint.agent.processes.preload``), and every ``--preload``
module. It lives as long
as the keeper, so every restart forks from it at once. A worker starts cold (a fresh interpreter, as
torchrun starts it) when warm start is off (``--warm-start off``), when there is no Python
to preload (``--no-python``), when the preload failed or took longer than
``READY_TIMEOUT``, when the preloaded interpreter refuses to fork (CUDA initialised, threads
running), and when a worker's environment differs from the one the modules were imported
with in anything but the variables set per worker (``PER_WORKER``); each reason is said
once. If the preloaded interpreter dies (the kernel's OOM killer picks the largest
process), the next group starts cold and a new one is prepared for the restart after it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from rallypoint.agent.processes import zygote
from rallypoint.agent.processes.environment import PER_WORKER, WorkerCommand, job_environment
from rallypoint.agent.processes.keeper import Keeper, WarmRefused
from rallypoint.agent.processes.preload import imported
from rallypoint.agent.processes.workers import WorkerSpec
from rallypoint.config import LaunchConfig
from rallypoint.worker import variables
from rallypoint.worker.progress_sources import cold_start_environment

logger = logging.getLogger("rallypoint.agent")

PROGRESS_SOURCES = "rallypoint.worker.progress_sources"

#: Seconds the first workers wait for the preloaded interpreter's imports before they
#: start cold (a module that hangs when imported must not hang the job).
READY_TIMEOUT = 120.0


class WarmStart:
    """How this agent starts each worker: forked warm, or cold."""

    def __init__(
        self,
        config: LaunchConfig,
        interrupted: Callable[[], bool] = lambda: False,
        ready_timeout: float = READY_TIMEOUT,
    ) -> None:
        self.command = command = WorkerCommand.of(config)
        self.argv = command.argv()  # a cold worker's, and what ps shows of a warm one
        self.env = job_environment(config)
        self.interrupted = interrupted
        self.ready_timeout = ready_timeout
        self.off: str | None = None  # why no worker of this run starts warm
        self.preload: tuple[str, ...] = ()
        if not config.warm_start:
            self.off = "warm start is off (--warm-start off)"
        elif command.kind == "program":
            self.off = "--no-python runs a program, which cannot be preloaded"
        else:
            self.path0 = command.path0()
            found = imported(command.target, self.path0, module=command.kind == "module")
            self.preload = tuple(dict.fromkeys((*found, *config.preload)))
        # Installed in each worker after the fork: imported once, here (never named in
        # what the agent says it imports: it is rallypoint's, not the job's).
        self._own = (PROGRESS_SOURCES,) if config.progress_reports else ()
        self._said: set[str] = set()

    def prepare(self, keeper: Keeper) -> None:
        """Have ``keeper`` start the preloaded interpreter (it imports in the background)."""
        if self.off is None:
            folder = os.path.dirname(zygote.__file__)
            argv = [sys.executable, "-u", "-c", zygote.BOOT, self.path0, folder]
            shown = len("\0".join(self.argv)) + 1  # each worker writes it there
            keeper.prepare([*argv, ",".join((*self.preload, *self._own)), " " * shown], self.env)

    def getting_ready(self, keeper: Keeper) -> str | None:
        """What the preloaded interpreter still does before workers can fork from it; None
        once it is ready (or failed: workers then start cold, or there is none)."""
        if self.off is not None:
            return None
        keeper.pump()  # its news so far
        if keeper.warm != "preparing":
            return None
        return f"importing {', '.join(self.preload)}" if self.preload else "starting Python"

    def spawn(self, keeper: Keeper, spec: WorkerSpec, stdout: int, stderr: int) -> int:
        """Start the worker of ``spec``, writing to ``stdout`` and ``stderr``; its pid.
        ``OSError`` when a cold one cannot be executed."""
        worker = self._warm_request(keeper, spec)
        if worker is not None:
            try:
                return keeper.spawn_warm(worker, stdout, stderr, spec.cpus)
            except WarmRefused as refused:
                if not refused.gone:  # for good: this interpreter will never fork
                    keeper.warm, keeper.warm_reason = "failed", str(refused)
                elif keeper.warm != "died":  # its death is news yet to come: prepared again
                    keeper.warm, keeper.warm_reason = "died", str(refused)
                level = logging.INFO if refused.gone else logging.WARNING
                self._say(keeper.warm_reason, level)
        environ = dict(spec.env)
        # What the fork does for a warm worker (zygote), a cold one's sitecustomize does.
        # Here, not in worker_environment: a PYTHONPATH of its own would make every worker's
        # environment differ from the preloaded interpreter's, so none would start warm.
        # Not for --no-python: every Python the program starts would take it up.
        if variables.PROGRESS_REPORTS in environ and self.command.kind != "program":
            environ = cold_start_environment(environ)
        return keeper.spawn(self.argv, environ, stdout, stderr, spec.cpus)

    def started(self, keeper: Keeper) -> None:
        """After a group started: a preloaded interpreter that died is prepared again, in
        the background, for the next restart."""
        if keeper.warm == "died" and self.off is None:
            self.prepare(keeper)

    def _warm_request(self, keeper: Keeper, spec: WorkerSpec) -> dict[str, Any] | None:
        """What the preloaded interpreter needs to fork this worker; None: start it cold."""
        if self.off is not None:
            self._say(self.off, logging.INFO)
            return None
        self._wait(keeper)
        if keeper.warm != "ready":
            level = logging.INFO if keeper.warm == "died" else logging.WARNING
            self._say(keeper.warm_reason, level)
            return None
        changed = {k: v for k, v in spec.env.items() if self.env.get(k) != v}
        unset = [k for k in self.env if k not in spec.env]
        suspect = sorted(k for k in [*changed, *unset] if k not in PER_WORKER)
        if suspect:
            self._say(
                f"the environment of worker {spec.local_rank} differs from the one the "
                f"preloaded modules were imported with ({', '.join(suspect)})",
                logging.WARNING,
            )
            return None
        command = self.command
        return {
            "kind": command.kind,
            "target": command.target,
            "args": list(command.args),
            "argv": self.argv,  # what ps shows
            "set": changed,
            "unset": unset,
        }

    def _wait(self, keeper: Keeper) -> None:
        """Until the preloaded interpreter is ready or not, bounded by ``ready_timeout``."""
        deadline = time.monotonic() + self.ready_timeout
        while keeper.warm == "preparing" and not self.interrupted():
            left = deadline - time.monotonic()
            if left <= 0:
                keeper.discard_warm(
                    f"importing {', '.join(self.preload)} took more than "
                    f"{self.ready_timeout:g} s; the preloaded interpreter was stopped"
                )
                return
            keeper.pump(min(left, 0.2))

    def _say(self, reason: str, level: int) -> None:
        if reason not in self._said:
            self._said.add(reason)
            logger.log(level, "%s: workers start cold", reason)

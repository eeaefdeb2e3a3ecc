"""Worker processes: start them, route their output, notice when they end, stop them.

Workers never outlive the agent: each is started with ``PR_SET_PDEATHSIG`` = SIGKILL (the
kernel kills it if the agent dies, even by SIGKILL) and in a session of its own, so that
stopping a worker reaches every process it started. Exits are noticed through pidfds the
moment they happen, not by a polling sleep.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rallypoint.agent.environment import WorkerSpec
from rallypoint.lifetime import die_with_parent

logger = logging.getLogger("rallypoint.agent")

_TAIL_LINES = 60
_STDOUT, _STDERR = 1, 2


@dataclass(frozen=True)
class OutputRule:
    """Where one worker's output goes (torchrun's ``--redirects``, ``--tee``, filter)."""

    console: int  # streams shown on the console, prefixed: bit 1 stdout, bit 2 stderr
    files: int  # streams written to files in the worker's log directory


def output_rule(
    local_rank: int, redirects: dict[int, int], tee: dict[int, int], shown: bool
) -> OutputRule:
    """The rule for ``local_rank``: redirected streams leave the console, teed ones stay
    (tee wins where both name a stream, as in torchrun)."""
    redirect = redirects.get(local_rank, redirects.get(-1, 0))
    copy = tee.get(local_rank, tee.get(-1, 0))
    console = ((_STDOUT | _STDERR) & ~redirect | copy) if shown else 0
    return OutputRule(console=console, files=redirect | copy)


@dataclass
class Worker:
    """One running (or finished) worker process."""

    spec: WorkerSpec
    process: subprocess.Popen[bytes]
    started: float
    pidfd: int | None = None
    exited: float | None = None  # monotonic time of the exit, as precise as we can tell
    exit_seen: float | None = None  # set by the watcher thread the moment the process exits
    traceback_seen: float | None = None  # when it began printing a Python traceback
    # Set when the progress watchdog killed it: its last heartbeat (monotonic), and for how
    # long it had been silent then.
    stalled_since: float | None = None
    stalled_for: float | None = None
    stderr_tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=_TAIL_LINES)
    )
    pumps: list[threading.Thread] = field(default_factory=list)
    watcher: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode


class _Console:
    """Serialises prefixed lines from many workers onto the agent's stdout and stderr."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def write(self, stream: IO[bytes], data: bytes) -> None:
        with self.lock:
            stream.write(data)
            stream.flush()


_console = _Console()


_TRACEBACK = b"Traceback (most recent call last)"


def _pump(
    source: IO[bytes],
    prefix: bytes,
    console: IO[bytes] | None,
    file_path: Path | None,
    worker: Worker | None,
) -> None:
    """Copy one worker stream line by line to the console (prefixed), a file and, for
    stderr (``worker`` given), the worker's tail and the time its first traceback began."""
    sink = open(file_path, "ab") if file_path else None  # noqa: SIM115 - closed below
    tail = worker.stderr_tail if worker is not None else None
    try:
        for line in iter(source.readline, b""):
            if worker is not None and worker.traceback_seen is None and _TRACEBACK in line:
                worker.traceback_seen = time.monotonic()
            if console is not None:
                _console.write(console, prefix + line)
            if sink is not None:
                sink.write(line)
                sink.flush()
            if tail is not None:
                tail.append(line.decode("utf-8", "replace"))
    except (OSError, ValueError):
        pass  # the agent is going away; the worker dies with it
    finally:
        source.close()
        if sink is not None:
            sink.close()


class WorkerGroup:
    """The workers of this node for one attempt."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.workers = list(workers)

    @classmethod
    def start(
        cls,
        command: Sequence[str],
        specs: Sequence[WorkerSpec],
        environments: Sequence[dict[str, str]],
        rules: Sequence[OutputRule],
        log_dirs: Sequence[Path],
        role: str,
    ) -> WorkerGroup:
        """Start one process per spec, each with its environment and output rule."""
        agent_pid = os.getpid()
        workers: list[Worker] = []
        try:
            for spec, env, rule, log_dir in zip(specs, environments, rules, log_dirs, strict=True):
                Path(spec.error_file).parent.mkdir(parents=True, exist_ok=True)
                if rule.files:
                    log_dir.mkdir(parents=True, exist_ok=True)
                process = subprocess.Popen(
                    list(command),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=lambda: die_with_parent(agent_pid),
                )
                worker = Worker(spec, process, time.monotonic())
                worker.pidfd = _pidfd(process.pid)
                if worker.pidfd is not None:
                    # Exit times decide the root cause when workers die moments apart.
                    worker.watcher = threading.Thread(
                        target=_watch_exit, args=(worker,), daemon=True
                    )
                    worker.watcher.start()
                prefix = f"[{role}{spec.local_rank}]:".encode()
                for bit, pipe, console, name in (
                    (_STDOUT, process.stdout, sys.stdout.buffer, "stdout.log"),
                    (_STDERR, process.stderr, sys.stderr.buffer, "stderr.log"),
                ):
                    assert pipe is not None
                    pump = threading.Thread(
                        target=_pump,
                        args=(
                            pipe,
                            prefix,
                            console if rule.console & bit else None,
                            log_dir / name if rule.files & bit else None,
                            worker if bit == _STDERR else None,
                        ),
                        name=f"rallypoint-{name[:6]}-{spec.local_rank}",
                        daemon=True,
                    )
                    pump.start()
                    worker.pumps.append(pump)
                workers.append(worker)
        except BaseException:
            WorkerGroup(workers).stop(signal.SIGKILL, 0)
            raise
        return cls(workers)

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(worker.pid for worker in self.workers)

    def reap(self) -> list[Worker]:
        """Collect workers that have ended; return those that ended since the last call."""
        ended = []
        now = time.monotonic()
        for worker in self.workers:
            if worker.exited is None and worker.process.poll() is not None:
                worker.exited = worker.exit_seen or now
                ended.append(worker)
        return ended

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.exited is None]

    def wait(self, timeout: float, wakeup_fd: int | None = None) -> None:
        """Block until a worker ends, ``wakeup_fd`` is readable, or ``timeout`` passes."""
        poller = select.poll()
        watched = False
        for worker in self.running():
            if worker.pidfd is not None:
                poller.register(worker.pidfd, select.POLLIN)
                watched = True
        if wakeup_fd is not None:
            poller.register(wakeup_fd, select.POLLIN)
        if not watched:
            # No pidfds (old kernel): fall back to polling at the given interval.
            timeout = min(timeout, 0.1)
        with contextlib.suppress(InterruptedError):
            poller.poll(max(0.0, timeout) * 1000)

    def stop(self, sig: signal.Signals, timeout: float) -> None:
        """Send ``sig`` to every worker's process group, wait ``timeout``, then SIGKILL."""
        for worker in self.running():
            _signal_group(worker.pid, sig)
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            self.reap()
            if self.running():
                self.wait(min(0.05, deadline - time.monotonic()))
        stubborn = self.running()
        if stubborn and sig != signal.SIGKILL:
            logger.warning(
                "worker pid %s did not exit within %g s of %s: killing it with SIGKILL",
                ", ".join(str(w.pid) for w in stubborn),
                timeout,
                sig.name,
            )
        for worker in self.workers:
            # Also reaches processes a worker started that are still in its group.
            _signal_group(worker.pid, signal.SIGKILL)
        for worker in self.workers:
            # SIGKILL cannot be ignored; the bound only guards against a stuck kernel.
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=5)
        self.reap()
        self.close()

    def kill(self, workers: Sequence[Worker]) -> None:
        """SIGKILL the process groups of ``workers`` at once and reap them (a stuck worker
        gets no chance to clean up: it may not react to anything else)."""
        for worker in workers:
            _signal_group(worker.pid, signal.SIGKILL)
        for worker in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=5)
        self.reap()

    def finish_output(self, workers: Sequence[Worker] | None = None, timeout: float = 10.0) -> None:
        """Wait, bounded, for the output of ended workers (default: all) to be copied out.

        The bound only matters when a process the worker started still holds its pipes.
        """
        deadline = time.monotonic() + timeout
        for worker in self.workers if workers is None else workers:
            for pump in worker.pumps:
                pump.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        for worker in self.workers:
            if worker.watcher is not None:
                worker.watcher.join(5)  # the process has exited: the watcher returns at once
            if worker.pidfd is not None:
                os.close(worker.pidfd)
                worker.pidfd = None


def _watch_exit(worker: Worker) -> None:
    """Wait for the worker to exit, without reaping it, and note the time."""
    assert worker.pidfd is not None
    try:
        os.waitid(os.P_PIDFD, worker.pidfd, os.WEXITED | os.WNOWAIT)
    except (OSError, AttributeError):
        return
    worker.exit_seen = time.monotonic()


def _pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:
        return None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)

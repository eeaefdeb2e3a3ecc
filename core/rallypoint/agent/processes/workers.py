"""Worker processes: start them, route their output, notice when they end, stop them.

Workers never outlive the agent, nor does anything they start: the agent's keeper
(``rallypoint.agent.processes.keeper``) forks them, each in a session of its own and with
``PR_SET_PDEATHSIG``, and as a subreaper it kills every process they leave behind when a
group stops and when the agent dies. Exits are reported by the keeper the moment they
happen, not found by a polling sleep.

A stream that goes to the console of an agent whose own stream is a terminal is a
pseudo-terminal of its own (one per worker and stream), as under torchrun, whose workers
write to the terminal directly: progress bars animate and logs keep their colours. Its
output is copied as it comes, each line prefixed; other streams are pipes, copied line by
line.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rallypoint.agent.processes.keeper import Keeper, KeeperGone, KeptProcess
from rallypoint.agent.processes.worker_logs import STDERR, STDOUT, WorkerLogs
from rallypoint.errors import RallypointError

logger = logging.getLogger("rallypoint.agent")

_TAIL_LINES = 60
#: Seconds that the processes stopped workers left running (``multiprocessing``'s resource
#: tracker and fork server, a data loader's workers) get between SIGTERM and SIGKILL.
HELPER_GRACE = 2.0


@dataclass(frozen=True)
class WorkerSpec:
    """One worker of an attempt: its place in the job and everything it is started with.

    Attributes:
        local_rank, rank: its place on the node and in the job.
        env: its whole environment (``rallypoint.agent.processes.environment``).
        output: where its output goes (``rallypoint.agent.processes.worker_logs``).
        cpus: the CPUs it may run on (``--numa-binding``); None: any.
    """

    local_rank: int
    rank: int
    env: Mapping[str, str]
    output: WorkerLogs
    cpus: frozenset[int] | None = None

    @property
    def error_file(self) -> str:
        return self.output.error_file


#: Starts one worker through the keeper, writing to the two descriptors; its pid.
Spawn = Callable[[Keeper, WorkerSpec, int, int], int]


@dataclass
class Worker:
    """One running (or finished) worker process."""

    spec: WorkerSpec
    process: KeptProcess
    started: float
    exited: float | None = None  # monotonic time of the exit, as the keeper saw it
    traceback_seen: float | None = None  # when it began printing a Python traceback
    # Set when it was killed for a hang (or by the watchdog): its last progress signal
    # (monotonic), for how long it had made none then, and the hang's sentence.
    stalled_since: float | None = None
    stalled_for: float | None = None
    hang: str | None = None
    stack: str | None = None  # its main thread's stack then, as a traceback
    stderr_tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=_TAIL_LINES)
    )
    pumps: list[threading.Thread] = field(default_factory=list)

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


class _Filtered:
    """An attempt's ``filtered_stdout.log`` or ``filtered_stderr.log``: the prefixed lines
    of teed streams that contain one of the ``--duplicate-*-filters`` strings, from every
    worker, as torchrun writes them."""

    def __init__(self, path: Path, needles: Sequence[str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "wb")  # noqa: SIM115 - closed with the group
        self.needles = [needle.encode() for needle in needles]
        self.lock = threading.Lock()

    def offer(self, prefix: bytes, line: bytes) -> None:
        if any(needle in line for needle in self.needles):
            with self.lock:
                self.file.write(prefix + line + b"\n")
                self.file.flush()


_TRACEBACK = b"Traceback (most recent call last)"
#: Terminal control sequences (colours, cursor moves), left out of the failure report.
_ESCAPES = re.compile(rb"\x1b(\[[0-9;?]*[ -/]*[@-~]|[@-Z\\-_])")
#: What ends a line on a terminal, or sends the cursor back to redraw it (a progress bar).
_LINE_ENDS = re.compile(rb"(\r\n|\n|\r)")


@dataclass
class _Stream:
    """One worker stream as the agent reads it, and where its bytes go."""

    source: int  # the read end: a pipe, or a pseudo-terminal's master
    prefix: bytes
    console: IO[bytes] | None
    file_path: Path | None
    worker: Worker | None  # given for stderr: its tail and traceback time are kept
    live: bool  # a pseudo-terminal: copied as it comes, not line by line
    filtered: _Filtered | None = None  # a teed stream's matching lines are copied there


def _pump(stream: _Stream) -> None:
    """Copy one worker stream to the console (prefixed), a file and, for stderr, the
    worker's tail and the time its first traceback began."""
    sink = open(stream.file_path, "ab") if stream.file_path else None  # noqa: SIM115
    pending = b""  # the line being read, for the tail and the traceback's time
    at_line_start = True
    try:
        while chunk := _read(stream.source):
            *lines, pending = (pending + chunk).split(b"\n")
            if stream.console is not None:
                if stream.live:
                    out, at_line_start = _prefixed(chunk, stream.prefix, at_line_start)
                    _console.write(stream.console, out)
                else:
                    for line in lines:
                        _console.write(stream.console, stream.prefix + line + b"\n")
            if sink is not None:
                sink.write(chunk)
                sink.flush()
            for line in lines:
                _note(stream, line)
        if pending:
            if stream.console is not None and not stream.live:
                _console.write(stream.console, stream.prefix + pending + b"\n")
            _note(stream, pending)
        elif stream.live and not at_line_start and stream.console is not None:
            _console.write(stream.console, b"\n")
    except (OSError, ValueError):
        pass  # the agent is going away; the worker dies with it
    finally:
        os.close(stream.source)
        if sink is not None:
            sink.close()


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: every holder of the pseudo-terminal's other end has closed it
        return b""


def _prefixed(chunk: bytes, prefix: bytes, at_line_start: bool) -> tuple[bytes, bool]:
    """``chunk`` with ``prefix`` at the start of every line, also of a line redrawn after a
    carriage return; and whether the next chunk starts a line."""
    out = []
    for piece in _LINE_ENDS.split(chunk):
        if not piece:
            continue
        if _LINE_ENDS.fullmatch(piece):
            out.append(piece)
            at_line_start = True
            continue
        if at_line_start:
            out.append(prefix)
        out.append(piece)
        at_line_start = False
    return b"".join(out), at_line_start


def _note(stream: _Stream, line: bytes) -> None:
    """What a whole line tells: duplicated if it matches a filter; for stderr, the tail."""
    if stream.filtered is not None:
        stream.filtered.offer(stream.prefix, line.rstrip(b"\r"))
    if stream.worker is not None:
        _note_stderr(stream.worker, line)


def _note_stderr(worker: Worker, line: bytes) -> None:
    if worker.traceback_seen is None and _TRACEBACK in line:
        worker.traceback_seen = time.monotonic()
    # What a terminal would show: the text after the last carriage return, no escapes.
    shown = _ESCAPES.sub(b"", line.rstrip(b"\r").rsplit(b"\r", 1)[-1])
    worker.stderr_tail.append(shown.decode("utf-8", "replace") + "\n")


def _open_stream(terminal: IO[bytes] | None, prefix: bytes) -> tuple[int, int, bool]:
    """A (read end, write end, live) pair for one worker stream: a pseudo-terminal when
    ``terminal`` (the agent's stream it goes to) is one, else a pipe."""
    if terminal is not None and _isatty(terminal):
        master, slave = os.openpty()
        attributes = termios.tcgetattr(slave)
        attributes[1] &= ~termios.OPOST  # "\n" stays "\n", as written
        termios.tcsetattr(slave, termios.TCSANOW, attributes)
        size = _terminal_size(terminal)
        if size is not None and size[1] > len(prefix):  # the prefix takes part of each line
            rows, columns = size
            packed = struct.pack("HHHH", rows, columns - len(prefix), 0, 0)
            fcntl.ioctl(slave, termios.TIOCSWINSZ, packed)
        os.set_inheritable(master, False)
        return master, slave, True
    read, write = os.pipe()
    return read, write, False


def _isatty(stream: IO[bytes]) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):
        return False


def _terminal_size(stream: IO[bytes]) -> tuple[int, int] | None:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError):
        return None
    return size.lines, size.columns


class WorkerGroup:
    """The workers of this node for one attempt."""

    def __init__(self, workers: Sequence[Worker], keeper: Keeper) -> None:
        self.workers = list(workers)
        self.keeper = keeper
        self._filtered: dict[int, _Filtered] = {}

    @classmethod
    def start(
        cls,
        keeper: Keeper,
        spawn: Spawn,
        specs: Sequence[WorkerSpec],
        filtered: Mapping[int, tuple[Path, tuple[str, ...]]],
        role: str,
    ) -> WorkerGroup:
        """Start one process per spec with ``spawn`` (``WarmStart.spawn``); ``filtered``:
        the attempt's file of duplicated lines and the strings they contain, by stream
        (``AttemptLogs.filtered``)."""
        group = cls([], keeper)
        try:
            group._filtered = {
                stream: _Filtered(path, needles) for stream, (path, needles) in filtered.items()
            }
            for spec in specs:
                Path(spec.error_file).parent.mkdir(parents=True, exist_ok=True)
                group.workers.append(group._start_one(spawn, spec, role))
        except BaseException:
            group.stop(signal.SIGKILL, 0)
            raise
        return group

    def _start_one(self, spawn: Spawn, spec: WorkerSpec, role: str) -> Worker:
        output = spec.output
        prefix = f"[{role}{spec.local_rank}]:".encode()
        streams = []
        ends: list[int] = []
        try:
            for bit, console in ((STDOUT, sys.stdout.buffer), (STDERR, sys.stderr.buffer)):
                shown = console if output.console & bit else None
                read, write, live = _open_stream(shown, prefix)
                ends += [read, write]
                path = output.file(bit)
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                filtered = self._filtered.get(bit) if output.teed & bit else None
                streams.append((read, write, live, shown, path, filtered))
            try:
                pid = spawn(self.keeper, spec, streams[0][1], streams[1][1])
            except OSError as error:
                raise RallypointError(
                    f"cannot start worker {spec.local_rank}: {error.filename!r}: {error.strerror}"
                ) from None
            except KeeperGone as gone:
                raise RallypointError(str(gone)) from None
        except BaseException:
            for fd in ends:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        worker = Worker(spec, KeptProcess(self.keeper, pid), time.monotonic())
        for (read, write, live, shown, path, filtered), bit in zip(
            streams, (STDOUT, STDERR), strict=True
        ):
            os.close(write)  # the worker holds it now: its exit ends the stream
            stream = _Stream(
                read, prefix, shown, path, worker if bit == STDERR else None, live, filtered
            )
            pump = threading.Thread(
                target=_pump,
                args=(stream,),
                name=f"rallypoint-{'stdout' if bit == STDOUT else 'stderr'}-{spec.local_rank}",
                daemon=True,
            )
            pump.start()
            worker.pumps.append(pump)
        return worker

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(worker.pid for worker in self.workers)

    def reap(self) -> list[Worker]:
        """Collect workers that have ended; return those that ended since the last call."""
        ended = []
        for worker in self.workers:
            if worker.exited is None and worker.process.poll() is not None:
                worker.exited = worker.process.exited_at or time.monotonic()
                ended.append(worker)
        return ended

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.exited is None]

    def wait(self, timeout: float, wakeup_fd: int | None = None) -> None:
        """Block until the keeper has news (a worker ended), ``wakeup_fd`` is readable, or
        ``timeout`` passes."""
        watched = [self.keeper.fileno] + ([] if wakeup_fd is None else [wakeup_fd])
        with contextlib.suppress(InterruptedError):
            select.select(watched, [], [], max(0.0, timeout))

    def stop(self, sig: signal.Signals, timeout: float) -> None:
        """Send ``sig`` to every worker's process group, wait ``timeout``, then SIGKILL
        those still running; whatever they left behind, in their groups or outside them,
        gets SIGTERM and ``HELPER_GRACE`` seconds before SIGKILL (none after a SIGKILL)."""
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
        self.kill(stubborn)
        left = self.keeper.sweep(0.0 if sig == signal.SIGKILL else HELPER_GRACE)
        if left:
            logger.info("stopped %d process(es) the workers had left running", left)

    def kill(self, workers: Sequence[Worker]) -> None:
        """SIGKILL the process groups of ``workers`` at once and reap them (a stuck worker
        gets no chance to clean up: it may not react to anything else)."""
        for worker in workers:
            # Also reaches processes a worker started that are still in its group.
            _signal_group(worker.pid, signal.SIGKILL)
        for worker in workers:
            # SIGKILL cannot be ignored; the bound only guards against a stuck kernel.
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
        if workers is None:
            for filtered in self._filtered.values():
                with filtered.lock:
                    filtered.file.close()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)

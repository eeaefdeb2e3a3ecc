"""Every thread's Python stack of a local rank, taken before the agent kills it for a hang.

Each worker registers ``faulthandler`` for ``STACKS_SIGNAL`` at start
(``rallypoint.worker.progress_reporter``): on that signal the interpreter's C handler
writes every thread's stack to the worker's stacks file. It needs neither the GIL nor the
worker's cooperation, so it answers for a rank blocked in C, in an endless Python loop or
in a collective. A rank that cannot answer (stopped by SIGSTOP, asleep in the kernel's
uninterruptible wait) is described from outside, from ``/proc``: its state and the kernel
function it sleeps in.

The agent's log gets one line; the stacks go to ``<attempt>/<local rank>/stacks.txt`` in
the run directory (the worker's file, which grows by one dump each time), and the place
each rank was at goes into the hang's sentence.
"""

from __future__ import annotations

import contextlib
import os
import re
import runpy
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import rallypoint
from rallypoint.worker.variables import STACKS_SIGNAL

#: How long the agent waits for the dumps: they take milliseconds when a rank answers,
#: more on a host whose cores are all busy (the wait ends as soon as every dump is in).
ANSWER_WAIT = 5.0
#: A dump is complete once its file stopped growing for this long: faulthandler writes it
#: line by line, and a writer preempted between two lines must not be read half done.
_SETTLED = 0.3

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')
#: Where the interpreter's own and installed modules live, and rallypoint's own (which may
#: be an editable install, outside site-packages): not the script's code.
_LIBRARY = tuple(
    {
        os.path.realpath(p) + os.sep
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, rallypoint.__path__[0])
    }
)
_RALLYPOINT = os.path.realpath(rallypoint.__path__[0]) + os.sep
_RUNPY = os.path.realpath(runpy.__file__)
_PROC_STATES = {
    "T": "stopped (SIGSTOP or a debugger)",
    "t": "stopped by a debugger",
    "D": "asleep in the kernel, uninterruptibly (disk or network file system)",
    "Z": "exited, not yet reaped",
}


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def describe(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line} in {self.function}()"


@dataclass(frozen=True)
class RankStacks:
    """A rank's threads as its dump showed them (innermost frame first), or why none came."""

    threads: Mapping[int, tuple[Frame, ...]]
    main: int | None  # the main thread's ident, from the rank's reports
    outside: str = ""  # what /proc said when the rank could not answer

    def traceback(self) -> str:
        """The main thread's stack as Python prints a traceback (most recent call last)."""
        if self.outside:
            return f"(no stack: {self.outside})\n"
        frames = list(reversed(self._main_frames()))
        # What ran the script (a warm worker's fork server, runpy) is not the script's.
        while len(frames) > 1 and _launcher(frames[0].file):
            frames.pop(0)
        lines = ["Stack of the main thread (most recent call last):"]
        for frame in frames:
            lines.append(f'  File "{frame.file}", line {frame.line}, in {frame.function}')
        return "\n".join(lines) + "\n"

    def _main_frames(self) -> tuple[Frame, ...]:
        return self.threads.get(self.main or -1) or next(iter(self.threads.values()), ())

    def place(self) -> str:
        """Where the main thread was: the script's innermost line, and the library call it
        was in when that is deeper (``train.py:50 in step() (threading.py:355 in wait())``)."""
        if self.outside:
            return self.outside
        frames = self._main_frames()
        if not frames:
            return ""
        own = next((f for f in frames if not _in_library(f.file)), None)
        if own is None or own is frames[0]:
            return frames[0].describe()
        return f"{own.describe()} ({frames[0].describe()})"


def capture(
    pids: Mapping[int, int],
    files: Mapping[int, Path],
    mains: Mapping[int, int | None],
    wait: float = ANSWER_WAIT,
) -> dict[int, RankStacks]:
    """Ask every rank in ``pids`` (local rank -> pid) for its stacks, written to ``files``
    (local rank -> its stacks file); what each answered, by local rank."""
    sizes: dict[int, int] = {}
    found: dict[int, RankStacks] = {}
    for local_rank, pid in pids.items():
        state = _proc_state(pid)
        if state in ("T", "t", "Z"):  # a stopped process handles no signal: ask /proc
            found[local_rank] = RankStacks({}, None, _outside(pid, state))
            continue
        sizes[local_rank] = _size(files.get(local_rank))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACKS_SIGNAL)
    texts = _collect(files, sizes, wait)
    for local_rank in sizes:
        text = texts.get(local_rank, "")
        if text:
            found[local_rank] = RankStacks(parse(text), mains.get(local_rank))
        else:
            pid = pids[local_rank]
            found[local_rank] = RankStacks({}, None, _outside(pid, _proc_state(pid)))
    return found


def parse(text: str) -> dict[int, tuple[Frame, ...]]:
    """faulthandler's dump: thread ident -> its frames, most recent call first."""
    threads: dict[int, list[Frame]] = {}
    current: list[Frame] | None = None
    for line in text.splitlines():
        thread = _THREAD.match(line)
        if thread:
            current = threads.setdefault(int(thread.group(1), 16), [])
            continue
        frame = _FRAME.match(line)
        if frame and current is not None:
            current.append(Frame(frame["file"], int(frame["line"]), frame["function"]))
    return {ident: tuple(frames) for ident, frames in threads.items()}


def keep_flight_records(ranks: Sequence[int], since: float, into: Path) -> list[Path]:
    """Copy the NCCL flight recorder's dumps that torch wrote for ``ranks`` since ``since``
    (wall clock) into ``into``: torch writes them on a collective's timeout when
    ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is set, to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``
    followed by the rank (``/tmp/nccl_trace_rank_`` by default), where the next attempt
    would overwrite them."""
    prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/nccl_trace_rank_")
    kept: list[Path] = []
    for rank in ranks:
        source = Path(f"{prefix}{rank}")
        with contextlib.suppress(OSError):
            if source.stat().st_mtime >= since:
                into.mkdir(parents=True, exist_ok=True)
                kept.append(Path(shutil.copy2(source, into / source.name)))
    return kept


def _collect(files: Mapping[int, Path], sizes: Mapping[int, int], wait: float) -> dict[int, str]:
    """The text each file gained since ``sizes``, once every one settled or ``wait`` passed."""
    deadline = time.monotonic() + wait
    grown: dict[int, tuple[int, float]] = {}  # local rank -> (size, when it was last seen to grow)
    while time.monotonic() < deadline:
        now = time.monotonic()
        for local_rank, before in sizes.items():
            size = _size(files.get(local_rank))
            if size > grown.get(local_rank, (before, 0.0))[0]:
                grown[local_rank] = (size, now)
        if len(grown) == len(sizes) and all(now - at >= _SETTLED for _, at in grown.values()):
            break
        time.sleep(0.02)
    texts = {}
    for local_rank in grown:
        path = files[local_rank]
        with contextlib.suppress(OSError), path.open("rb") as handle:
            handle.seek(sizes[local_rank])
            texts[local_rank] = handle.read(1 << 20).decode(errors="replace")
    return texts


def _size(path: Path | None) -> int:
    try:
        return 0 if path is None else path.stat().st_size
    except OSError:
        return 0


def _proc_state(pid: int) -> str:
    """The one-letter state of ``/proc/PID/stat`` ("" when the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rpartition(b")")[2].split()[0].decode()
    except (OSError, IndexError):
        return ""


def _outside(pid: int, state: str) -> str:
    """What ``/proc`` says of a rank that could not write its stacks."""
    described = _PROC_STATES.get(state, f"not answering (state {state or 'gone'})")
    with contextlib.suppress(OSError):
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
        if wchan and wchan != "0":
            described += f", in the kernel's {wchan}"
    return described


def _launcher(path: str) -> bool:
    """Whether ``path`` is the code that started the script: ``-c``'s, runpy, rallypoint."""
    real = os.path.realpath(path)
    return path.startswith("<") or real.startswith(_RALLYPOINT) or real == _RUNPY


def _in_library(path: str) -> bool:
    """Whether ``path`` is the interpreter's or an installed package's, not the script's."""
    real = os.path.realpath(path)
    return real.startswith(_LIBRARY) or "site-packages" in real or path.startswith("<")

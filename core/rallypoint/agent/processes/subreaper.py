"""A process's hold on the processes below it: becoming their subreaper, reaping those that
ended, killing all of them, and tying a child's life to its parent's.

The agent and its keeper are subreapers (``kill_children`` stops what is below them); the
keeper and the preloaded interpreter reap their children and tie each to themselves
(``die_with``). Stdlib-only and importing nothing of rallypoint: those two import it
without the package (``rallypoint.agent.processes.keeper_server``, ``zygote``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import time
from collections.abc import Iterator, Sequence

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: How long killing everything below a process may take before it gives up on stragglers
#: (a process stuck in the kernel); SIGKILL needs milliseconds otherwise.
KILL_BOUND = 5.0


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)``; whether it took effect (False off Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children, not init's."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with(parent: int) -> None:
    """Call in a child right after fork: SIGKILL it when ``parent`` dies
    (``PR_SET_PDEATHSIG``); exit at once if it already has."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def ended_children() -> Iterator[tuple[int, int]]:
    """Reap every child that has ended: its pid and exit code (``-N``: killed by signal N)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _children(pid: int) -> list[int]:
    """The children of ``pid``, from /proc."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found += [int(child) for child in handle.read().split()]
        except OSError:
            continue
    return found


def _ended(pid: int) -> bool:
    """Whether ``pid`` is a zombie: it exited, and only waits to be reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def kill_children(spare: Sequence[int] = (), grace: float = 0.0) -> int:
    """Stop every descendant of this process (a subreaper: the orphans come back to it)
    but ``spare``, with their process groups, and reap them; the number stopped.

    With ``grace``, each first gets SIGTERM and up to ``grace`` seconds to exit, as
    ``multiprocessing``'s helpers need: a resource tracker unlinks the semaphores and shared
    memory its process left once that process is gone, then exits (it ignores SIGTERM).
    Then SIGKILL. Killing a child orphans its own children, which the kernel hands to this
    process: so each stage goes round until no child is left, the second bounded by
    ``KILL_BOUND`` seconds."""
    me = os.getpid()
    stopped: set[int] = set()
    if grace > 0:
        _terminate_children(me, spare, time.monotonic() + grace, stopped)
    deadline = time.monotonic() + KILL_BOUND
    while time.monotonic() < deadline:
        children = [child for child in _children(me) if child not in spare]
        if not children:
            break
        for child in children:
            if _ended(child):  # it exited on its own (a checkpoint writer): only reap it
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(child, 0)
                continue
            _signal_with_group(child, signal.SIGKILL)
            stopped.add(child)
        for child in children:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(child, 0)
    return len(stopped)


def _terminate_children(me: int, spare: Sequence[int], deadline: float, stopped: set[int]) -> None:
    """SIGTERM each child of ``me`` but ``spare`` once, reaping those that exit, until
    none is left or ``deadline``; woken by each exit (a pidfd per child)."""
    pidfds: dict[int, int] = {}
    try:
        while True:
            live = []
            for child in _children(me):
                if child in spare:
                    continue
                if _ended(child):
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitpid(child, 0)
                    continue
                live.append(child)
                if child not in pidfds:
                    with contextlib.suppress(OSError):
                        pidfds[child] = os.pidfd_open(child)
                    _signal_with_group(child, signal.SIGTERM)
                    stopped.add(child)
            left = deadline - time.monotonic()
            if not live or left <= 0:
                return
            # Also wakes now and then for orphans handed over meanwhile (no event of ours).
            watched = [pidfds[child] for child in live if child in pidfds]
            select.select(watched, [], [], min(left, 0.05))
    finally:
        for fd in pidfds.values():
            os.close(fd)


def _signal_with_group(pid: int, sig: signal.Signals) -> None:
    """Signal ``pid`` and, unless it is this process's, its process group."""
    with contextlib.suppress(OSError):
        group = os.getpgid(pid)
        if group != os.getpgrp():
            os.killpg(group, sig)
    with contextlib.suppress(OSError):
        os.kill(pid, sig)

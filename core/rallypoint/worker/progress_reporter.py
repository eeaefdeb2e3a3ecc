"""The worker's reports to its agent, for hang detection, and its stacks on request.

A daemon thread sends ``rallypoint.worker.progress.state.report()`` over the worker channel
every ``RALLYPOINT_PROGRESS_REPORTS`` seconds: from a thread of its own, so that a main
thread stuck in a collective or in C code still reports where it waits. Without a report
for a few intervals, the agent knows the whole process stopped (SIGSTOP, a GIL held for
good). ``RALLYPOINT_STACKS_FILE`` names the file into which ``faulthandler`` writes every
thread's stack on ``STACKS_SIGNAL``, which the agent sends before it kills a hung rank:
faulthandler writes from its C signal handler, so a main thread that never returns to the
interpreter is still shown.

A process forked from the worker (a DataLoader worker) is not the rank: it sends nothing,
and ignores the signal (its stack would land in the rank's file).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import IO

from rallypoint.worker import channel, progress, variables

#: The interval the agent asks for (seconds): a few missing reports soon say that the
#: process stopped, and two reports a second cost the loop nothing measurable
#: (benchmarks/bench_progress.py).
REPORT_INTERVAL = 0.5

_started = False
#: Kept open for the process's life: faulthandler writes to its descriptor.
_stacks: IO[str] | None = None


def start(tick: Callable[[], object] | None = None) -> None:
    """Once per process: the stacks signal when the agent names a file, the reporter when
    it asks for reports (``tick`` is called before each), silence in forked children."""
    global _started
    if _started:
        return
    _started = True
    os.register_at_fork(after_in_child=_forked)
    _register_stacks()
    interval = _interval()
    if interval is None or not os.environ.get(channel.ENV):
        return
    threading.Thread(
        target=_report, args=(interval, tick), name="rallypoint-progress", daemon=True
    ).start()


def send() -> None:
    """One report now."""
    if progress.state.sending:
        channel.send(channel.PROGRESS, **progress.state.report(time.monotonic()))


def _interval() -> float | None:
    try:
        interval = float(os.environ.get(variables.PROGRESS_REPORTS) or "nan")
    except ValueError:
        return None
    return interval if 0 < interval < float("inf") else None


def _report(interval: float, tick: Callable[[], object] | None) -> None:
    # Whatever happens in a report, the next one comes: this thread never ends early.
    while progress.state.sending:
        time.sleep(interval)
        with contextlib.suppress(Exception):
            if tick is not None:
                tick()
        with contextlib.suppress(Exception):
            send()


def _register_stacks() -> None:
    global _stacks
    path = os.environ.get(variables.STACKS_FILE)
    if not path:
        return
    try:
        stacks = open(path, "a")  # noqa: SIM115  # open for the process's life
    except OSError:
        return
    try:
        faulthandler.register(variables.STACKS_SIGNAL, stacks, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        stacks.close()
        return
    _stacks = stacks


def _forked() -> None:
    """In a child forked from the worker: not the rank, so no reports and no stacks."""
    progress.state.sending = False
    if _stacks is not None:
        with contextlib.suppress(Exception):
            faulthandler.unregister(variables.STACKS_SIGNAL)
            signal.signal(variables.STACKS_SIGNAL, signal.SIG_IGN)

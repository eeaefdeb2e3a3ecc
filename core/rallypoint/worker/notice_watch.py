"""Saves on notice: a worker told by its agent to save before the round changes.

When a node is told to stop (SIGTERM: the preemption notice of Kubernetes, Slurm and the
clouds), its agent gives the job notice: every worker saves at one step ``S``, a few steps
ahead so that the notice reaches every node first, and waits there for its agent to stop
it. The survivors resume from ``S``: no step is lost, whatever the save interval.

The agent names a file in ``RALLYPOINT_SAVE_NOTICE``: eight bytes, ``S`` (little-endian),
or -1 when there is no notice. A worker maps it once and reads it at every
``should_save``, which costs a memory read. It tells its agent over the worker channel
that it watches for notices (its first ``should_save``: an agent waits only for workers
that do) and that it holds at ``S``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time

from rallypoint.worker import channel, progress, variables

ENV = variables.SAVE_NOTICE
#: The worker's messages to its agent (control messages, like progress reports: not events).
WATCHING = channel.NOTICE_WATCHING
HELD = channel.NOTICE_HELD
#: No notice.
NONE = -1
FORMAT = struct.Struct("<q")
#: The longest a worker holds at a save on notice; the agent stops it well before (its
#: ``--shutdown-timeout``), and a notice withdrawn lets it go on at once.
HOLD_LIMIT = 600.0

_view: mmap.mmap | None = None
_opened = False
_announced = False


def _target() -> int | None:
    """The step of the notice, -1 for none; None outside ``rallypoint run``."""
    global _view, _opened
    if not _opened:
        _opened = True
        path = os.environ.get(ENV)
        if not path:
            return None
        with contextlib.suppress(OSError, ValueError), open(path, "rb") as file:
            _view = mmap.mmap(file.fileno(), FORMAT.size, access=mmap.ACCESS_READ)
    if _view is None:
        return None
    return int(FORMAT.unpack_from(_view)[0])


def requested(step: int) -> bool:
    """Whether the agent asked for a save at ``step``: the notice's step, or a later one
    when the notice came late (the worker had passed its step)."""
    target = _target()
    return target is not None and target != NONE and step >= target


def should_save(step: int, every: int | None = None) -> bool:
    """Whether to save at ``step``: every ``every`` steps, and at a save on notice. The
    first call tells the agent that this worker watches for notices (only a worker that
    asks is waited for: a script that saves on its own schedule never reaches the step)."""
    global _announced
    if not _announced:
        _announced = True
        if _target() is not None:
            channel.send(WATCHING)
    progress.progress(step=step)  # the agent picks a notice's step from the newest
    if every is not None and every > 0 and step % every == 0:
        return True
    return requested(step)


def hold(step: int) -> None:
    """After the save on notice of ``step``: tell the agent, and wait for it to stop this
    worker (the notice withdrawn, or HOLD_LIMIT passed: go on)."""
    channel.send(HELD, step=int(step))
    deadline = time.monotonic() + HOLD_LIMIT
    while requested(step) and time.monotonic() < deadline:
        time.sleep(0.005)

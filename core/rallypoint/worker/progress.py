"""A worker's progress, as its agent sees it: how many signs of progress, the step reached,
and whether it waits in a collective or saves or loads a checkpoint.

The agent needs no call from the script: ``rallypoint.worker.progress_sources`` counts the
optimizer steps, forward passes, DataLoader batches, collectives and checkpoint calls every
training loop makes, and ``rallypoint.worker.progress_reporter`` sends ``state.report()``
every ``RALLYPOINT_PROGRESS_REPORTS`` seconds. ``rallypoint.progress(step=N)`` says more:
"this worker made progress, at step N". A checkpoint ``save``, ``ElasticSampler.advance``
and ``rallypoint.metrics.step`` call it, so that the agent's goodput account knows which
training time a restart later redid; a new step is sent at once (at most one every 10 ms),
reporter or not, so that its time is precise. Outside ``rallypoint run`` nothing is sent;
nothing here blocks or raises.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import site as site_module
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

from rallypoint.worker import channel

#: The phases in which the agent accuses no rank of a hang.
CHECKPOINT_SAVE = "checkpoint_save"
CHECKPOINT_LOAD = "checkpoint_load"
#: The shortest time between two reports sent for a new step (steps faster than 100 a
#: second: the reporter's next report carries the newest).
STEP_GAP = 0.01
#: rallypoint's folder, as its frames name their files (a collective's site is outside it).
_PACKAGE = os.path.dirname(os.path.dirname(__file__)) + os.sep
#: Where installed packages live (the interpreter's site-packages, Debian's dist-packages).
_INSTALLED = tuple(
    os.path.join(path, "")
    for path in {
        *(sysconfig.get_paths()[name] for name in ("purelib", "platlib")),
        *site_module.getsitepackages(),
    }
)


class ProgressState:
    """What the progress sources write, in plain attributes (a hook's work is an
    increment or a store), and the report made from it.

    ``collective`` and ``phase`` are the main thread's only: a helper thread waiting in a
    collective or writing a checkpoint does not hold up the training loop."""

    __slots__ = (
        "_counted", "_lock", "_progressed", "_seen", "_step_sent", "armed", "collective",
        "main", "pending", "phase", "reached", "sending", "signals",
    )  # fmt: skip

    def __init__(self) -> None:
        self.signals = 0  # bumped by every source; read by the reporter only
        self.armed = False  # an optimizer step, or progress(): from then on the agent times us
        self.reached: tuple[int, float] | None = None  # the newest explicit step, and when
        self.collective: tuple[str, FrameType, float] | None = None  # op, caller, since
        # Collectives a GPU has yet to finish: (op, site, since, CUDA event, device), oldest
        # first; the main thread appends, the reporter drops those done.
        self.pending: collections.deque[tuple[str, str | None, float, Any, int]] = (
            collections.deque()
        )
        self.phase: tuple[str, float] | None = None  # name, since
        self.sending = True  # False in a forked child (a DataLoader worker): it is not the rank
        self.main = threading.main_thread().ident
        self._lock = threading.Lock()
        self._seen = 0  # ``signals`` at the last report
        self._counted = 0  # what reports say: monotone, even if a racy increment was lost
        self._progressed: float | None = None
        self._step_sent = -math.inf

    def report(self, now: float) -> dict[str, Any]:
        """The report the agent reads (``rallypoint.worker.progress_reporter``), as of ``now``
        (monotonic): ``progressed`` is when a report last saw ``signals`` move."""
        with self._lock:
            raw = self.signals
            if raw != self._seen:
                self._counted += raw - self._seen if raw > self._seen else 1
                self._seen, self._progressed = raw, now
            signals, progressed = self._counted, self._progressed
        reached, collective, phase = self.reached, self.collective, self.phase  # one read each
        return {
            "sent": now,
            "signals": signals,
            "progressed": progressed,
            "armed": self.armed,
            "step": None if reached is None else reached[0],
            "step_at": None if reached is None else reached[1],
            "collective": _pending(self.pending)
            if collective is None
            else {"op": collective[0], "site": site(collective[1]), "since": collective[2]},
            "phase": None if phase is None else {"name": phase[0], "since": phase[1]},
            "thread": self.main,
        }


#: This process's progress.
state = ProgressState()


def progress(step: int | None = None) -> None:
    """Tell the agent that this worker made progress, at ``step`` when given.

    Not needed in a loop that steps an optimizer (that is counted already); call it where
    a loop does neither for long (a long evaluation), or to give the step. It arms the
    worker's hang detection, as its first optimizer step does. A no-op outside
    ``rallypoint run``."""
    state.signals += 1
    state.armed = True
    if step is None:
        return
    step = int(step)
    reached = state.reached
    if reached is not None and reached[0] == step:
        return
    now = time.monotonic()
    state.reached = (step, now)
    if not state.sending or now - state._step_sent < STEP_GAP or not os.environ.get(channel.ENV):
        return
    state._step_sent = now
    channel.send(channel.PROGRESS, **state.report(now))


heartbeat = progress  # the earlier name, kept for scripts that call it


def _pending(pending: collections.deque[tuple[str, str | None, float, Any, int]]) -> Any:
    """The oldest collective a GPU has yet to finish, once those done are dropped (the
    reporter's thread). On NCCL a collective returns to Python before it completes: a rank
    held by a peer that never comes waits later, in a synchronisation (``.item()``), so the
    wait is found here, from the CUDA event recorded after the call, not in the call."""
    if not pending:
        return None
    import torch  # imported: only a worker that has used CUDA has anything pending

    device = None
    while pending:
        op, where, since, event, index = pending[0]
        if index != device:
            # Each thread has its current device: without this, the first CUDA call of
            # this thread would make a context on device 0, in every rank.
            torch.cuda.set_device(index)
            device = index
        if not event.query():
            return {"op": op, "site": where, "since": since}
        pending.popleft()
    return None


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Within: the main thread saves or loads a checkpoint (``CHECKPOINT_SAVE``,
    ``CHECKPOINT_LOAD``); its end is a sign of progress. Only the outermost counts."""
    entered = enter_phase(name)
    try:
        yield
    finally:
        leave_phase(entered)


def enter_phase(name: str) -> bool:
    """Note that the main thread entered phase ``name``, unless it is in one already or
    this is another thread; whether it did is what ``leave_phase`` takes."""
    if state.phase is not None or threading.get_ident() != state.main:
        return False
    state.phase = (name, time.monotonic())
    return True


def leave_phase(entered: bool) -> None:
    if entered:
        state.phase = None
        state.signals += 1


def site(frame: FrameType | None) -> str | None:
    """``train.py:88``: the script's line that waits. The first frame outwards from
    ``frame`` in no installed package (so past Lightning's and Accelerate's frames too, to
    the script's ``trainer.fit`` or ``accelerator.backward``), else the first that is
    neither torch's nor rallypoint's; None when there is none."""
    skipped = _skipped()
    found = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(skipped):
            if not filename.startswith(_INSTALLED):
                return f"{os.path.basename(filename)}:{frame.f_lineno}"
            found = found or f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return found


def _skipped() -> tuple[str, ...]:
    """rallypoint's folder, and torch's once imported."""
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if not torch_file:
        return (_PACKAGE,)
    return (_PACKAGE, os.path.dirname(torch_file) + os.sep)

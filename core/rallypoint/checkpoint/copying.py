"""Copying a state's tensors out of the training loop's way, for a save: into host memory by
the GPU's copy engine, on a CUDA stream of the copier's own, or with a ``memcpy``-like
``copy_`` for CPU tensors; now, or while the loop goes on.

A CUDA copy starts after everything the caller's stream did before the save, and is done
when its event is. An asynchronous copy runs while the loop goes on (the CPU tensors' in a
thread), so the tensors must not change until it is done: every torch optimizer's ``step``
waits for it first (a global step pre-hook; on a GPU the optimizer's stream waits for the
copy's event, so the loop itself does not), and ``wait`` does. A copy whose tensors changed
in place meanwhile (their version counters moved: a forward pass updating BatchNorm's
running statistics) is not completed, and says so. Used by the arena (memory checkpoints)
and by asynchronous saves to ``--checkpoint-dir``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rallypoint.interfaces import CheckpointError

logger = logging.getLogger("rallypoint.checkpoint")


@dataclass
class Copy:
    """One save's copy. ``complete(copy)`` runs once it is done and checked (in the
    copying thread when asynchronous); ``release(copy)`` runs last, whatever happened."""

    label: str  # what the save is, for its messages: "checkpoint of step 12"
    complete: Callable[[Copy], object]
    release: Callable[[Copy], object]
    began: float = field(default_factory=time.perf_counter)
    blocked: float = 0.0
    asynchronous: bool = False
    events: list[tuple[Any, Any]] = field(default_factory=list)  # (device, CUDA event)
    cpu: list[tuple[Any, Any]] = field(default_factory=list)  # CPU copies left: (to, from)
    watched: list[tuple[str, Any, int]] = field(default_factory=list)  # (path, tensor, version)
    thread: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    payload: Any = None  # the owner's: where the copy goes


class Copier:
    """The copies of one owner (an arena, the durable saves' staging), oldest first."""

    def __init__(self) -> None:
        self.pending: list[Copy] = []
        self._streams: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def start(self, copy: Copy, pairs: Sequence[tuple[Any, Any, str]], asynchronous: bool) -> None:
        """Copy each ``(destination, source, path)``; see the module for when this
        returns. A synchronous copy raises its error."""
        import torch

        copy.asynchronous = asynchronous
        streams: dict[Any, Any] = {}
        for destination, source, path in pairs:
            if not source.is_cuda:
                copy.cpu.append((destination, source))
                if asynchronous:
                    copy.watched.append((path, source, source._version))
                continue
            stream = streams.get(source.device)
            if stream is None:
                stream = streams[source.device] = self._stream(source.device)
                stream.wait_stream(torch.cuda.current_stream(source.device))
            with torch.cuda.stream(stream):
                destination.copy_(source, non_blocking=True)
            source.record_stream(stream)
            if asynchronous:
                copy.watched.append((path, source, source._version))
        for device, stream in streams.items():
            event = cuda().Event()
            event.record(stream)
            copy.events.append((device, event))
        if not asynchronous:
            self._finish(copy)
            if copy.error is not None:
                raise copy.error
            return
        copy.blocked = time.perf_counter() - copy.began
        with self._lock:
            self.pending.append(copy)
        copy.thread = threading.Thread(
            target=self._finish, args=(copy,), name=f"rallypoint-{copy.label}", daemon=True
        )
        copy.thread.start()
        _watch_optimizers(self)

    def _stream(self, device: Any) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = cuda().Stream(device)
        return stream

    def _finish(self, copy: Copy) -> None:
        """Copy the CPU tensors, wait for the GPU's, check that nothing changed, complete."""
        try:
            for destination, source in copy.cpu:
                destination.copy_(source)
            for _device, event in copy.events:
                event.synchronize()
            changed = [path for path, tensor, version in copy.watched if tensor._version != version]
            if changed:
                raise CheckpointError(
                    f"{copy.label} not kept: {changed[0]!r} changed while it was copied "
                    "(asynchronous=True); change it only after the optimizer's step or "
                    "checkpoint.wait(), or save synchronously"
                )
            copy.complete(copy)
        except BaseException as error:
            copy.error = error
            if copy.asynchronous:
                logger.error("asynchronous save: %s", error)
        finally:
            copy.release(copy)
            copy.done.set()

    def in_flight(self) -> list[Copy]:
        with self._lock:
            return [copy for copy in self.pending if not copy.done.is_set()]

    def next_done(self) -> Copy | None:
        """The oldest copy begun, once it is done (``None`` when none is left)."""
        with self._lock:
            if not self.pending:
                return None
            oldest = self.pending.pop(0)
        oldest.done.wait()
        return oldest

    def forget_done(self) -> None:
        """Drop the copies done without an error (nothing is left to say of them)."""
        with self._lock:
            self.pending = [c for c in self.pending if not (c.done.is_set() and c.error is None)]

    def before_change(self) -> None:
        """Before the tensors change (an optimizer's step): on a GPU, the current stream
        waits for the copies still running (the loop does not); a CPU copy is waited for."""
        import torch

        for copy in self.in_flight():
            if copy.cpu:
                copy.done.wait()
            for device, event in copy.events:
                torch.cuda.current_stream(device).wait_event(event)


class Staging:
    """Host memory that an asynchronous save to ``--checkpoint-dir`` copies the state into
    before it is written: allocated once, reused by the next save of the same shapes, pinned
    for CUDA tensors (one save at a time: the caller waits for the one before)."""

    def __init__(self) -> None:
        self.copier = Copier()
        self._buffers: list[Any] = []

    def stage(
        self, state: Any, label: str, began: float, write: Callable[[Any, float], object]
    ) -> None:
        """Copy ``state`` into the buffers while the loop goes on; then, in the copying
        thread, ``write(staged state, seconds the loop was held up)``."""
        import copy as copying

        from rallypoint.checkpoint import tree

        node, tensors, others = tree.encode(state)
        buffers = [self._buffer(index, tensor) for index, tensor in enumerate(tensors)]
        staged = tree.decode(node, buffers, copying.deepcopy(others))
        job = Copy(label, lambda done: write(staged, done.blocked), lambda done: None, began)
        pairs = list(zip(buffers, tensors, tree.paths(node), strict=True))
        self.copier.start(job, pairs, asynchronous=True)

    def _buffer(self, index: int, tensor: Any) -> Any:
        import torch

        while len(self._buffers) <= index:
            self._buffers.append(None)
        kept = self._buffers[index]
        if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
            kept = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[index] = kept
        return kept


def cuda() -> Any:
    """``torch.cuda``, typed as Any: some torch releases leave parts of it untyped."""
    import torch

    return torch.cuda


# --- the optimizers' hook ---------------------------------------------------------------------

_watched: weakref.WeakSet[Copier] = weakref.WeakSet()
_hook: Any = None


def _watch_optimizers(copier: Copier) -> None:
    """Make every torch optimizer's ``step`` wait for ``copier``'s copies in flight (one
    hook per process)."""
    global _hook
    _watched.add(copier)
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            for watched in list(_watched):
                watched.before_change()

        _hook = register_optimizer_step_pre_hook(before_step)

"""Copying a state's tensors out of the training loop's way, for a save: into host memory by
the GPU's copy engine, on a CUDA stream of the copier's own, or with a ``memcpy``-like
``copy_`` for CPU tensors; now, or while the loop goes on. Used by the arena (memory
checkpoints) and by asynchronous saves to ``--checkpoint-dir``.

A CUDA copy starts after everything the caller's stream did before the save. An
asynchronous copy runs while the loop goes on, so nothing may change its tensors before it
is done. A tensor's version counter moves when the host *issues* an in-place op, not when
the GPU runs it, so the copy is made safe where the change is issued, not where it runs:

- **ordered**: the first time the loop is about to change the state (an optimizer's
  ``step``, through a global step pre-hook; the forward of a module holding one of the
  saved buffers, BatchNorm's running statistics, through a global forward pre-hook), the
  caller's stream waits for the copy's event: from then on the GPU runs every change after
  the copy, and the host waited for nothing. The versions are compared at that moment: a
  tensor changed before it (issued while the copy could still be reading it) fails the
  save with a sentence. After it nothing is watched.
- **at once**: where rallypoint cannot see the changes before they are issued (no
  optimizer step has passed its hook yet; or one passed it while torch.compile traced it
  or a CUDA graph captured it, so later steps replay without it), the save orders the
  caller's stream after the copy right away: the host still does not wait, but the GPU
  runs nothing of the loop's until the copy is done. CPU tensors are copied then too,
  before the save returns.
- Otherwise CPU tensors are copied by the copying thread first; a hook waits for that
  part only.

The copying thread is a daemon, so that a stuck write cannot hang the interpreter for
ever; at exit rallypoint waits for the saves in flight (at most ``EXIT_WAIT`` seconds, said
in the log), so an asynchronous save followed by the script's return is still kept.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rallypoint.interfaces import CheckpointError

logger = logging.getLogger("rallypoint.checkpoint")

#: How long the interpreter's exit waits for asynchronous saves still in flight.
EXIT_WAIT = 300.0


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
    cpu: list[tuple[Any, Any, str, int]] = field(default_factory=list)  # (to, from, path, version)
    watched: list[tuple[str, Any, int]] = field(default_factory=list)  # CUDA (path, from, version)
    buffers: set[int] = field(default_factory=set)  # the CUDA sources' storages, by address
    ordered: bool = False  # nothing issued from now on can change what the copy reads
    torn: str | None = None  # the path of a tensor changed before the copy was ordered
    copied: threading.Event = field(default_factory=threading.Event)  # its CPU tensors
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
        _watch(self)

    def start(self, copy: Copy, pairs: Sequence[tuple[Any, Any, str]], asynchronous: bool) -> None:
        """Copy each ``(destination, source, path)``; see the module for when this
        returns. A synchronous copy raises its error."""
        copy.asynchronous = asynchronous
        gpu = [(to, source, path) for to, source, path in pairs if source.is_cuda]
        copy.cpu = [(to, s, path, s._version) for to, s, path in pairs if not s.is_cuda]
        if gpu:
            _refuse_while_capturing(copy.label)
            self._copy_on_streams(copy, gpu)
        if not asynchronous:
            self._finish(copy)
            if copy.error is not None:
                raise copy.error
            return
        copy.watched = [(path, source, source._version) for _, source, path in gpu]
        copy.buffers = {source.untyped_storage().data_ptr() for _, source, _ in pairs}
        if not _hooks.trusted():
            self._copy_cpu(copy)  # on the host, so that ordering it needs no wait
            self._order(copy)
        copy.blocked = time.perf_counter() - copy.began
        with self._lock:
            self.pending.append(copy)
        copy.thread = threading.Thread(
            target=self._finish, args=(copy,), name=f"rallypoint-{copy.label}", daemon=True
        )
        copy.thread.start()
        if not copy.ordered:
            _hooks.watch_forwards()

    def _copy_on_streams(self, copy: Copy, pairs: list[tuple[Any, Any, str]]) -> None:
        """Each CUDA source by DMA on the copier's stream of its device, after what the
        caller's stream did so far; one blocking-sync event per device (waiting for it
        sleeps, where a default event would spin a core)."""
        import torch

        streams: dict[Any, Any] = {}
        for destination, source, _path in pairs:
            stream = streams.get(source.device)
            if stream is None:
                stream = streams[source.device] = self._stream(source.device)
                stream.wait_stream(torch.cuda.current_stream(source.device))
            with torch.cuda.stream(stream):
                destination.copy_(source, non_blocking=True)
            source.record_stream(stream)  # its memory is not reused before the copy is done
        for device, stream in streams.items():
            event = cuda().Event(blocking=True)
            event.record(stream)
            copy.events.append((device, event))

    def _stream(self, device: Any) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = cuda().Stream(device)
        return stream

    def _copy_cpu(self, copy: Copy) -> None:
        """Copy the CPU tensors (once); a tensor changed meanwhile tears the copy."""
        if copy.copied.is_set():
            return
        for destination, source, _path, _version in copy.cpu:
            destination.copy_(source)
        changed = [path for _, source, path, version in copy.cpu if source._version != version]
        if changed and copy.torn is None:
            copy.torn = changed[0]
        copy.copied.set()

    def _order(self, copy: Copy) -> None:
        """Make the caller's streams wait for ``copy``, after checking that nothing it
        reads was changed before (see the module); from then on nothing is watched."""
        import torch

        if not self._settle(copy):
            return
        for device, event in copy.events:
            torch.cuda.current_stream(device).wait_event(event)

    def _settle(self, copy: Copy) -> bool:
        """Stop watching ``copy``, a tensor changed until now tearing it; whether this was
        the first time (the hooks and the copying thread both may, whichever comes first)."""
        with self._lock:
            if copy.ordered:
                return False
            copy.ordered = True
            changed = [path for path, tensor, version in copy.watched if tensor._version != version]
            if changed and copy.torn is None:
                copy.torn = changed[0]
            copy.watched, copy.buffers = [], set()
            return True

    def _finish(self, copy: Copy) -> None:
        """Copy the CPU tensors, wait for the GPU's, check that nothing changed, complete."""
        try:
            self._copy_cpu(copy)
            for _device, event in copy.events:
                event.synchronize()
            self._settle(copy)  # done before any change was ordered after it
            if copy.torn is not None:
                raise CheckpointError(
                    f"{copy.label} not kept: {copy.torn!r} changed while it was copied "
                    "(asynchronous=True); change it only after the optimizer's step or "
                    "checkpoint.wait(), or save synchronously"
                )
            copy.complete(copy)
        except BaseException as error:
            copy.error = error
            if copy.asynchronous:
                logger.error("asynchronous save: %s", error)
        finally:
            copy.copied.set()
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
        """Before the tensors change (an optimizer's step): the CPU tensors' copy is waited
        for, and the caller's streams wait for the GPU's (the host does not)."""
        for copy in self.in_flight():
            if not copy.copied.is_set():
                waited = time.perf_counter()
                copy.copied.wait()
                copy.blocked += time.perf_counter() - waited
            self._order(copy)

    def unordered(self) -> list[Copy]:
        """The copies in flight that a change issued now could still tear."""
        with self._lock:
            return [c for c in self.pending if not c.ordered and not c.done.is_set()]


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
            if tensor.is_cuda:  # pinned from the tensor's device: no context on GPU 0
                with torch.cuda.device(tensor.device):
                    kept = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            else:
                kept = torch.empty(tensor.shape, dtype=tensor.dtype)
            self._buffers[index] = kept
        return kept


def cuda() -> Any:
    """``torch.cuda``, typed as Any: some torch releases leave parts of it untyped."""
    import torch

    return torch.cuda


# --- the process's hooks ----------------------------------------------------------------------


class _Hooks:
    """What every copier of the process shares: the global hooks that order copies before
    the loop changes their tensors, what they have seen, and the work left for the exit."""

    def __init__(self) -> None:
        self.copiers: weakref.WeakSet[Copier] = weakref.WeakSet()
        self.step_hook: Any = None
        self.forward_hook: Any = None
        self.seen_step = False  # an optimizer's step ran its hook, eagerly
        self.hidden = False  # one was traced by torch.compile or captured in a CUDA graph
        self.closers: list[Callable[[], object]] = []
        self._lock = threading.Lock()  # a save in DCP's thread installs, the loop removes

    def trusted(self) -> bool:
        """Whether the hooks see the loop's changes before they are issued (the module)."""
        return self.seen_step and not self.hidden

    def watch_forwards(self) -> None:
        """Order the copies before the forward of a module holding a saved buffer."""
        from torch.nn.modules.module import register_module_forward_pre_hook

        with self._lock:
            if self.forward_hook is None:
                self.forward_hook = register_module_forward_pre_hook(_before_forward)

    def unwatch_forwards(self) -> None:
        """Remove the forward hook once no copy is left to order: no cost to a forward."""
        with self._lock:
            if self.forward_hook is not None and not self.unordered():
                self.forward_hook.remove()
                self.forward_hook = None

    def unordered(self) -> list[Copy]:
        return [copy for copier in list(self.copiers) for copy in copier.unordered()]

    def order_all(self) -> None:
        for copier in list(self.copiers):
            copier.before_change()


_hooks = _Hooks()


def at_exit(close: Callable[[], object]) -> None:
    """Run ``close`` at the interpreter's exit, after the saves in flight are done (an
    arena unpins and unmaps its slots there)."""
    _hooks.closers.append(close)


def _watch(copier: Copier) -> None:
    """Count ``copier`` in; the first one installs the step hook and the exit's wait. The
    step hook is installed before the loop's first step, so that a step torch.compile
    traces or a CUDA graph captures runs it then, and is seen."""
    if _hooks.step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hooks.step_hook = register_optimizer_step_pre_hook(_before_step)
        atexit.register(_finish_at_exit)
    _hooks.copiers.add(copier)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    import torch

    if torch.compiler.is_compiling() or _capturing():
        # Traced or captured: its replays will not run this hook, so every later save is
        # ordered at once. (torch.cuda.graph synchronises before it captures: no copy is
        # left running; torch.compile replays this store after each compiled step.)
        _hooks.hidden = True
        return
    _hooks.seen_step = True
    _hooks.order_all()


def _before_forward(module: Any, args: Any) -> None:
    import torch

    if torch.compiler.is_compiling():
        return  # a compiled module's wrapper ran this hook eagerly first
    flying = _hooks.unordered()
    if not flying:
        _hooks.unwatch_forwards()
        return
    addresses = set().union(*(copy.buffers for copy in flying))
    if _holds(module, addresses):
        _hooks.order_all()


def _holds(module: Any, addresses: set[int]) -> bool:
    """Whether ``module``'s forward may change a saved tensor in place: a buffer of its own
    (BatchNorm's statistics), or any buffer of the module a wrapper runs (torch.compile's,
    DistributedDataParallel's, which broadcasts them first)."""
    import torch

    inner = getattr(module, "_orig_mod", None) or getattr(module, "module", None)
    buffers = inner.buffers() if isinstance(inner, torch.nn.Module) else module._buffers.values()
    return any(
        buffer is not None and buffer.untyped_storage().data_ptr() in addresses
        for buffer in buffers
    )


def _capturing() -> bool:
    return bool(cuda().is_initialized() and cuda().is_current_stream_capturing())


def _refuse_while_capturing(label: str) -> None:
    if _capturing():
        raise CheckpointError(
            f"{label}: a checkpoint cannot be saved while a CUDA graph is being captured; "
            "save outside the captured region"
        )


def _finish_at_exit() -> None:
    """At the interpreter's exit: wait (bounded, said) for the saves in flight, then run
    the closers."""
    flying = [copy for copier in list(_hooks.copiers) for copy in copier.in_flight()]
    if flying:
        logger.warning(
            "waiting up to %.0f s for %s, still being saved, before the process exits",
            EXIT_WAIT,
            ", ".join(copy.label for copy in flying),
        )
        deadline = time.monotonic() + EXIT_WAIT
        for copy in flying:
            if not copy.done.wait(max(0.0, deadline - time.monotonic())):
                logger.error(
                    "%s lost: not saved %.0f s after the exit began", copy.label, EXIT_WAIT
                )
    for close in reversed(_hooks.closers):
        try:
            close()
        except Exception as error:  # the exit goes on: each closer is independent
            logger.warning("at exit: %s", error)

"""Progress counted from what every training loop already does, with no change to the script.

``install()`` patches torch in the worker (``rallypoint.worker.progress.state``):

- an optimizer step is a sign of progress, and the first one arms the rank (start-up and
  a first step that compiles are never timed); a global post-step hook;
- a forward pass, a batch from a DataLoader, a checkpoint call that ends are signs;
- while the main thread waits in a blocking collective of ``torch.distributed`` (or in
  ``Work.wait``, or in backward() with a process group of several ranks, where DDP's and
  FSDP's gradient collectives run), the state holds which one and the caller's frame,
  whose line the reporter finds only when it reports; its end is a sign; once CUDA is in
  use, a CUDA event recorded after the call says when the GPU has run it (NCCL's call
  returns first), and the report names the oldest not yet run;
- while it is in ``torch.save``, ``torch.load`` or ``torch.distributed.checkpoint``'s save
  and load, the state holds the phase, in which the agent accuses no rank.

A warm worker (forked from the preloaded interpreter, ``rallypoint.agent.processes.zygote``)
has torch imported already: it is patched at once. A cold one (``python -u SCRIPT``) runs
``install`` from the ``sitecustomize`` of the ``startup`` folder, before torch is imported:
an import hook patches torch once its import completes, and
``torch.distributed.checkpoint`` (which ``import torch`` leaves out) once it is imported.

Every wrapper keeps its function's signature and behaviour (``functools.wraps``), does a
few attribute stores, and never raises from its bookkeeping. Inside ``torch.compile``
(``torch.compiler.is_compiling()``, a constant while Dynamo traces) they do nothing: a
counter written there would be a side effect Dynamo replays or a graph break, and a wrapped
collective must stay the one Dynamo rewrites into a traceable one.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from rallypoint.worker import progress, progress_reporter, variables

#: The folder whose ``sitecustomize.py`` installs these sources in a cold worker.
STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")
#: The blocking collectives of ``torch.distributed`` (names the installed torch lacks are
#: skipped).
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv",
)  # fmt: skip
#: ``torch.distributed.checkpoint``'s calls, and their phases.
DCP_CALLS = {
    "save": progress.CHECKPOINT_SAVE,
    "async_save": progress.CHECKPOINT_SAVE,
    "load": progress.CHECKPOINT_LOAD,
}
_DCP = "torch.distributed.checkpoint"

_state = progress.state
_get_ident = threading.get_ident
_monotonic = time.monotonic
_getframe = sys._getframe


def _never() -> bool:
    return False


#: ``torch.compiler.is_compiling`` once torch is patched.
_compiling: Callable[[], bool] = _never
_installed = False
_patched: set[str] = set()


def install() -> None:
    """Count this worker's progress from torch (now, or once it is imported) and start its
    reporter (``rallypoint.worker.progress_reporter``). Once per process; never raises."""
    global _installed
    if _installed:
        return
    _installed = True
    waiting: dict[str, Callable[[ModuleType], None]] = {}
    for name, patch in (("torch", _patch_torch), (_DCP, _patch_dcp)):
        if name in sys.modules:
            _patch_once(name, patch, sys.modules[name])
        else:
            waiting[name] = patch
    if waiting:
        sys.meta_path.insert(0, _AfterImport(waiting))
    with contextlib.suppress(Exception):  # no thread left to start, say: no reports
        progress_reporter.start(tick=_sample_forward)


def cold_start_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for a cold worker whose ``sitecustomize`` runs ``install`` first: STARTUP
    first on ``PYTHONPATH``, its previous value in ``RALLYPOINT_PYTHONPATH`` (exactly, empty
    included; absent where it was unset). The shim puts ``PYTHONPATH`` back and leaves
    ``sys.path`` before the script runs, so that the script sees what torchrun would give."""
    result = dict(environ)
    if result.get("PYTHONPATH", "").split(os.pathsep)[0] == STARTUP:
        return result  # already: the value saved is the worker's own
    previous = result.pop("PYTHONPATH", None)
    result.pop(variables.SAVED_PYTHONPATH, None)
    if previous is not None:
        result[variables.SAVED_PYTHONPATH] = previous
    result["PYTHONPATH"] = os.pathsep.join([STARTUP, previous] if previous else [STARTUP])
    return result


# --- patching torch -------------------------------------------------------------------------


def _patch_once(name: str, patch: Callable[[ModuleType], None], module: ModuleType) -> None:
    if name in _patched:
        return
    _patched.add(name)
    with contextlib.suppress(Exception):
        patch(module)


def _patch_torch(torch: ModuleType) -> None:
    """Each source apart: one that this torch lacks or refuses leaves the others."""
    global _compiling, _cuda_initialized
    with contextlib.suppress(Exception):
        _compiling = torch.compiler.is_compiling
    with contextlib.suppress(Exception):
        _cuda_initialized = torch.cuda.is_initialized
    for patch in (_patch_optimizer, _patch_forward, _patch_data, _patch_serialization):
        with contextlib.suppress(Exception):
            patch(torch)
    with contextlib.suppress(Exception):
        if torch.distributed.is_available():
            _patch_distributed(importlib.import_module("torch.distributed"))
    if _DCP in sys.modules:  # imported by torch itself
        _patch_once(_DCP, _patch_dcp, sys.modules[_DCP])


def _patch_optimizer(torch: ModuleType) -> None:
    importlib.import_module("torch.optim.optimizer").register_optimizer_step_post_hook(_stepped)


def _stepped(optimizer: object, args: object, kwargs: object) -> None:
    if not _compiling():
        _state.signals += 1
        _state.armed = True


def _patch_data(torch: ModuleType) -> None:
    iterator = importlib.import_module("torch.utils.data.dataloader")._BaseDataLoaderIter
    iterator.__next__ = _counting(iterator.__next__)


def _counting(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, whose return is a sign of progress (a batch)."""

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        _state.signals += 1
        return result

    return counted


def _patch_serialization(torch: ModuleType) -> None:
    for name, phase in (("save", progress.CHECKPOINT_SAVE), ("load", progress.CHECKPOINT_LOAD)):
        setattr(torch, name, _in_phase(phase, getattr(torch, name)))


def _patch_dcp(dcp: ModuleType) -> None:
    """``torch.distributed.checkpoint``'s calls, where scripts call them and where they are
    defined (the same wrapper)."""
    for name, phase in DCP_CALLS.items():
        original = getattr(dcp, name, None)
        if original is None:
            continue
        wrapper = _in_phase(phase, original)
        setattr(dcp, name, wrapper)
        for defined in ("state_dict_saver", "state_dict_loader"):
            module = sys.modules.get(f"{_DCP}.{defined}")
            if module is not None and getattr(module, name, None) is original:
                setattr(module, name, wrapper)


def _in_phase(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, inside phase ``name`` (``rallypoint.worker.progress.phase``)."""

    @functools.wraps(original)
    def phased(*args: Any, **kwargs: Any) -> Any:
        entered = progress.enter_phase(name)
        try:
            return original(*args, **kwargs)
        finally:
            progress.leave_phase(entered)

    return phased


def _patch_distributed(dist: ModuleType) -> None:
    """Each collective in both namespaces (``torch.distributed.X`` is
    ``distributed_c10d.X``: one wrapper for both), and ``Work.wait``."""
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapper = _in_collective(name, original)
        setattr(c10d, name, wrapper)
        setattr(dist, name, wrapper)
    # Work is a pybind11 class, whose attributes Python may set: an async op's wait is
    # noted too, when called from Python (torch's C++ waits, DDP's, are not).
    work = getattr(c10d, "Work", None)
    if work is not None:
        with contextlib.suppress(AttributeError, TypeError):
            work.wait = _in_collective("wait", work.wait)
    # DDP's and FSDP's gradient collectives run in backward(), from C++ where no wrapper
    # sees them: in a process group of several ranks, backward() counts as a wait, so that
    # a rank held there by a stuck peer is evidence. Tensor.backward calls this one.
    autograd = importlib.import_module("torch.autograd")
    setattr(autograd, "backward", _in_collective("backward", autograd.backward, _grouped(c10d)))  # noqa: B010


def _grouped(c10d: ModuleType) -> Callable[[], bool]:
    """Whether this process is in a default process group of several ranks."""

    def grouped() -> bool:
        try:
            return bool(c10d.is_initialized() and c10d.get_world_size() > 1)
        except Exception:
            return False

    return grouped


def _in_collective(
    op: str, original: Callable[..., Any], when: Callable[[], bool] = lambda: True
) -> Callable[..., Any]:
    """``original``, noted in the state while the main thread waits in it (the outermost
    call only: torch's own nested calls leave it; and only ``when`` says so), its return
    a sign of progress."""

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if (
            _compiling()
            or _state.collective is not None
            or _get_ident() != _state.main
            or not when()
        ):
            return original(*args, **kwargs)
        caller, since = _getframe(1), _monotonic()
        _state.collective = (op, caller, since)
        try:
            result = original(*args, **kwargs)
        finally:
            _state.collective = None
        if _cuda_initialized():
            _record_pending(op, caller, since)
        _state.signals += 1
        return result

    return collective


def _record_pending(op: str, caller: Any, since: float) -> None:
    """A CUDA event on the current stream after the call: NCCL's collective is queued on
    the GPU, not done, when the call returns (``rallypoint.worker.progress._pending``).
    Recording an event is a DMA-free marker in the stream; it never synchronises."""
    with contextlib.suppress(Exception):
        cuda = sys.modules["torch"].cuda
        event = cuda.Event()
        event.record()
        _state.pending.append((op, progress.site(caller), since, event, cuda.current_device()))


def _never_cuda() -> bool:
    return False


#: ``torch.cuda.is_initialized`` once torch is patched: a CPU worker records nothing.
_cuda_initialized: Callable[[], bool] = _never_cuda


# --- forward passes -------------------------------------------------------------------------


class _Sampler:
    """A global forward pre-hook on every module costs every module call torch's slow path
    (``Module._call_impl``: some 2 µs more per call, benchmarks/bench_progress.py), and a
    model makes hundreds of module calls a step. So the hook is registered
    before each report and removes itself at the first forward after: one slow call per
    report interval, which is all the agent needs to see that forward passes run.
    Dynamo does not guard on hooks (``skip_nnmodule_hook_guards``): compiled code never
    recompiles for it."""

    register: Callable[[Callable[..., object]], Any] | None = None
    handle: Any = None


def _patch_forward(torch: ModuleType) -> None:
    _Sampler.register = importlib.import_module(
        "torch.nn.modules.module"
    ).register_module_forward_pre_hook
    # A compiled module (torch.compile's OptimizedModule) warns on every call made while
    # any global hook is registered, that the hook fires once more for it: for this
    # counting hook that is harmless, and the warning would reach every compiled job.
    warnings.filterwarnings(
        "ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks"
    )


def _sample_forward() -> None:
    """Before each report (the reporter's thread): watch for the next forward pass."""
    if _Sampler.register is not None and _Sampler.handle is None:
        _Sampler.handle = _Sampler.register(_forwarded)


def _forwarded(module: object, args: object) -> None:
    if _compiling():
        return
    handle, _Sampler.handle = _Sampler.handle, None
    if handle is not None:  # else the reporter has yet to store it: the next call removes it
        handle.remove()
    _state.signals += 1


# --- the import hook (cold start) -----------------------------------------------------------


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches a module once its import completes, then leaves ``sys.meta_path`` when
    there is none left to wait for. It finds nothing itself: it wraps the ``exec_module``
    of the loader the other finders found, on that one loader object, so that the module's
    ``__loader__`` and ``__spec__`` stay what they would be."""

    def __init__(self, waiting: dict[str, Callable[[ModuleType], None]]) -> None:
        self.waiting = waiting

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self.waiting.get(fullname)
        if patch is None:
            return None
        spec = self._others(fullname, path, target)
        loader = None if spec is None else spec.loader
        # A class (a built-in or frozen importer) serves every module: never patch it.
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            with contextlib.suppress(AttributeError):
                del loader.exec_module  # the loader's own again
            execute(module)  # raises: not imported, so not patched (a retry finds it again)
            self.waiting.pop(fullname, None)
            if not self.waiting:
                with contextlib.suppress(ValueError):
                    sys.meta_path.remove(self)
            _patch_once(fullname, patch, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def _others(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                return spec
        return None

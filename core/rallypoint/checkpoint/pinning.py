"""Page-locking host memory that torch did not allocate (a slot file's mapping) for the GPU's
copy engine: ``cudaHostRegister`` on the tensors' device, its failure said in one sentence
with the CUDA error cleared, and ``cudaHostUnregister`` on the same device before the memory
is unmapped.

Why each part is as it is:
- The runtime call runs under ``torch.cuda.device(device)``: on the current device it would
  make a CUDA context on GPU 0 in a worker that never called ``set_device`` (eight workers,
  eight contexts on one GPU).
- ``PORTABLE``: the pages count as pinned for every device's context, so a state spread over
  two GPUs, or a copy loaded to another GPU than it was saved from, is still one DMA.
- A failed ``cudaHostRegister`` also sets the runtime's last error, which torch's binding
  does not clear: the next kernel launch would raise it as its own. ``_clear_last_error``
  takes it back with ``cudaGetLastError`` from the same ``libcudart`` torch loaded.
- A range stays registered until ``unregister``: unmapping it first leaves the registration
  behind, and the next mapping at the same address fails to pin (error 712).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from rallypoint.checkpoint.copying import cuda
from rallypoint.interfaces import CheckpointError

logger = logging.getLogger("rallypoint.checkpoint")

PORTABLE = 1  # cudaHostRegisterPortable

#: What a registration's error code usually means here, for its sentence.
_HINTS = {
    2: "the kernel would not lock its pages: is the shared memory full (df /dev/shm) or the "
    "container's memory limit reached?",
    1: "the range is not page-aligned memory of this process",
    712: "the range is registered already: is the same slot file mapped twice in this "
    "process (a second Arena over the same folder)?",
    801: "this GPU or driver cannot pin memory it did not allocate (cudaHostRegister)",
}


def register(pointer: int, size: int, device: Any, what: str) -> None:
    """Pin ``size`` bytes at ``pointer`` for ``device``'s copy engine; ``CheckpointError``
    naming ``what`` and why when CUDA refuses (the CUDA error cleared)."""
    import torch

    cudart = cuda().cudart()
    with torch.cuda.device(device):
        code = int(cudart.cudaHostRegister(pointer, size, PORTABLE))
        if code:
            _clear_last_error()
    if code:
        raise CheckpointError(refusal(code, what, size, _error_name(cudart, code)))


def unregister(pointer: int, device: Any) -> None:
    """Undo ``register`` (before the memory is unmapped)."""
    import torch

    cudart = cuda().cudart()
    with torch.cuda.device(device):
        if int(cudart.cudaHostUnregister(pointer)):
            _clear_last_error()


def refusal(code: int, what: str, size: int, name: str) -> str:
    """The sentence for a registration CUDA refused with ``code``."""
    from rallypoint.checkpoint.tier import size_text

    hint = _HINTS.get(code, "see the CUDA error above")
    return (
        f"cannot pin {what} ({size_text(size)}) for the GPU's copy engine: "
        f"cudaHostRegister failed with error {code} ({name}); {hint}"
    )


def _error_name(cudart: Any, code: int) -> str:
    try:
        return str(cudart.cudaGetErrorString(cudart.cudaError(code)))
    except Exception:  # a torch whose binding knows no such value
        return "unknown"


def cudart_path(maps: str) -> str | None:
    """The ``libcudart`` this process mapped, from ``/proc/self/maps``' text."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "/libcudart.so" in fields[5]:
            return fields[5].strip()
    return None


def _clear_last_error() -> None:
    """``cudaGetLastError()`` from the ``libcudart`` torch uses (loading a path already
    mapped gives the same library, and so the same per-thread error)."""
    with open("/proc/self/maps") as maps:
        path = cudart_path(maps.read())
    if path is None:  # linked into torch itself: no symbol of it to call
        logger.warning("could not clear the CUDA error of a failed pin: no libcudart found")
        return
    ctypes.CDLL(path).cudaGetLastError()

"""Loading a memory checkpoint's copy (a slot file, or a copy an agent sent) into tensors of
their own: on the CPU read straight into them, on a GPU through a pinned bounce buffer.

Why a GPU load is as it is:
- Every file is opened read-only: a copy on a read-only ``--checkpoint-dir`` (read-only
  NFS, shared evaluation checkpoints) loads to a GPU as it loads to the CPU.
- Nothing of the file is pinned: ``cudaHostRegister`` costs time per GB, at every restart.
  The bytes go through one pinned buffer per process instead, in two halves: the kernel
  reads the next piece of the file into one half while the copy engine copies the other to
  the device, and a half is refilled only once the copy that read it is done (its event).
- Every CUDA call runs under ``torch.cuda.device(target)``, and the copies on the target's
  current stream: a worker that never called ``set_device`` makes no context on GPU 0, and
  whatever the caller runs next on that stream comes after the copies, so nothing waits for
  them to finish here (a wait on the current device would not have waited for another's).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rallypoint.checkpoint import slot, tree
from rallypoint.checkpoint.manifest import Damaged
from rallypoint.interfaces import CheckpointError

#: The most bytes of each half of the bounce buffer: enough that a read and a copy take
#: longer than their calls cost, little enough to pin once per process.
HALF = 64 << 20
#: Spans of the file at most this far apart share a read: the padding between one tensor
#: and the next, never rows of a tensor that a part does not need.
_GAP = slot.ALIGN


def load_copy(copy: slot.Copy, *, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """The state of a committed ``copy``, held against a rewrite while it is read
    (``slot.Busy`` if it was written over first); see ``load_file``."""
    with slot.lease(copy) as handle:
        return load_file(handle.fileno(), copy.record, copy.path, map_location, weights_only)


def load_file(
    fd: int, record: slot.Record, path: Path, map_location: Any = "cpu", weights_only: bool = True
) -> Any:
    """The state of the copy in the file ``fd`` (a slot, or a copy an agent sent, at
    ``path``), with its tensors where ``map_location`` says: ``None`` (where they were
    saved), a device, or a dict from the saved device to another. A tensor for the CPU is
    read straight into memory of its own (``preadv``: one copy, by the kernel); one for a GPU
    through the bounce buffer (see the module). Nothing returned refers to the file."""
    import torch

    header, other_bytes = slot.Header.decode(os.pread(fd, record.header_len, slot.PAGE))
    if os.fstat(fd).st_size < record.size:
        raise Damaged(f"{os.fstat(fd).st_size} bytes where the record says {record.size}")
    devices = [_target(entry.device, map_location) for entry in header.tensors]
    tensors = []
    on_gpus: dict[Any, list[tuple[int, Any]]] = {}
    for entry, device in zip(header.tensors, devices, strict=True):
        offset = record.data_start + entry.offset
        dtype = getattr(torch, entry.dtype)
        if device.type == "cuda":
            tensor = torch.empty(entry.shape, dtype=dtype, device=device)
            on_gpus.setdefault(device, []).append((offset, tensor))
        else:
            tensor = torch.empty(entry.shape, dtype=dtype)
            if entry.nbytes:
                read_into(fd, tensor, offset)
            if device.type != "cpu":
                tensor = tensor.to(device)
        tensors.append(tensor)
    for device, spans in on_gpus.items():
        to_device(fd, spans, device)
    others: list[Any] = []
    if other_bytes:
        others = torch.load(io.BytesIO(other_bytes), weights_only=weights_only)
    return tree.decode(header.tree, tensors, others)


def read_into(fd: int, tensor: Any, offset: int) -> None:
    """The bytes of the contiguous CPU ``tensor`` from the file ``fd`` at ``offset``, read
    straight into it (``preadv``: one copy, by the kernel)."""
    _read_exactly(fd, memoryview(_bytes(tensor).numpy()), offset)


def to_device(
    fd: int, spans: Sequence[tuple[int, Any]], device: Any, bounce: Bounce | None = None
) -> None:
    """Each ``(offset, tensor)`` of ``spans``: the bytes of the contiguous ``tensor`` on
    ``device`` from the file ``fd`` at ``offset``, through ``bounce`` (the process's pinned
    one unless given; a CPU ``device`` takes an unpinned one), on ``device``'s current
    stream. The copies may still run when this returns; see the module for why that is safe."""
    import torch

    sizes = [(offset, _nbytes(tensor)) for offset, tensor in spans]
    total = sum(size for _, size in sizes)
    if not total:
        return
    on_gpu = device.type == "cuda"
    cuda: Any = torch.cuda  # some torch releases leave parts of it untyped
    guard = cuda.device(device) if on_gpu else contextlib.nullcontext()
    # The buffer is pinned (once) under the guard, after the destinations made a context on
    # ``device``: torch pins on a device that has one, never making one on GPU 0.
    with guard, _held(bounce, total, pinned=on_gpu) as buffer:
        stream = cuda.current_stream(device) if on_gpu else None
        views = [_bytes(tensor) for _, tensor in spans]
        for fill in plan(sizes, buffer.half):
            index, half = buffer.take()
            _read_exactly(fd, memoryview(half[: fill.length].numpy()), fill.offset)
            for piece in fill.pieces:
                view = views[piece.target][piece.at : piece.at + piece.length]
                view.copy_(half[piece.source : piece.source + piece.length], non_blocking=True)
            if stream is not None:
                # blocking: a wait for the half sleeps instead of spinning a core
                event = cuda.Event(blocking=True)
                event.record(stream)
                buffer.events[index] = event


# --- the bounce buffer ----------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Bytes of one fill that go to one destination: ``length`` of them from ``source`` in
    the fill to ``at`` in the destination (``target``, its index)."""

    target: int
    at: int
    source: int
    length: int


@dataclass(frozen=True)
class Fill:
    """One read of the file into a half of the bounce buffer: ``length`` bytes from
    ``offset``, and where they go."""

    offset: int
    length: int
    pieces: tuple[Piece, ...]


def plan(spans: Sequence[tuple[int, int]], size: int) -> list[Fill]:
    """The reads that bring each of ``spans`` (``(offset in the file, bytes)``, a
    destination each) through a buffer of ``size`` bytes: spans close together share a read
    (a state's many small tensors take a read, not one each), a span longer than the buffer
    takes several. Each byte of every span is in exactly one piece."""
    if size <= 0:
        raise ValueError(f"a buffer of {size} bytes")
    fills: list[Fill] = []
    start = end = 0
    pieces: list[Piece] = []
    for index in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        offset, length = spans[index]
        done = 0
        while done < length:
            position = offset + done
            if not pieces or position - end > _GAP or position >= start + size:
                if pieces:
                    fills.append(Fill(start, end - start, tuple(pieces)))
                start, end, pieces = position, position, []
            take = min(length - done, start + size - position)
            pieces.append(Piece(index, done, position - start, take))
            end = max(end, position + take)
            done += take
    if pieces:
        fills.append(Fill(start, end - start, tuple(pieces)))
    return fills


class Bounce:
    """Two halves of ``half`` bytes each that a file's bytes pass through to a device,
    pinned for a GPU: a copy from pinned memory is a DMA that the host need not wait for."""

    def __init__(self, half: int, pinned: bool) -> None:
        import torch

        self.half = half
        memory = torch.empty(2 * half, dtype=torch.uint8, pin_memory=pinned)
        self.halves = [memory[:half], memory[half:]]
        self.events: list[Any] = [None, None]  # the copy that last read each half
        self._turn = 0

    def take(self) -> tuple[int, Any]:
        """The next half (its index, its bytes), once the copy that last read it is done."""
        index, self._turn = self._turn, 1 - self._turn
        self.wait(index)
        return index, self.halves[index]

    def wait(self, index: int) -> None:
        event, self.events[index] = self.events[index], None
        if event is not None:
            event.synchronize()


_bounce: Bounce | None = None
_lock = threading.Lock()  # one load at a time uses the process's bounce buffer


@contextlib.contextmanager
def _held(given: Bounce | None, total: int, pinned: bool) -> Iterator[Bounce]:
    """``given``, or a buffer for ``total`` bytes: the process's pinned one, grown if it is
    smaller than they and ``HALF`` need (two halves of a page at the least)."""
    global _bounce
    half = min(HALF, -(-total // (2 * slot.PAGE)) * slot.PAGE)
    if given is not None or not pinned:
        yield given or Bounce(half, pinned=False)
        return
    with _lock:
        if _bounce is None or _bounce.half < half:
            if _bounce is not None:  # its copies done before its memory goes
                _bounce.wait(0)
                _bounce.wait(1)
            _bounce = Bounce(half, pinned=True)
        yield _bounce


# --- bytes --------------------------------------------------------------------------------


def _read_exactly(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        count = os.preadv(fd, [view], offset)
        if count <= 0:
            raise Damaged("a copy shorter than its header says")
        view, offset = view[count:], offset + count


def _bytes(tensor: Any) -> Any:
    """The bytes of the contiguous ``tensor``, as a flat ``uint8`` view."""
    import torch

    return tensor.view(-1).view(torch.uint8)


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _target(saved: str, map_location: Any) -> Any:
    import torch

    if map_location is None:
        device = torch.device(saved)
    elif isinstance(map_location, dict):
        device = torch.device(map_location.get(saved, saved))
    elif callable(map_location):
        raise CheckpointError("map_location as a function: give a device or a dict")
    else:
        device = torch.device(map_location)
    if device.type == "cuda" and device.index is None:  # "cuda": the current device, as torch
        device = torch.device("cuda", torch.cuda.current_device())
    return device

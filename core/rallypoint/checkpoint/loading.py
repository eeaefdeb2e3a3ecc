"""Loading a memory checkpoint's copy (a slot file, or a copy an agent sent) into tensors of
their own: on the CPU read straight into them, on a GPU by the copy engine."""

from __future__ import annotations

import contextlib
import io
import mmap
import os
from pathlib import Path
from typing import Any

from rallypoint.checkpoint import slot, tree
from rallypoint.checkpoint.copying import cuda
from rallypoint.checkpoint.manifest import Damaged
from rallypoint.interfaces import CheckpointError

#: Map a copy to load with its pages at once: a fault per page costs more than the copy.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def load_copy(copy: slot.Copy, *, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """The state of a committed ``copy``, held against a rewrite while it is read
    (``slot.Busy`` if it was written over first); see ``load_file``."""
    with slot.lease(copy) as handle:
        return load_file(handle.fileno(), copy.record, copy.path, map_location, weights_only)


def load_file(
    fd: int, record: slot.Record, path: Path, map_location: Any = "cpu", weights_only: bool = True
) -> Any:
    """The state of the copy in the file ``fd`` (a slot, or a copy an agent sent), with its
    tensors where ``map_location`` says: ``None`` (where they were saved), a device, or a
    dict from the saved device to another. A tensor for the CPU is read straight into
    memory of its own (``preadv``: one copy, by the kernel); for a GPU, the file is mapped,
    pinned, and copied to the device by DMA. Nothing returned refers to the file."""
    import torch

    header, other_bytes = slot.Header.decode(os.pread(fd, record.header_len, slot.PAGE))
    if os.fstat(fd).st_size < record.size:
        raise Damaged(f"{os.fstat(fd).st_size} bytes where the record says {record.size}")
    devices = [_target(entry.device, map_location) for entry in header.tensors]
    mapped = None
    if any(device.type == "cuda" for device in devices):
        mapped = PinnedFile(path, record.size)
    try:
        tensors = []
        for entry, device in zip(header.tensors, devices, strict=True):
            offset = record.data_start + entry.offset
            if mapped is not None and device.type == "cuda":
                source = mapped.view(offset, entry)
                tensors.append(source.to(device, non_blocking=True))
                continue
            tensor = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
            if entry.nbytes:
                read_into(fd, tensor, offset)
            tensors.append(tensor if device.type == "cpu" else tensor.to(device))
        if mapped is not None:  # the DMA from the mapping is done before it goes
            torch.cuda.synchronize()
    finally:
        if mapped is not None:
            mapped.close()
    others: list[Any] = []
    if other_bytes:
        others = torch.load(io.BytesIO(other_bytes), weights_only=weights_only)
    return tree.decode(header.tree, tensors, others)


def read_into(fd: int, tensor: Any, offset: int) -> None:
    """The bytes of ``tensor`` from the file ``fd`` at ``offset``, read straight into it
    (``preadv``: one copy, by the kernel)."""
    view = memoryview(tensor.view(-1).view(__import__("torch").uint8).numpy())
    while len(view):
        count = os.preadv(fd, [view], offset)
        if count <= 0:
            raise Damaged("a copy shorter than its header says")
        view, offset = view[count:], offset + count


class PinnedFile:
    """A copy's file mapped and pinned for the GPU's copy engine, for a load."""

    def __init__(self, path: Path, size: int) -> None:
        import torch

        fd = os.open(path, os.O_RDWR)  # writable only so that CUDA can pin it; never written
        try:
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.pinned = int(cuda().cudart().cudaHostRegister(self.data.data_ptr(), size, 0)) == 0

    def view(self, offset: int, entry: slot.Tensor) -> Any:
        import torch

        flat = self.data[offset : offset + entry.nbytes]
        return flat.view(getattr(torch, entry.dtype)).view(entry.shape)

    def close(self) -> None:
        if self.pinned:
            cuda().cudart().cudaHostUnregister(self.data.data_ptr())
        del self.data
        with contextlib.suppress(BufferError):  # a view still held: closed when freed
            self.mm.close()


def _target(saved: str, map_location: Any) -> Any:
    import torch

    if map_location is None:
        return torch.device(saved)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(saved, saved))
    if callable(map_location):
        raise CheckpointError("map_location as a function: give a device or a dict")
    return torch.device(map_location)

"""Memory checkpoints as ``torch.distributed.checkpoint`` reads them: a ``StorageReader``
over slot files (``rallypoint.checkpoint.slot``), one per rank that saved.

``dcp.load(state, storage_reader=SlotReader(paths), no_dist=True)`` loads ``state`` in place
from the copies in ``paths``, resharding as DCP does: each rank's file says, for every
tensor it saved, the whole tensor's shape and where its part lies in it (a ``DTensor``'s
local shard; a plain tensor is whole), and the reader describes the union to DCP. So one
rank's own copy restores it at the same world size, and every rank's copies restore any
other world size. The metadata is made from the files' headers: nothing is unpickled but
the few leaves JSON cannot hold, with ``weights_only``. This module imports torch: import
it where a load needs it.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.storage import StorageReader

from rallypoint.checkpoint import slot, tree
from rallypoint.checkpoint.manifest import Damaged


@dataclass(frozen=True)
class _Chunk:
    """Where a saved part of a tensor is: its file, and where in it."""

    path: Path
    start: int  # the byte offset of the part in the file
    entry: slot.Tensor


class SlotReader(StorageReader):
    """Reads the memory checkpoints in ``paths`` (slot files, or copies of them) for
    ``torch.distributed.checkpoint.load``."""

    def __init__(self, paths: Sequence[Path | str]) -> None:
        super().__init__()
        self.paths = [Path(path) for path in paths]
        self._tensors: dict[Any, _Chunk] = {}
        self._objects: dict[str, Any] = {}

    # --- what DCP asks of a reader ----------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        self._tensors, self._objects = {}, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # given outright, never found from a checkpoint id

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        import torch
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
        )

        described: dict[str, Any] = {}
        for path in self.paths:
            with open(path, "rb") as handle:
                record, raw = slot.read(handle)
            header, other_bytes = slot.Header.decode(raw)
            others = torch.load(io.BytesIO(other_bytes), weights_only=True) if other_bytes else []
            # The saved state with a stand-in for each tensor, flattened as DCP flattens
            # the state it loads into: the names and the leaves are DCP's own.
            stand_ins = [
                torch.empty(entry.global_shape or entry.shape, dtype=_dtype(entry), device="meta")
                for entry in header.tensors
            ]
            flat, _ = flatten_state_dict(tree.decode(header.tree, stand_ins, others))
            index = {id(stand_in): i for i, stand_in in enumerate(stand_ins)}
            for fqn, value in flat.items():
                if id(value) not in index:
                    self._objects.setdefault(fqn, value)
                    described.setdefault(fqn, BytesStorageMetadata())
                    continue
                entry = header.tensors[index[id(value)]]
                offsets = torch.Size(entry.global_offset or (0,) * len(entry.shape))
                key = MetadataIndex(fqn, offsets)
                if key in self._tensors:  # a replicated tensor: every rank saved it
                    continue
                self._tensors[key] = _Chunk(path, record.data_start + entry.offset, entry)
                known = described.setdefault(
                    fqn,
                    TensorStorageMetadata(
                        TensorProperties(dtype=_dtype(entry)), torch.Size(value.shape), []
                    ),
                )
                known.chunks.append(ChunkStorageMetadata(offsets, torch.Size(entry.shape)))
        return Metadata(described, storage_data={}, storage_meta=StorageMeta())

    def set_up_storage_reader(
        self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Any:
        """Each item's bytes into its tensor, reading of a saved part only the rows along
        dim 0 that the item crosses (a rank reads its share, not every rank's): a contiguous
        CPU tensor of the same dtype that takes a part whole gets it read straight into it
        (one copy, by the kernel); any other takes those rows (on the CPU, or on its GPU
        through ``loading``'s bounce buffer) narrowed along the other dims."""
        import torch
        from torch.distributed.checkpoint.planner import LoadItemType

        reads = _Reads()
        loaded = []
        try:
            for item in plan.items:
                fqn = item.storage_index.fqn
                if item.type == LoadItemType.BYTE_IO:
                    data = io.BytesIO()
                    torch.save(self._objects[fqn], data)
                    data.seek(0)
                    planner.load_bytes(item, data)
                    continue
                chunk = self._tensors.get(item.storage_index)
                if chunk is None:
                    where = tuple(item.storage_index.offset or ())
                    raise Damaged(f"no copy holds {fqn} at {where}")
                target = planner.resolve_tensor(item).detach()
                reads.part(chunk, list(item.storage_offsets), list(item.lengths), target)
                loaded.append((item, target))
            reads.to_devices()
            for item, target in loaded:
                planner.commit_tensor(item, target)
        finally:
            reads.close()
        done: Any = torch.futures.Future()
        done.set_result(None)
        return done


class _Reads:
    """The parts one ``read_data`` reads: each file opened once, read-only, for all of its
    parts; the parts for a GPU gathered, so that a file's go through the bounce buffer
    together (``to_devices``)."""

    def __init__(self) -> None:
        self.opened: dict[Path, int] = {}
        self.staged: dict[tuple[Path, Any], list[tuple[int, Any]]] = {}
        self.narrowed: list[tuple[Any, Any, list[int], list[int]]] = []

    def part(self, chunk: _Chunk, offsets: list[int], lengths: list[int], target: Any) -> None:
        """The part of ``chunk`` at ``offsets`` of ``lengths`` into ``target``: at once on
        the CPU, by ``to_devices`` on a GPU."""
        import torch
        from torch.distributed._shard._utils import narrow_tensor_by_index

        entry, dtype = chunk.entry, _dtype(chunk.entry)
        whole = lengths == list(entry.shape) and not any(offsets)
        if whole and target.dtype == dtype and target.is_contiguous():
            self._read(chunk.path, chunk.start, target)
            return
        start, _, shape = rows(entry.shape, dtype.itemsize, offsets, lengths)
        held = torch.empty(shape, dtype=dtype, device=target.device if target.is_cuda else "cpu")
        self._read(chunk.path, chunk.start + start, held)
        inner = [0, *offsets[1:]]
        if target.is_cuda:
            self.narrowed.append((target, held, inner, lengths))
        else:
            target.copy_(narrow_tensor_by_index(held, inner, lengths))

    def to_devices(self) -> None:
        """The parts for GPUs: each file's for each device through the bounce buffer, then
        narrowed on the device, all on its current stream (``loading``: the caller's next
        work there comes after them, and nothing here waits)."""
        from rallypoint.checkpoint.loading import to_device

        for (path, device), spans in self.staged.items():
            to_device(self.opened[path], spans, device)
        self._narrow()

    def _read(self, path: Path, offset: int, tensor: Any) -> None:
        from rallypoint.checkpoint.loading import read_into

        if path not in self.opened:
            self.opened[path] = os.open(path, os.O_RDONLY)
        if tensor.is_cuda:
            self.staged.setdefault((path, tensor.device), []).append((offset, tensor))
        elif tensor.numel():
            read_into(self.opened[path], tensor, offset)

    def _narrow(self) -> None:
        import torch
        from torch.distributed._shard._utils import narrow_tensor_by_index

        for target, held, offsets, lengths in self.narrowed:
            # on the device's current stream, after the copies into ``held``
            with torch.cuda.device(target.device):
                target.copy_(narrow_tensor_by_index(held, offsets, lengths))
        self.narrowed = []

    def close(self) -> None:
        for fd in self.opened.values():
            os.close(fd)


def rows(
    shape: Sequence[int], itemsize: int, offsets: Sequence[int], lengths: Sequence[int]
) -> tuple[int, int, tuple[int, ...]]:
    """Where the part at ``offsets`` of ``lengths`` lies in a C-contiguous tensor of
    ``shape``: the rows along dim 0 that it crosses, as their byte offset and byte count in
    the tensor's bytes, and their shape. Rows next to each other are contiguous; the part is
    those rows narrowed along the other dims."""
    if not shape:
        return 0, itemsize, ()
    row = itemsize * math.prod(shape[1:])
    return offsets[0] * row, lengths[0] * row, (lengths[0], *shape[1:])


def _dtype(entry: slot.Tensor) -> Any:
    import torch

    return getattr(torch, entry.dtype)

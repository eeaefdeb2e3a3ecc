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
        """Each item's bytes into its tensor: a CPU tensor that takes a saved part whole
        gets it read straight into it (one copy, by the kernel); a CUDA one from the file
        mapped and pinned (a DMA), as a whole state's load does; any other through a
        tensor the part is read into first."""
        import torch
        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType

        files = _Files()
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
                entry, dtype = chunk.entry, _dtype(chunk.entry)
                target = planner.resolve_tensor(item).detach()
                whole = list(item.lengths) == list(entry.shape) and not any(item.storage_offsets)
                if target.is_cuda:
                    saved = files.pinned(chunk.path).view(chunk.start, entry)
                    part = narrow_tensor_by_index(saved, item.storage_offsets, item.lengths)
                    target.copy_(part, non_blocking=True)
                elif whole and target.dtype == dtype and target.is_contiguous():
                    files.read(chunk.path, chunk.start, target)
                else:
                    saved = torch.empty(entry.shape, dtype=dtype)
                    files.read(chunk.path, chunk.start, saved)
                    target.copy_(narrow_tensor_by_index(saved, item.storage_offsets, item.lengths))
                loaded.append((item, target))
            if files.mapped:  # every DMA from the mappings is done before they go
                torch.cuda.synchronize()
            for item, target in loaded:
                planner.commit_tensor(item, target)
        finally:
            files.close()
        done: Any = torch.futures.Future()
        done.set_result(None)
        return done


class _Files:
    """The files one ``read_data`` reads: each opened once for all of its parts, and
    mapped and pinned once if a part goes to a GPU."""

    def __init__(self) -> None:
        self.opened: dict[Path, int] = {}
        self.mapped: dict[Path, Any] = {}  # loading.PinnedFile

    def read(self, path: Path, start: int, tensor: Any) -> None:
        from rallypoint.checkpoint.loading import read_into

        if path not in self.opened:
            self.opened[path] = os.open(path, os.O_RDONLY)
        read_into(self.opened[path], tensor, start)

    def pinned(self, path: Path) -> Any:
        from rallypoint.checkpoint.loading import PinnedFile

        if path not in self.mapped:
            self.mapped[path] = PinnedFile(path, path.stat().st_size)
        return self.mapped[path]

    def close(self) -> None:
        for pinned in self.mapped.values():
            pinned.close()
        for fd in self.opened.values():
            os.close(fd)


def _dtype(entry: slot.Tensor) -> Any:
    import torch

    return getattr(torch, entry.dtype)

"""Loading memory checkpoints (rallypoint.checkpoint.loading, .slot_reader): files opened
read-only, a GPU load through the bounce buffer (driven here with a CPU target), resharding
that reads only the rows a rank needs. The CUDA test runs where a GPU is (the GPU check)."""

from __future__ import annotations

import os
import random
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from rallypoint.checkpoint import arena, loading, slot
from rallypoint.checkpoint.copies import Copies
from rallypoint.checkpoint.slot_reader import SlotReader, rows

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU check)")

# --- what a load opens ----------------------------------------------------------------------

#: The opens seen while a test records them: (path, flags), from the ``open`` audit event
#: that both ``open()`` and ``os.open`` raise.
_opens: list[tuple[str, int]] | None = None
_hooked = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _opens is not None:
        path, _mode, flags = args
        _opens.append((os.fsdecode(path) if isinstance(path, str | bytes) else str(path), flags))


@pytest.fixture
def opens() -> Iterator[list[tuple[str, int]]]:
    """The opens made while the test runs (an audit hook: it cannot be removed, so it is
    added once and records only under this fixture)."""
    global _opens, _hooked
    if not _hooked:
        sys.addaudithook(_audit)
        _hooked = True
    _opens = []
    try:
        yield _opens
    finally:
        _opens = None


def writable(seen: list[tuple[str, int]], path: Path) -> list[int]:
    return [
        flags for name, flags in seen if name == str(path) and flags & (os.O_RDWR | os.O_WRONLY)
    ]


def test_a_load_opens_its_copy_read_only_for_the_cpu_and_for_a_gpu(
    tmp_path: Path, opens: list[tuple[str, int]]
) -> None:
    """A root test process can write-open a read-only file, so the flags are what shows it:
    a GPU load asks for nothing but reading (where no GPU is, it fails after its opens)."""
    state: dict[str, Any] = {
        "w": torch.arange(1000.0),
        "b": torch.ones(3, dtype=torch.bfloat16),
        "n": 4,
    }
    memory = arena.Arena(tmp_path, 0)
    memory.save(state, 1, rank=0, world_size=1)
    memory.close()
    copy = Copies(tmp_path / slot.ARENA).newest()[0]
    opens.clear()
    back = loading.load_copy(copy)
    assert torch.equal(back["w"], state["w"]) and back["n"] == 4
    assert any(name == str(copy.path) for name, _ in opens)
    assert writable(opens, copy.path) == []
    opens.clear()
    if torch.cuda.is_available():
        back = loading.load_copy(copy, map_location="cuda:0")
        assert torch.equal(back["w"].cpu(), state["w"])
    else:
        with pytest.raises((AssertionError, RuntimeError)):  # torch: no CUDA here
            loading.load_copy(copy, map_location="cuda:0")
    assert writable(opens, copy.path) == []


# --- the bounce buffer ----------------------------------------------------------------------


def replay(fills: list[loading.Fill], data: bytes, spans: list[tuple[int, int]], size: int) -> None:
    """Run ``fills`` over ``data`` as the bounce buffer would; every byte of every span
    lands once, from its own place in the file."""
    landed = [bytearray(length) for _, length in spans]
    times = [[0] * length for _, length in spans]
    for fill in fills:
        assert 0 < fill.length <= size
        buffer = data[fill.offset : fill.offset + fill.length]
        for piece in fill.pieces:
            assert piece.source + piece.length <= fill.length and piece.length > 0
            landed[piece.target][piece.at : piece.at + piece.length] = buffer[
                piece.source : piece.source + piece.length
            ]
            for at in range(piece.at, piece.at + piece.length):
                times[piece.target][at] += 1
    for (offset, length), got, counts in zip(spans, landed, times, strict=True):
        assert bytes(got) == data[offset : offset + length]
        assert counts == [1] * length


@pytest.mark.parametrize("size", [512, 4096])
def test_the_planner_covers_every_byte_once_around_the_buffer_size(size: int) -> None:
    lengths = [0, 1, size - 1, size, size + 1, 2 * size, 3 * size + 7, 5, 0, 17]
    spans, offset = [], slot.PAGE
    for length in lengths:
        spans.append((offset, length))
        offset += -(-length // slot.ALIGN) * slot.ALIGN  # the slot's padding between tensors
    shuffled = spans[:]
    random.Random(size).shuffle(shuffled)
    data = random.Random(1).randbytes(offset + size)
    for chosen in (spans, shuffled, [(slot.PAGE, size)], [(0, 0)], [(9, 1)]):
        replay(loading.plan(chosen, size), data, chosen, size)
    # Small neighbours share a read; what lies far between two spans is never read.
    assert len(loading.plan([(0, 10), (16, 10), (300, 10)], size)) == 1
    far = loading.plan([(0, 10), (10 * size, 10)], size)
    assert [(f.offset, f.length) for f in far] == [(0, 10), (10 * size, 10)]


def test_the_bounce_buffer_moves_a_state_in_pieces_through_both_halves(tmp_path: Path) -> None:
    """``to_device``, the GPU path, with a CPU target: the same reads, pieces and halves."""
    tensors = [
        torch.arange(3000, dtype=torch.float32),  # 12000 bytes: three halves' worth
        torch.zeros(0, 4),
        torch.tensor(2.5, dtype=torch.float64),
        torch.arange(4096, dtype=torch.uint8),  # exactly one half
        torch.arange(4097, dtype=torch.uint8),  # one more
        (torch.arange(12) % 2).bool().reshape(3, 4),
        torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    ]
    path, spans, offset = tmp_path / "copy", [], 100
    with open(path, "wb") as handle:
        for tensor in tensors:
            handle.seek(offset)
            handle.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            spans.append(offset)
            offset += -(-tensor.numel() * tensor.element_size() // slot.ALIGN) * slot.ALIGN
    targets = [torch.empty_like(tensor) for tensor in tensors]
    bounce = loading.Bounce(4096, pinned=False)
    fd = os.open(path, os.O_RDONLY)
    try:
        loading.to_device(fd, list(zip(spans, targets, strict=True)), torch.device("cpu"), bounce)
    finally:
        os.close(fd)
    for tensor, target in zip(tensors, targets, strict=True):
        assert torch.equal(tensor, target)


def test_rows_are_the_bytes_of_the_dim_0_rows_a_part_crosses() -> None:
    assert rows((1024, 256), 4, (128, 64), (256, 128)) == (128 * 1024, 256 * 1024, (256, 256))
    assert rows((6, 2, 3), 2, (1, 1, 0), (2, 1, 3)) == (12, 24, (2, 2, 3))
    assert rows((), 8, (), ()) == (0, 8, ())


# --- resharding ---------------------------------------------------------------------------

WHOLE = torch.arange(1024 * 256, dtype=torch.float32).reshape(1024, 256)


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    """Four ranks' row shards of ``WHOLE`` ([256, 256] each), one slot file each."""
    paths = []
    for rank in range(4):
        shard = WHOLE[rank * 256 : (rank + 1) * 256].clone()
        memory = arena.Arena(tmp_path / f"rank{rank}", 0)
        placed = {id(shard): ((1024, 256), (rank * 256, 0))}
        memory.save({"w": shard}, 3, rank=rank, world_size=4, format="sharded", placed=placed)
        paths.append(slot.committed(memory.root)[0].path)
        memory.close()
    return paths


class Part(DefaultLoadPlanner):
    """Loads, into each tensor of the state, the part of the saved one at ``offset`` that
    it is the size of: a rank's shard at another world size, without a process group."""

    def __init__(self, offset: tuple[int, ...]) -> None:
        super().__init__()
        self.offset = offset

    def create_local_plan(self) -> LoadPlan:
        items = []
        assert self.metadata is not None
        for fqn, tensor in self.state_dict.items():
            chunk = ChunkStorageMetadata(torch.Size(self.offset), tensor.size())
            saved = self.metadata.state_dict_metadata[fqn]
            assert isinstance(saved, TensorStorageMetadata)
            items += create_read_items_for_chunk_list(fqn, saved, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # a plain tensor standing for the shard at offset


def load_part(paths: list[Path], target: torch.Tensor, offset: tuple[int, ...]) -> None:
    with warnings.catch_warnings():  # no_dist: one process reads alone
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            {"w": target}, storage_reader=SlotReader(paths), planner=Part(offset), no_dist=True
        )


@pytest.fixture
def read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes each ``os.preadv`` read while the test runs."""
    counts: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        count = real(fd, buffers, offset, *flags)
        counts.append(count)
        return count

    monkeypatch.setattr(os, "preadv", counting)
    return counts


def test_a_rank_reads_only_the_rows_of_its_part(shards: list[Path], read: list[int]) -> None:
    """Rows [128, 384) lie in two ranks' shards: a quarter of the data is read, not the
    two shards whole."""
    target = torch.empty(256, 256)
    load_part(shards, target, (128, 0))
    assert torch.equal(target, WHOLE[128:384])
    assert sum(read) == WHOLE.nbytes // 4


def test_a_part_cut_along_dim_1_reads_its_rows_and_loads_right(
    shards: list[Path], read: list[int]
) -> None:
    target = torch.empty(600, 128)
    load_part(shards, target, (100, 64))
    assert torch.equal(target, WHOLE[100:700, 64:192])
    assert sum(read) == 600 * 256 * 4


def test_a_whole_state_reshards_straight_into_its_tensors(
    shards: list[Path], read: list[int]
) -> None:
    target = torch.empty(1024, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"w": target}, storage_reader=SlotReader(shards), no_dist=True)
    assert torch.equal(target, WHOLE)
    assert sum(read) == WHOLE.nbytes
    converted = torch.empty(1024, 256, dtype=torch.float64)
    load_part(shards, converted, (0, 0))
    assert torch.equal(converted, WHOLE.double())


# --- on a GPU -------------------------------------------------------------------------------


@CUDA
def test_a_gpu_load_to_another_device_leaves_the_current_one(
    tmp_path: Path, shards: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """To the last GPU without ``set_device``: the tensors are right when the caller reads
    them on that device's stream, and the current device is still the one it was. Small
    halves, so that a 5 MB tensor takes both halves many times over."""
    monkeypatch.setattr(loading, "HALF", 1 << 20)
    monkeypatch.setattr(loading, "_bounce", None)
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    before = torch.cuda.current_device()
    state = {"big": torch.randn(5 << 18), "small": torch.arange(7), "half": torch.ones(3).half()}
    memory = arena.Arena(tmp_path / "whole", 0)
    memory.save(state, 1, rank=0, world_size=1)
    memory.close()
    back = loading.load_copy(
        Copies(tmp_path / "whole" / slot.ARENA).newest()[0], map_location=device
    )
    assert torch.cuda.current_device() == before
    for name, tensor in state.items():
        assert back[name].device == device and torch.equal(back[name].cpu(), tensor)
    target = torch.empty(600, 128, device=device)
    load_part(shards, target, (100, 64))
    assert torch.cuda.current_device() == before
    assert torch.equal(target.cpu(), WHOLE[100:700, 64:192])

"""One copy of one rank's state: a slot file of the arena in node shared memory, and the
file that agents send to peers and copy to durable storage (the same bytes).

Layout (integers little-endian)::

    0       the commit record (``Record``, 64 bytes): whether the slot holds a complete
            copy, and of what: step, rank, world size, generation
    4096    the header: JSON (``Header``: the state's tree, each tensor's dtype, shape and
            offset), then the leaves JSON cannot hold, as ``torch.save`` wrote them
    data    the tensors' bytes, each ``ALIGN``-aligned at its offset from here; data starts
            at the first page boundary after the header

A save writes the record WRITING first (from then on the copy the slot held is gone), then
the header and the tensors, then the record COMMITTED, with a generation above every other
in its arena. The record carries a CRC-32 of itself and the header: a record half written,
or one that does not belong to the header beside it, reads as no copy at all. The tensors'
bytes are not hashed on the save's path; the agent checksums them where it reads them
anyway, to send a copy to a peer or make it durable.

A slot is written by its worker alone, holding an exclusive ``flock`` on it; a reader
(the agent sending a copy, a worker loading one) holds a shared one (``lease``), and a
writer that finds a slot so held writes another. Nothing here needs torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

from rallypoint.checkpoint.manifest import Damaged

#: Where the arena lives under the agent's memory directory: a folder per local rank.
ARENA = "arena"
PREFIX = "slot-"
PAGE = 4096
#: Each tensor's offset is a multiple of this: a view of any dtype, and fast DMA.
ALIGN = 512
_MAGIC = b"RPSLOT01"
_RECORD = struct.Struct("<8sIIIIQqQQI4x")
WRITING, COMMITTED = 1, 2
#: The kinds of copy: a whole state (``save``), or one rank's share of it (``save_sharded``).
FORMATS = ("state", "sharded")


class Busy(Exception):
    """The slot is being written, or its copy is no longer the one asked for."""


@dataclass(frozen=True)
class Record:
    """What a slot holds: ``state`` COMMITTED (a complete copy) or WRITING; of which
    ``format`` (an index into ``FORMATS``: a whole state, or one rank's share of one)."""

    state: int
    rank: int
    world_size: int
    generation: int
    step: int
    header_len: int
    data_len: int
    format: int = 0

    @property
    def sharded(self) -> bool:
        return FORMATS[self.format] == "sharded"

    def committed(self) -> Record:
        return replace(self, state=COMMITTED)

    @property
    def data_start(self) -> int:
        return data_start(self.header_len)

    @property
    def size(self) -> int:
        """The bytes of the copy: record, header and data."""
        return self.data_start + self.data_len

    def pack(self, header: bytes) -> bytes:
        fields = (
            _MAGIC, self.state, self.rank, self.world_size, self.format,
            self.generation, self.step, self.header_len, self.data_len,
        )  # fmt: skip
        crc = zlib.crc32(header, zlib.crc32(_RECORD.pack(*fields, 0)))
        return _RECORD.pack(*fields, crc)


def data_start(header_len: int) -> int:
    return PAGE + -(-header_len // PAGE) * PAGE


def unpack(raw: bytes, header: bytes) -> Record | None:
    """The record in ``raw`` (its first 64 bytes), if it is one and ``header`` is its own."""
    if len(raw) < _RECORD.size:
        return None
    magic, state, rank, world, form, generation, step, header_len, data_len, _ = _RECORD.unpack(
        raw[: _RECORD.size]
    )
    if magic != _MAGIC or state not in (WRITING, COMMITTED) or len(header) != header_len:
        return None
    if form >= len(FORMATS):
        return None
    record = Record(state, rank, world, generation, step, header_len, data_len, form)
    return record if record.pack(header) == raw[: _RECORD.size] else None


@dataclass(frozen=True)
class Tensor:
    """Where one tensor's bytes are: ``offset`` from the start of the data. A rank's shard
    of a distributed tensor (a ``DTensor``: FSDP2, tensor parallelism) is saved as its local
    part, ``shape``, with the whole tensor's shape and the part's place in it."""

    dtype: str  # as torch names it: "float32", "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    device: str  # where it was saved from: "cpu", "cuda:0"
    global_shape: tuple[int, ...] | None = None  # a shard's whole tensor
    global_offset: tuple[int, ...] | None = None  # where the shard starts in it

    def encode(self) -> list[Any]:
        fields = [self.dtype, list(self.shape), self.offset, self.nbytes, self.device]
        if self.global_shape is not None and self.global_offset is not None:
            fields += [list(self.global_shape), list(self.global_offset)]
        return fields

    @classmethod
    def decode(cls, fields: list[Any]) -> Tensor:
        dtype, shape, offset, size, device, *whole = fields
        global_shape = tuple(int(n) for n in whole[0]) if whole else None
        global_offset = tuple(int(n) for n in whole[1]) if whole else None
        shape = tuple(int(n) for n in shape)
        return cls(
            str(dtype), shape, int(offset), int(size), str(device), global_shape, global_offset
        )


@dataclass(frozen=True)
class Header:
    """A copy's header: ``tree`` (``rallypoint.checkpoint.tree``), its tensors, and the
    length of the other leaves' ``torch.save`` bytes that follow the JSON."""

    format: str
    created: float
    tree: dict[str, Any]
    tensors: tuple[Tensor, ...]
    others_len: int

    def encode(self, others: bytes) -> bytes:
        body = {
            "format": self.format,
            "created": self.created,
            "tree": self.tree,
            "tensors": [t.encode() for t in self.tensors],
            "others_len": len(others),
        }
        text = json.dumps(body, separators=(",", ":")).encode()
        return struct.pack("<Q", len(text)) + text + others

    @classmethod
    def decode(cls, raw: bytes) -> tuple[Header, bytes]:
        """The header and its other leaves' bytes."""
        try:
            (length,) = struct.unpack_from("<Q", raw)
            body = json.loads(raw[8 : 8 + length])
            tensors = tuple(Tensor.decode(list(fields)) for fields in body["tensors"])
            header = cls(
                str(body["format"]), float(body["created"]), dict(body["tree"]), tensors,
                int(body["others_len"]),
            )  # fmt: skip
        except (struct.error, ValueError, KeyError, TypeError) as error:
            raise Damaged(f"unreadable header ({error})") from None
        others = raw[8 + length :]
        if len(others) != header.others_len or header.format not in FORMATS:
            raise Damaged("a header that does not match its record")
        return header, others


@dataclass(frozen=True)
class Copy:
    """A committed copy in a slot file."""

    path: Path
    record: Record

    @property
    def step(self) -> int:
        return self.record.step


def read(handle: BinaryIO) -> tuple[Record, bytes]:
    """The committed record of the copy ``handle`` reads from its start, and its header's
    bytes; ``Damaged`` if it holds none (unfinished, torn, not a slot)."""
    handle.seek(0)
    raw = handle.read(_RECORD.size)
    handle.seek(PAGE)
    return _checked(raw, lambda size: handle.read(size))


def parse(data: Any) -> tuple[Record, bytes]:
    """``read`` for a copy's bytes in memory (any buffer: a file mapped, bytes read)."""
    view = memoryview(data)
    return _checked(bytes(view[: _RECORD.size]), lambda size: bytes(view[PAGE : PAGE + size]))


def _checked(raw: bytes, header_of: Any) -> tuple[Record, bytes]:
    if len(raw) < _RECORD.size:
        raise Damaged("not a memory checkpoint (too short)")
    (header_len,) = struct.unpack_from("<Q", raw, 40)
    if header_len > (256 << 20):
        raise Damaged("not a memory checkpoint (no record)")
    header = header_of(header_len)
    record = unpack(raw, header)
    if record is None:
        raise Damaged("not a memory checkpoint, or one whose commit did not finish")
    if record.state != COMMITTED:
        raise Damaged("unfinished (its copy was never committed)")
    return record, header


def slots(folder: Path) -> list[Path]:
    """The slot files in ``folder`` (one local rank's arena), by name."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(folder / name for name in names if name.startswith(PREFIX))


def committed(arena: Path) -> list[Copy]:
    """Every committed copy in ``arena`` (all local ranks' folders), newest first: read
    without a lock, so a copy listed here may be rewritten before it is read (``lease``)."""
    found = []
    for folder in sorted(arena.iterdir()) if arena.is_dir() else []:
        for path in slots(folder):
            with contextlib.suppress(OSError, Damaged), open(path, "rb") as handle:
                found.append(Copy(path, read(handle)[0]))
    return sorted(found, key=lambda c: (c.step, c.record.generation), reverse=True)


@contextlib.contextmanager
def lease(copy: Copy) -> Iterator[BinaryIO]:
    """``copy``'s slot, open and held against a rewrite (a shared ``flock``) for as long as
    the block runs; ``Busy`` if its writer holds it, or it holds another copy by now."""
    with open(copy.path, "rb") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(f"{copy.path} is being written") from None
        try:
            record, _ = read(handle)
        except Damaged:
            raise Busy(f"{copy.path} no longer holds step {copy.step}") from None
        if record != copy.record:
            raise Busy(f"{copy.path} no longer holds step {copy.step}")
        handle.seek(0)
        yield handle


def crc32(handle: BinaryIO, size: int, chunk: int = 8 << 20) -> str:
    """The CRC-32 of the first ``size`` bytes ``handle`` reads from where it is, as hex."""
    value = 0
    left = size
    while left > 0 and (data := handle.read(min(chunk, left))):
        value = zlib.crc32(data, value)
        left -= len(data)
    if left:
        raise Damaged(f"{size - left} bytes where the record says {size}")
    return f"{value:08x}"

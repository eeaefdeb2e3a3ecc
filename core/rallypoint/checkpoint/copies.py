"""The node's own memory checkpoints: the committed copies in its workers' arenas, as the
agent sees them (to offer them to the round, send them to a peer, make them durable) and
as a loading worker finds them. Nothing here needs torch.

Sent or persisted, a copy becomes a checkpoint folder like any other (``step-N/``), with
the slot's bytes as one file (``FILE``) and a manifest of format ``arena`` that gives the
file's CRC-32, which the agent computes from the slot while it holds it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import BinaryIO, cast

from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint import slot
from rallypoint.checkpoint.tier import MEMORY, Held

#: A memory checkpoint's file in a checkpoint folder, by the rank that saved it.
FILE = "rank-{rank:05d}.slot"
FORMAT = "arena"


class Copies:
    """The committed copies under ``arena`` (the agent's memory directory's arena)."""

    source = MEMORY

    def __init__(self, arena: Path) -> None:
        self.root = arena
        self._checksums: dict[tuple[Path, int], str] = {}
        self._lock = threading.Lock()

    def newest(self, rank: int = 0, most: int | None = None) -> list[slot.Copy]:
        """Copies of a whole state saved by ``rank``, newest first; none newer than
        ``most``."""
        return [
            c
            for c in slot.committed(self.root)
            if c.record.rank == rank and (most is None or c.step <= most)
        ]

    def complete_steps(self) -> set[int]:
        return {copy.step for copy in self.newest()}

    @contextlib.contextmanager
    def hold(self, step: int) -> Iterator[Held]:
        """The newest copy of ``step``, held (``slot.lease``) while the block runs: its
        manifest and its one file; ``mf.Damaged`` when there is none, or it was just
        written over."""
        with contextlib.ExitStack() as stack:
            for copy in (c for c in self.newest() if c.step == step):
                try:
                    handle = stack.enter_context(slot.lease(copy))
                except slot.Busy:
                    continue
                yield Held(self._manifest(copy, handle), _opener(handle, copy.record.size))
                return
        raise mf.Damaged(f"no copy of step {step} in node memory")

    def _manifest(self, copy: slot.Copy, handle: BinaryIO) -> mf.Manifest:
        key = (copy.path, copy.record.generation)
        with self._lock:
            crc = self._checksums.get(key)
        if crc is None:
            handle.seek(0)
            crc = slot.crc32(handle, copy.record.size)
            with self._lock:
                self._checksums = {k: v for k, v in self._checksums.items() if k[0] != copy.path}
                self._checksums[key] = crc
        _, header = slot.read(handle)
        created = slot.Header.decode(header)[0].created
        entry = mf.FileEntry(copy.record.size, crc32=crc)
        name = FILE.format(rank=copy.record.rank)
        return mf.Manifest(copy.step, copy.record.world_size, created, FORMAT, {name: entry})


def _opener(handle: BinaryIO, size: int) -> Callable[[str], AbstractContextManager[BinaryIO]]:
    """Opens a held copy's one file: its first ``size`` bytes, from the start."""

    @contextlib.contextmanager
    def open_copy(_file: str) -> Iterator[BinaryIO]:
        handle.seek(0)
        yield cast(BinaryIO, _Limited(handle, size))

    return open_copy


class _Limited:
    """The first ``size`` bytes of ``handle``: a slot file is larger than its copy."""

    def __init__(self, handle: BinaryIO, size: int) -> None:
        self.handle = handle
        self.left = size

    def read(self, count: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        count = self.left if count < 0 else min(count, self.left)
        data = self.handle.read(count)
        self.left -= len(data)
        return data

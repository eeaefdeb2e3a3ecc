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
#: Where a rank's shares (``save_sharded``) go in a storage: a folder of checkpoints each.
SHARDED = "sharded/rank-{rank:05d}"


class Copies:
    """The committed copies under ``arena`` (the agent's memory directory's arena)."""

    source = MEMORY

    def __init__(self, arena: Path) -> None:
        self.root = arena
        self._checksums: dict[tuple[Path, int], str] = {}
        self._lock = threading.Lock()

    def newest(
        self, rank: int = 0, most: int | None = None, sharded: bool = False
    ) -> list[slot.Copy]:
        """Copies saved by ``rank`` (of a whole state, or with ``sharded`` of its share of
        one), newest first; none newer than ``most``."""
        return [
            c
            for c in slot.committed(self.root)
            if c.record.rank == rank
            and c.record.sharded == sharded
            and (most is None or c.step <= most)
        ]

    def complete_steps(self) -> set[int]:
        """The steps of the whole states held (saved by rank 0)."""
        return {copy.step for copy in self.newest()}

    def shards(self) -> dict[int, dict[int, int]]:
        """The ranks' shares held: by step, each rank's world size."""
        found: dict[int, dict[int, int]] = {}
        for copy in slot.committed(self.root):
            if copy.record.sharded:
                found.setdefault(copy.step, {})[copy.record.rank] = copy.record.world_size
        return found

    @contextlib.contextmanager
    def hold(
        self, step: int, rank: int = 0, sharded: bool = False, or_newer: bool = False
    ) -> Iterator[Held]:
        """The newest copy of ``step`` by ``rank`` (with ``or_newer``, the newest of it or
        a later step: a copy the worker has written over since is superseded, not lost),
        held (``slot.lease``) while the block runs: its manifest and its one file;
        ``mf.Damaged`` when there is none."""
        with contextlib.ExitStack() as stack:
            found = None
            # A copy listed can be written over before it is leased, once a newer one is
            # committed: look again (that newer one is then listed), a few times at most.
            for _ in range(_LOOKS):
                held = self.newest(rank, sharded=sharded)
                busy = False
                for copy in (c for c in held if c.step == step or (or_newer and c.step > step)):
                    try:
                        found = copy, stack.enter_context(slot.lease(copy))
                        break
                    except slot.Busy:
                        busy = True
                if found is not None or not busy:
                    break
            if found is None:
                raise mf.Damaged(f"no copy of step {step} in node memory")
            copy, handle = found
            yield Held(self._manifest(copy, handle), _opener(handle, copy.record.size))

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


#: How many times ``hold`` lists the copies when the ones it found were written over.
_LOOKS = 5


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

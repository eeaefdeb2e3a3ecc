"""A checkpoint's manifest: what a complete checkpoint holds, written last.

A checkpoint is a directory-like prefix ``step-<step>/`` in the storage with its payload
files and ``manifest.json``. The manifest is written only after every payload file is
complete, so a checkpoint without one was never finished; a payload file whose size or
checksum differs from the manifest's was damaged afterwards. Either way it is skipped.

A file's checksum is its SHA-256, or, for a memory checkpoint's copy (``format`` "arena"),
its CRC-32: the agent reads such a copy from node memory at memory speed, and SHA-256
would take it three to four times as long (0.6 against 2.1 GB/s on a 2-core x86 server);
a CRC-32 finds damage in storage or on the wire as surely, and tampering is not what a
checksum is for.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

KIND = "rallypoint-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_DIRECTORY = re.compile(r"^step-(\d+)$")


def directory(step: int) -> str:
    return f"step-{step:012d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory name, ``None`` for anything else."""
    match = _DIRECTORY.match(name)
    return int(match.group(1)) if match else None


class Damaged(Exception):
    """A checkpoint that cannot be used; the message says why (for the warning)."""


@dataclass(frozen=True)
class FileEntry:
    """A payload file's size and checksum: ``sha256``, or ``crc32`` (hex) where empty."""

    size: int
    sha256: str = ""
    crc32: str = ""

    def encode(self) -> dict[str, Any]:
        checksum = {"sha256": self.sha256} if self.sha256 else {"crc32": self.crc32}
        return {"size": self.size, **checksum}

    @classmethod
    def decode(cls, data: dict[str, Any]) -> FileEntry:
        entry = cls(int(data["size"]), str(data.get("sha256", "")), str(data.get("crc32", "")))
        if not entry.sha256 and not entry.crc32:
            raise KeyError("sha256")
        return entry


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    created: float
    format: str  # "torch": one torch.save file; "dcp": torch.distributed.checkpoint files
    files: dict[str, FileEntry] = field(default_factory=dict)

    def encode(self) -> bytes:
        data: dict[str, Any] = {
            "kind": KIND,
            "version": VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "created": self.created,
            "format": self.format,
            "files": {n: f.encode() for n, f in self.files.items()},
        }
        return json.dumps(data, indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def decode(cls, raw: bytes) -> Manifest:
        try:
            data = json.loads(raw.decode("utf-8"))
            if data.get("kind") != KIND or data.get("version") != VERSION:
                raise Damaged(f"not a version {VERSION} rallypoint manifest")
            return cls(
                step=int(data["step"]),
                world_size=int(data["world_size"]),
                created=float(data["created"]),
                format=str(data["format"]),
                files={
                    str(name): FileEntry.decode(dict(entry))
                    for name, entry in dict(data["files"]).items()
                },
            )
        except Damaged:
            raise
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise Damaged(f"unreadable manifest ({error})") from None


class HashingWriter:
    """A write-only file that counts and hashes what passes through it.

    ``error`` keeps the first ``OSError`` of the target: ``torch.save`` replaces it with
    an error of its own that does not say what went wrong (a full disk reads
    ``unexpected pos 704 vs 598``). ``on_write`` is called after every write (progress).
    """

    def __init__(
        self,
        target: BinaryIO,
        on_write: Callable[[], object] | None = None,
        crc32: bool = False,
    ) -> None:
        self.target = target
        self.size = 0
        self.error: OSError | None = None
        self._sha = None if crc32 else hashlib.sha256()
        self._crc = 0
        self._on_write = on_write

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._sha is None:
            self._crc = zlib.crc32(data, self._crc)
        else:
            self._sha.update(data)
        self.size += len(data)
        try:
            written = self.target.write(data)
        except OSError as error:
            self.error = self.error or error
            raise
        if self._on_write is not None:
            self._on_write()
        return written

    def flush(self) -> None:
        self.target.flush()

    @property
    def entry(self) -> FileEntry:
        if self._sha is None:
            return FileEntry(self.size, crc32=f"{self._crc:08x}")
        return FileEntry(self.size, self._sha.hexdigest())


def checksum(data: bytes | bytearray | memoryview, like: FileEntry) -> FileEntry:
    """``data``'s entry, with the kind of checksum ``like`` has."""
    if like.sha256:
        return FileEntry(len(data), hashlib.sha256(data).hexdigest())
    return FileEntry(len(data), crc32=f"{zlib.crc32(data):08x}")


def verify(name: str, data: bytes | bytearray | memoryview, expected: FileEntry) -> None:
    if len(data) != expected.size:
        raise Damaged(f"{name} has {len(data)} bytes, the manifest says {expected.size}")
    if checksum(data, expected) != expected:
        raise Damaged(f"{name} does not match its checksum")

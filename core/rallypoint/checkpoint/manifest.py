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

A manifest may come from someone else (a peer's agent, a directory another job wrote): its
file names are names in the checkpoint, never paths (``safe_name``), and its numbers are
bounded, so that reading one can neither reach outside the checkpoint nor ask for more
than a checkpoint can hold (``Unsafe``).
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
BEGUN = "begun"  # written first: a checkpoint with it and no manifest was never finished
#: The prefix of a file being written (``FileStorage.writer``), which listings pass over.
TEMPORARY = ".tmp-"
_DIRECTORY = re.compile(r"^step-(\d+)$")

#: Bounds on what a manifest may say: steps below 10**12 (``directory`` gives 12 digits),
#: world sizes of at most 2**20, sizes below 2**50 (a PiB), at most 100,000 files.
MAX_STEP = 10**12
MAX_RANKS = 1 << 20
MAX_SIZE = 1 << 50
MAX_FILES = 100_000
#: A file name's bytes (UTF-8), whole and per ``/``-separated component. A component is
#: kept below NAME_MAX (255) by the ``.tmp-`` prefix and suffix a write adds to it.
MAX_NAME = 1024
MAX_COMPONENT = 240
#: The same for any object name a storage takes (a file name under its checkpoint's and a
#: rank's folders): PATH_MAX and NAME_MAX.
MAX_OBJECT = 4096
MAX_OBJECT_COMPONENT = 255
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_HEX = {"sha256": re.compile(r"[0-9a-f]{64}"), "crc32": re.compile(r"[0-9a-f]{8}")}


def directory(step: int) -> str:
    return f"step-{step:012d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory name, ``None`` for anything else."""
    match = _DIRECTORY.match(name)
    return int(match.group(1)) if match else None


class Damaged(Exception):
    """A checkpoint that cannot be used; the message says why (for the warning)."""


class Unsafe(Damaged):
    """A manifest no rallypoint writes: a file name that is a path (``safe_name``), or a
    number out of bounds. Refused, whoever sent it; the message says which entry and why."""


def name_problem(
    name: str, longest: int = MAX_OBJECT, longest_component: int = MAX_OBJECT_COMPONENT
) -> str | None:
    """Why ``name`` is not a safe ``/``-separated name of an object under a root (a clause),
    or None: no absolute path, ``..``, ``.`` or empty component, backslash, control
    character, nor more than ``longest`` bytes (a component ``longest_component``)."""
    if not isinstance(name, str):
        return "it is not a string"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "it is not valid Unicode"
    if not name:
        return "it is empty"
    if size > longest:
        return f"it is longer than {longest} bytes"
    if name.startswith("/"):
        return "it is an absolute path"
    if "\\" in name:
        return "it holds a backslash, which is not the separator of checkpoint names"
    if _CONTROL.search(name):
        return "it holds a control character"
    for part in name.split("/"):
        if part in ("", ".", ".."):
            return f"it has a {part!r} component" if part else "it has an empty component"
        if len(part.encode("utf-8")) > longest_component:
            return f"a component is longer than {longest_component} bytes"
    return None


def safe_name(name: str) -> str:
    """``name``, if it is safe as a file name in a checkpoint's manifest: a safe name
    (``name_problem``) of at most ``MAX_NAME`` bytes that is none of the format's own
    (``manifest.json``, ``begun``, ``.tmp-*``); ``Unsafe`` naming it otherwise."""
    problem = name_problem(name, MAX_NAME, MAX_COMPONENT)
    if problem is None:
        for part in name.split("/"):
            if part in (MANIFEST, BEGUN) or part.startswith(TEMPORARY):
                problem = f"{part!r} is a name the checkpoint format keeps for itself"
                break
    if problem is not None:
        raise Unsafe(f"manifest entry {shortened(name)} refused: {problem}")
    return name


def shortened(value: object) -> str:
    """``value`` as a message may quote it: ``repr``, at most 80 characters."""
    return repr(value)[:80]


def _bounded(data: dict[str, Any], key: str, low: int, high: int, what: str = "manifest") -> int:
    """``data[key]``, an int in ``[low, high)`` (``Unsafe`` naming ``what`` otherwise)."""
    value = data[key]
    if type(value) is not int or not low <= value < high:
        raise Unsafe(f"{what} {key} {shortened(value)} refused: not an integer in [{low}, {high})")
    return value


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
    def decode(cls, data: dict[str, Any], name: str = "") -> FileEntry:
        """The entry of the file ``name`` (which ``Unsafe`` names) that ``data`` holds."""
        what = f"manifest entry {shortened(name)}"
        if not isinstance(data, dict):
            raise Unsafe(f"{what} refused: {shortened(data)} is not an object")
        size = _bounded(data, "size", 0, MAX_SIZE, what)
        checksums = {k: data[k] for k in ("sha256", "crc32") if k in data}
        if len(checksums) != 1:
            raise Unsafe(f"{what} refused: it needs one checksum, sha256 or crc32")
        ((kind, value),) = checksums.items()
        if not isinstance(value, str) or not _HEX[kind].fullmatch(value):
            raise Unsafe(f"{what} {kind} {shortened(value)} refused: not a hex digest")
        return cls(size, **{kind: value})


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
        """The manifest ``raw`` holds; ``Damaged`` if it is not one, ``Unsafe`` if it is
        one no rallypoint writes (a file name that is a path, a number out of bounds)."""
        try:
            data = json.loads(raw.decode("utf-8"))
            if not isinstance(data, dict):
                raise Damaged("unreadable manifest (not a JSON object)")
            if data.get("kind") != KIND or data.get("version") != VERSION:
                raise Damaged(f"not a version {VERSION} rallypoint manifest")
            files = data["files"]
            if not isinstance(files, dict) or len(files) > MAX_FILES:
                raise Unsafe(f"manifest files refused: not an object of at most {MAX_FILES}")
            created, format_ = data["created"], data["format"]
            if type(created) not in (int, float) or not isinstance(format_, str):
                raise Damaged("unreadable manifest (created or format of the wrong type)")
            return cls(
                step=_bounded(data, "step", 0, MAX_STEP),
                world_size=_bounded(data, "world_size", 1, MAX_RANKS + 1),
                created=float(created),
                format=format_,
                files={safe_name(n): FileEntry.decode(entry, n) for n, entry in files.items()},
            )
        except Damaged:
            raise
        # RecursionError: JSON nested deeper than the parser's stack (a hostile manifest).
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
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

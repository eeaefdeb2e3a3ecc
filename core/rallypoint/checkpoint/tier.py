"""One place checkpoints are kept, in the checkpoint format: a storage with its rotation
and, for node memory, the space it may take.

Saves to ``--checkpoint-dir`` go to its durable tier; the agent receives into it the
memory checkpoints it makes durable, and into the peer tier (node memory) those a peer
sends (``receive``). A load looks at every tier, and the node's own memory copies, and
takes the newest complete copy.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import BinaryIO

from rallypoint.checkpoint import manifest as mf
from rallypoint.interfaces import CheckpointError, CheckpointStorage

logger = logging.getLogger("rallypoint.checkpoint")

BEGUN = mf.BEGUN  # written first: a checkpoint with it and no manifest was never finished
MEMORY = "memory"  # this node's memory (``--checkpoint-memory``)
PEER = "peer"  # a copy another node's agent sent to this node's memory
DURABLE = "durable"  # ``--checkpoint-dir``
_CHUNK = 8 << 20  # bytes per read when a checkpoint is copied from one tier to another


@dataclass(frozen=True)
class Held:
    """A complete checkpoint held for reading (``Tier.hold``, ``Copies.hold``): its
    manifest, and how to open each file it lists."""

    manifest: mf.Manifest
    open: Callable[[str], AbstractContextManager[BinaryIO]]


class Tier:
    """Checkpoints in ``storage``: the ``keep_last`` newest complete ones are kept.

    ``source`` names the tier (``memory`` or ``durable``) in what a load reports.
    ``budget``: the most bytes its checkpoints may take together (node memory), ``None``
    for no limit; a save that would go past it fails, naming the sizes.
    """

    def __init__(
        self,
        storage: CheckpointStorage,
        keep_last: int,
        source: str = DURABLE,
        budget: int | None = None,
    ) -> None:
        if keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}: keep at least one checkpoint")
        self.storage = storage
        self.keep_last = keep_last
        self.source = source
        self.budget = budget

    @property
    def url(self) -> str:
        return self.storage.url

    # --- writing --------------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Mark the checkpoint of ``step`` as begun, so that a save that never finished (the
        worker died mid-write) is seen, and removed by a later save's rotation.

        A checkpoint of the same step saved before loses its manifest first: its files
        are about to be replaced one by one, and until the new manifest is written it is
        unfinished, not a mix of old and new files. Best effort: where the storage refuses
        deletes, the checksums still tell such a mix from a complete checkpoint."""
        with contextlib.suppress(Exception):
            self.storage.delete(f"{mf.directory(step)}/{mf.MANIFEST}")
        with self.storage.writer(f"{mf.directory(step)}/{BEGUN}") as handle:
            handle.write(b"")

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[BinaryIO]:
        """The storage's atomic writer; in a tier with a budget, a write that would take
        it past the budget fails (``CheckpointError``) before the bytes are written."""
        with self.storage.writer(name) as handle:
            if self.budget is None:
                yield handle
            else:
                yield _Bounded(handle, self, self.budget - self.used(), name)  # type: ignore[misc]

    def used(self) -> int:
        """Bytes the complete checkpoints take (what a manifest lists)."""
        total = 0
        for step in self.complete_steps():
            with contextlib.suppress(mf.Damaged, CheckpointError):
                total += sum(e.size for e in self.manifest(mf.directory(step)).files.values())
        return total

    def commit(
        self, step: int, world_size: int, format_: str, files: Mapping[str, mf.FileEntry]
    ) -> None:
        """Write the manifest (the checkpoint is complete), then rotate."""
        manifest = mf.Manifest(step, world_size, time.time(), format_, dict(files))
        with self.storage.writer(f"{mf.directory(step)}/{mf.MANIFEST}") as handle:
            handle.write(manifest.encode())
        self.rotate(step)

    def rotate(self, newest: int) -> None:
        """Keep the ``keep_last`` newest complete checkpoints; remove the rest, and
        anything unfinished older than ``newest`` (the one just written). An unfinished
        one newer than it is a save still being written (node memory writes two at once),
        or a dead writer's, removed by a later rotation."""
        try:
            complete = sorted(self.complete_steps(), reverse=True)
            keep = set(complete[: self.keep_last]) | {newest}
            for step in self.all_steps():
                if step not in keep and step < newest:
                    self.storage.delete(mf.directory(step))
        except Exception as error:  # the new checkpoint is complete: that is what counts
            logger.warning("checkpoint %s saved, but older ones not removed: %s", newest, error)

    def failed(self, step: int, cause: BaseException) -> CheckpointError:
        """Remove what a failed save of ``step`` wrote (space a full disk needs), and say
        why it failed."""
        with contextlib.suppress(Exception):  # a read-only directory keeps it: harmless
            self.storage.delete(mf.directory(step))
        if isinstance(cause, CheckpointError):
            return cause
        return CheckpointError(
            f"checkpoint of step {step} not saved in {self.url}: {cause}; "
            "the checkpoints saved before it are intact"
        )

    def receive(
        self,
        manifest: mf.Manifest,
        open_file: Callable[[str], AbstractContextManager[BinaryIO]],
        check: Callable[[], object] | None = None,
    ) -> int:
        """Write the checkpoint ``manifest`` describes, reading each of its files from
        ``open_file(file name)`` (another tier, a peer's socket), checked against the
        manifest on the way: a damaged copy is not kept. The bytes written. ``check``, if
        given, is called once the payload is written and before the manifest is: what it
        raises (a transfer's MAC that does not hold) fails the copy.

        The same order as a save: ``begun``, the payload, the manifest last. A copy that
        fails (a full disk) is removed, and the checkpoints here before it stay whole. A
        manifest with a file name that is not safe (``manifest.safe_name``) is refused
        (``manifest.Unsafe``) before anything is written."""
        for file_name in manifest.files:
            mf.safe_name(file_name)
        step = manifest.step
        name = mf.directory(step)
        copied = 0
        try:
            self.begin(step)
            for file_name, entry in manifest.files.items():
                with open_file(file_name) as reader:
                    copied += self._receive_file(reader, f"{name}/{file_name}", entry)
            if check is not None:
                check()
            with self.storage.writer(f"{name}/{mf.MANIFEST}") as handle:
                handle.write(manifest.encode())
        except Exception as error:
            raise self.failed(step, error) from error
        self.rotate(step)
        return copied

    def _receive_file(self, reader: BinaryIO, name: str, entry: mf.FileEntry) -> int:
        with self.writer(name) as handle:
            writer = mf.HashingWriter(handle, crc32=not entry.sha256)
            while writer.size < entry.size and (
                chunk := reader.read(min(_CHUNK, entry.size - writer.size))
            ):
                writer.write(chunk)
            if writer.entry != entry:
                raise mf.Damaged(f"{name} does not match its manifest")
        return writer.size

    # --- reading --------------------------------------------------------------------------

    @contextlib.contextmanager
    def hold(self, step: int) -> Iterator[Held]:
        """The complete checkpoint of ``step``, to read (``mf.Damaged`` if there is none)."""
        name = mf.directory(step)
        manifest = self.manifest(name)
        yield Held(manifest, lambda file: self.storage.reader(f"{name}/{file}"))

    def manifest(self, name: str) -> mf.Manifest:
        try:
            raw = self.read(f"{name}/{mf.MANIFEST}")
        except mf.Unsafe:
            raise
        except mf.Damaged:
            raise mf.Damaged("unfinished (no manifest)") from None
        return mf.Manifest.decode(raw)

    def read(self, name: str) -> bytes:
        try:
            with self.storage.reader(name) as handle:
                return handle.read()
        except FileNotFoundError:
            raise mf.Damaged(f"{name.rsplit('/', 1)[-1]} is missing") from None
        except OSError as error:
            # Not damage: the storage failed (a network error, a permission). Skipping a
            # good checkpoint here would restart training from an older one, or from zero.
            raise CheckpointError(
                f"cannot read checkpoint file {name} from {self.url} ({error}); "
                "not skipping it, since it may be intact"
            ) from None

    def verify_files(self, name: str, manifest: mf.Manifest) -> None:
        for file_name, entry in manifest.files.items():
            mf.verify(file_name, self.read(f"{name}/{file_name}"), entry)

    def all_steps(self) -> set[int]:
        steps = (mf.step_of(name.split("/", 1)[0]) for name in self.storage.names())
        return {step for step in steps if step is not None}

    def complete_steps(self) -> set[int]:
        names = set(self.storage.names())
        return {s for s in self.all_steps() if f"{mf.directory(s)}/{mf.MANIFEST}" in names}


class _Bounded:
    """A writer that refuses to go past ``room`` bytes (a tier's budget, less what its
    complete checkpoints take)."""

    def __init__(self, target: BinaryIO, tier: Tier, room: int, name: str) -> None:
        self.target = target
        self.tier = tier
        self.room = room
        self.name = name
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.size += len(data)
        if self.size > self.room:
            raise NoRoom(room_error(self.name, self.tier, self.room))
        return self.target.write(data)

    def flush(self) -> None:
        self.target.flush()


class NoRoom(OSError):
    """A write past a tier's budget: an ``OSError`` (ENOSPC), so that the save reports it
    as it would a full disk (``torch.save`` replaces other errors with its own)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def room_error(name: str, tier: Tier, room: int) -> str:
    """What a save that does not fit in ``tier``'s budget (``room`` bytes left) says."""
    budget = tier.budget or 0
    return (
        f"{name} does not fit in the node memory given to checkpoints "
        f"(--checkpoint-memory {size_text(budget)}: {size_text(budget - room)} taken by the "
        f"{tier.keep_last} kept, {size_text(max(0, room))} left, and this copy is larger); "
        f"give it at least {tier.keep_last + 1} times the size of one checkpoint"
    )


def size_text(count: int) -> str:
    """``count`` bytes in kB, MB or GB, as a person reads them."""
    if count >= 1e9:
        return f"{count / 1e9:.1f} GB"
    return f"{count / 1e6:.0f} MB" if count >= 1e6 else f"{count / 1e3:.0f} kB"

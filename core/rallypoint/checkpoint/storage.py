"""Where checkpoints are kept: the ``CheckpointStorage`` interface and its file system
implementation.

A storage holds named objects (``/``-separated names) and knows four operations; the
checkpoint format (manifest, checksums, rotation, choosing the newest valid one) is built
once on top of them in ``rallypoint.checkpoint.checkpointer``. A plugin registers another
storage (object storage, say) with ``register_checkpoint_backends``; see
docs/checkpointing.md.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlparse

from rallypoint.checkpoint import manifest as mf
from rallypoint.interfaces import CheckpointError, CheckpointStorage

_TEMPORARY = mf.TEMPORARY


class UnsafeName(CheckpointError, mf.Unsafe):
    """A name a ``FileStorage`` refuses: not a safe name (``manifest.name_problem``), or
    one whose path leads outside its root. A ``CheckpointError`` to whoever uses the
    storage, and to a load a damaged checkpoint (``manifest.Damaged``), skipped."""


class FileStorage:
    """A directory on a local or shared file system (``file://`` URLs and plain paths).

    A write goes to a temporary file beside the target, is flushed and fsynced, renamed
    over the target and the directory fsynced: after a crash at any moment, the target
    is either absent, the old object, or the whole new one.

    Names are checked before they are used (``path``): whatever the caller, nothing
    outside the root is created, read or removed.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        parsed = urlparse(url)
        path = unquote(parsed.path) if parsed.scheme == "file" else url
        self.root = Path(path).expanduser()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CheckpointError(
                f"checkpoint directory {self.root}: cannot create it ({error.strerror})"
            ) from None

    def path(self, name: str) -> Path:
        """Where the object ``name`` lies (``""``: the root); ``UnsafeName`` for a name
        that is not safe (``manifest.name_problem``) or that resolves, through a symbolic
        link in the root say, to a path outside it."""
        if name == "":
            return self.root
        problem = mf.name_problem(name)
        path = self.root / name
        if problem is None and not path.resolve().is_relative_to(self.root.resolve()):
            problem = "it leads outside the directory"
        if problem is not None:
            raise UnsafeName(f"{self.url}: object name {mf.shortened(name)} refused: {problem}")
        return path

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[BinaryIO]:
        target = self.path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f"{_TEMPORARY}{target.name}-{uuid.uuid4().hex[:8]}")
        try:
            with open(temporary, "wb") as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)
            _fsync_directory(target.parent)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise

    @contextlib.contextmanager
    def reader(self, name: str) -> Iterator[BinaryIO]:
        with open(self.path(name), "rb") as handle:
            yield handle

    def names(self) -> list[str]:
        # os.walk passes over a folder removed while it lists (another writer's rotation).
        return sorted(
            os.path.relpath(os.path.join(folder, name), self.root).replace(os.sep, "/")
            for folder, _, files in os.walk(self.root)
            for name in files
            if not name.startswith(_TEMPORARY)
        )

    def delete(self, name: str) -> None:
        path = self.path(name)
        if path == self.root:
            raise UnsafeName(f"{self.url}: refused to delete the whole directory by name")
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            _fsync_directory(path.parent)


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class Prefixed:
    """The objects under ``prefix/`` of ``storage``, as a storage of their own (a rank's
    sharded memory checkpoints in ``--checkpoint-dir``)."""

    def __init__(self, storage: CheckpointStorage, prefix: str) -> None:
        self.storage = storage
        self.prefix = prefix.strip("/") + "/"
        self.url = f"{storage.url.rstrip('/')}/{self.prefix}"

    def writer(self, name: str) -> contextlib.AbstractContextManager[BinaryIO]:
        return self.storage.writer(self.prefix + name)

    def reader(self, name: str) -> contextlib.AbstractContextManager[BinaryIO]:
        return self.storage.reader(self.prefix + name)

    def names(self) -> list[str]:
        return [n[len(self.prefix) :] for n in self.storage.names() if n.startswith(self.prefix)]

    def delete(self, name: str) -> None:
        self.storage.delete(self.prefix + name)

    def path(self, name: str) -> Path | None:
        """Where ``name`` lies, if the storage is a file system's."""
        return (
            self.storage.path(self.prefix + name) if isinstance(self.storage, FileStorage) else None
        )

"""``FsspecStorage``: rallypoint's ``CheckpointStorage`` over any fsspec file system.

Reading, listing and deleting map straight onto fsspec. Writing is the part that needs
care, because a write must appear whole or not at all, and fsspec offers no such
operation for every file system. Two ways are used, chosen by the file system:

``rename`` (the local file system): write a temporary name beside the target, fsync it,
``mv`` it over the target (``os.rename``: atomic), fsync the directory. ``names()`` hides
the temporaries.

``upload`` (everything else: S3, GCS, Azure): write into a local staging file, and when
the block has ended without an exception upload it to the target with ``put_file``. An
object store creates an object only when its upload completes (S3's single ``PUT`` or
``CompleteMultipartUpload``, GCS's final chunk, Azure's block list commit), so readers
see the old object or the whole new one, and an interrupted upload leaves no object. Why
not write straight into ``fs.open(target, "wb")``: such a file publishes when it is
closed, and it is closed on the way out of a ``with`` block that raised, or by its
finaliser, so an exception mid-write would publish half a checkpoint. ``autocommit=False``
would defer that, but not every backend honours it (adlfs and the memory file system
publish regardless).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO, cast

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rallypoint.sdk import CheckpointError

#: Temporary names of the ``rename`` way start with this; ``names()`` never lists them.
TEMPORARY = ".tmp-"


class FsspecStorage:
    """Named objects under ``url`` (``s3://bucket/run42``, ``local:///data/ckpt``...).

    Credentials and settings come from the environment, as fsspec and its backends read
    them: ``AWS_*`` for s3fs, ``FSSPEC_S3_ENDPOINT_URL`` for an S3-compatible service...
    The agent passes its environment to the workers, where storages are opened.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        try:
            fs, root = fsspec.core.url_to_fs(url)
        except ImportError as error:  # e.g. "Install s3fs to access S3"
            raise CheckpointError(f"checkpoint URL {url!r}: {error}") from None
        except ValueError as error:  # e.g. "Protocol not known: foo"
            raise CheckpointError(f"checkpoint URL {url!r}: {error}") from None
        self.fs: Any = fs
        self.root: str = root.rstrip("/")
        #: ``"rename"`` or ``"upload"``: how ``writer`` makes a write atomic.
        self.write_mode = "rename" if isinstance(fs, LocalFileSystem) else "upload"
        if self.write_mode == "rename":
            try:
                fs.makedirs(self.root, exist_ok=True)
            except OSError as error:
                raise CheckpointError(
                    f"checkpoint directory {url!r}: cannot create it ({error.strerror})"
                ) from None

    def path(self, name: str) -> str:
        """Where ``name`` is, in the file system's own terms (no scheme)."""
        return f"{self.root}/{name}"

    def writer(self, name: str) -> contextlib.AbstractContextManager[BinaryIO]:
        if self.write_mode == "rename":
            return self._write_and_rename(self.path(name))
        return self._stage_and_upload(self.path(name))

    @contextlib.contextmanager
    def _write_and_rename(self, target: str) -> Iterator[BinaryIO]:
        parent, base = posixpath.split(target)
        self.fs.makedirs(parent, exist_ok=True)
        temporary = f"{parent}/{TEMPORARY}{base}-{uuid.uuid4().hex[:8]}"
        try:
            with self.fs.open(temporary, "wb") as handle:
                yield cast(BinaryIO, handle)
                handle.flush()
                os.fsync(handle.fileno())
            self.fs.mv(temporary, target)
            _fsync_directory(parent)
        except BaseException:
            with contextlib.suppress(OSError):
                self.fs.rm_file(temporary)
            raise

    @contextlib.contextmanager
    def _stage_and_upload(self, target: str) -> Iterator[BinaryIO]:
        # Staged on local disk, not in memory: a checkpoint can be larger than spare RAM.
        with tempfile.TemporaryDirectory(prefix="rallypoint-fsspec-") as staging:
            local = os.path.join(staging, "object")
            with open(local, "wb") as handle:
                yield handle
            self.fs.put_file(local, target)

    @contextlib.contextmanager
    def reader(self, name: str) -> Iterator[BinaryIO]:
        with self.fs.open(self.path(name), "rb") as handle:
            yield cast(BinaryIO, handle)

    def names(self) -> list[str]:
        # Another process (rank 0) writes: what this process listed before may be stale.
        self.fs.invalidate_cache(self.root)
        try:
            found: list[str] = self.fs.find(self.root)
        except FileNotFoundError:
            return []
        prefix = f"{self.root}/"
        return sorted(
            path.removeprefix(prefix)
            for path in found
            if path.startswith(prefix) and not posixpath.basename(path).startswith(TEMPORARY)
        )

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(name), recursive=True)


def _fsync_directory(path: str) -> None:
    """Make a rename in ``path`` survive a power cut (the ``rename`` way is local only)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

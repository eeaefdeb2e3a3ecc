"""``ExampleCheckpointBackendStorage``: checkpoints under ``examplefs:///a/directory``.

A placeholder that keeps objects in a local directory; replace the four operations with
calls to your service. rallypoint builds its checkpoint format (manifest, checksums,
rotation, fallback to an older checkpoint) on these four.
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

_PARTIAL = ".partial-"


class ExampleCheckpointBackendStorage:
    def __init__(self, url: str) -> None:
        self.url = url
        self.root = Path(unquote(urlparse(url).path))
        self.root.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[BinaryIO]:
        """The object appears whole when the block ends, and not at all if it raises; a
        crash at any moment leaves the old object or the whole new one: it is written under
        a partial name and fsynced, renamed over the target, and the directory fsynced
        (only then is the rename on disk)."""
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{_PARTIAL}{target.name}-{uuid.uuid4().hex}")
        try:
            with open(partial, "wb") as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, target)
            _fsync_directory(target.parent)
        finally:
            partial.unlink(missing_ok=True)

    @contextlib.contextmanager
    def reader(self, name: str) -> Iterator[BinaryIO]:
        with open(self.root / name, "rb") as handle:  # FileNotFoundError when absent
            yield handle

    def names(self) -> list[str]:
        """Every complete object, never one being written."""
        return sorted(
            path.relative_to(self.root).as_posix()
            for path in self.root.rglob("*")
            if path.is_file() and not path.name.startswith(_PARTIAL)
        )

    def delete(self, name: str) -> None:
        """Remove ``name`` and everything under ``name/``."""
        path = self.root / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _fsync_directory(path: Path) -> None:
    """Write the directory's entries to disk: a rename is durable only then."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

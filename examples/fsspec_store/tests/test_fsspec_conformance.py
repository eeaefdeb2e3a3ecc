"""The fsspec checkpoint backend against rallypoint's checkpoint backend conformance suite, on
fsspec's local file system (the ``rename`` way of writing) and on its memory file system
(the ``upload`` way, the one S3, GCS and Azure take)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from rallypoint.testing.checkpoint_storage_conformance import (
    CheckpointStorageConformance,
    OpenStorage,
)
from rallypoint_fsspec.storage import FsspecStorage


class TestLocal(CheckpointStorageConformance):
    @pytest.fixture
    def open_storage(self, tmp_path: Path) -> OpenStorage:
        return lambda: FsspecStorage(f"local://{tmp_path}/checkpoints")


class TestMemory(CheckpointStorageConformance):
    @pytest.fixture
    def open_storage(self) -> Iterator[OpenStorage]:
        url = f"memory://rallypoint-fsspec-conformance-{uuid.uuid4().hex}"
        yield lambda: FsspecStorage(url)
        fs, root = fsspec.core.url_to_fs(url)
        if fs.exists(root):
            fs.rm(root, recursive=True)

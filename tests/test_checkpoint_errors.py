"""Checkpoint saves that fail: the error names the cause, what the save wrote is removed,
the checkpoints saved before are untouched. Real jobs on a full or read-only disk are in
tests/faults/test_checkpoint_faults.py; here the storage fails on purpose, in process."""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
import torch

from rallypoint.checkpoint import Checkpointer, CheckpointError, FileStorage
from rallypoint.checkpoint import manifest as mf


class FailingStorage(FileStorage):
    """A file storage whose writes of names ending in ``fail_writes`` fail with ENOSPC
    part-way, and whose deletes fail when ``fail_deletes`` is set."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.fail_writes: str | None = None
        self.fail_deletes = False

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[BinaryIO]:
        with super().writer(name) as handle:
            if self.fail_writes is not None and name.endswith(self.fail_writes):
                yield _Full(handle)  # type: ignore[misc]
            else:
                yield handle

    def delete(self, name: str) -> None:
        if self.fail_deletes:
            raise PermissionError(errno.EACCES, "Permission denied", name)
        super().delete(name)


class _Full:
    """A file on a disk with 100 bytes left."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.left = handle, 100

    def write(self, data: bytes) -> int:
        if len(data) > self.left:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.left -= len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def state_of(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4096,), value)}


@pytest.fixture
def storage(tmp_path: Path) -> FailingStorage:
    return FailingStorage(str(tmp_path))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["synchronous", "asynchronous"])
def test_a_failed_save_names_the_cause_and_leaves_nothing(
    storage: FailingStorage, asynchronous: bool
) -> None:
    checkpointer = Checkpointer(storage=storage, rank=0)
    checkpointer.save(state_of(1), 1)
    storage.fail_writes = "state.pt"
    # torch.save hides the disk's error behind its own ("unexpected pos ..."): it is named.
    with pytest.raises(CheckpointError, match="No space left on device") as raised:
        checkpointer.save(state_of(2), 2, asynchronous=asynchronous)
        checkpointer.wait()
    assert "checkpoint of step 2 not saved" in str(raised.value)
    assert storage.names() == sorted(
        f"{mf.directory(1)}/{name}" for name in ("begun", "manifest.json", "state.pt")
    )
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.step == 1 and loaded.skipped == ()


def test_saving_a_step_again_never_leaves_a_mix_of_old_and_new(
    storage: FailingStorage,
) -> None:
    checkpointer = Checkpointer(storage=storage, rank=0)
    checkpointer.save(state_of(1), 1)
    checkpointer.save(state_of(2), 2)
    storage.fail_writes = "manifest.json"  # the new state.pt is written, its manifest not
    with pytest.raises(CheckpointError, match="checkpoint of step 2 not saved"):
        checkpointer.save(state_of(20), 2)
    loaded = checkpointer.load_latest()
    assert loaded is not None and (loaded.step, loaded.skipped) == (1, ())
    assert checkpointer.steps() == [1]


def test_old_checkpoints_that_cannot_be_removed_do_not_fail_the_save(
    storage: FailingStorage, caplog: pytest.LogCaptureFixture
) -> None:
    checkpointer = Checkpointer(storage=storage, rank=0, keep_last=1)
    checkpointer.save(state_of(1), 1)
    storage.fail_deletes = True
    with caplog.at_level(logging.WARNING, logger="rallypoint.checkpoint"):
        checkpointer.save(state_of(2), 2)
    assert "checkpoint 2 saved, but older ones not removed: " in caplog.text
    assert checkpointer.steps() == [1, 2]
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.step == 2


def test_the_hashing_writer_keeps_the_disks_error() -> None:
    class Broken:
        def write(self, data: bytes) -> int:
            raise OSError(errno.EIO, "Input/output error")

        def flush(self) -> None:
            pass

    writer = mf.HashingWriter(Broken())  # type: ignore[arg-type]
    with pytest.raises(OSError):
        writer.write(b"data")
    assert isinstance(writer.error, OSError) and writer.error.errno == errno.EIO

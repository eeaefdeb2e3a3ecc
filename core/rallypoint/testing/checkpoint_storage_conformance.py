"""The conformance suite every checkpoint storage must pass.

A checkpoint backend's tests subclass ``CheckpointStorageConformance`` and provide one fixture,
``open_storage``: a callable that returns a new client (``CheckpointStorage``) of one
empty location of the real service (a temporary directory, a fresh bucket prefix), the
same location on every call, as another worker would open it. The suite checks the four
operations first, then rallypoint's checkpoint format on top of them:

* ``writer`` is atomic: the object appears whole when the block ends, never before; an
  exception in the block leaves nothing behind (or the previous object, untouched);
* ``names`` lists exactly the complete objects, never one still being written;
* ``reader`` returns what was written, or raises ``FileNotFoundError``;
* ``delete`` removes an object, or everything under a prefix (``step-1/`` and not
  ``step-10/``), and deleting nothing is fine;
* through ``rallypoint.checkpoint.Checkpointer``: saves rotate to ``keep_last``, and loading
  skips a newer checkpoint that is unfinished or corrupt and takes the one before.

The last two need torch (a dependency of rallypoint).

    import pytest
    from rallypoint_mystore import MyStorage
    from rallypoint.testing.checkpoint_storage_conformance import CheckpointStorageConformance

    class TestMyStorage(CheckpointStorageConformance):
        @pytest.fixture
        def open_storage(self, tmp_path):
            return lambda: MyStorage(f"my://{tmp_path}/checkpoints")
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from rallypoint.interfaces import CheckpointStorage

OpenStorage = Callable[[], CheckpointStorage]


class _Crash(Exception):
    """Raised inside a writer block, as a worker dying mid-write would stop it."""


def write(storage: CheckpointStorage, name: str, data: bytes) -> None:
    with storage.writer(name) as handle:
        handle.write(data)


def read(storage: CheckpointStorage, name: str) -> bytes:
    with storage.reader(name) as handle:
        data: bytes = handle.read()
    return data


class CheckpointStorageConformance:
    """Subclass with an ``open_storage`` fixture; every test runs on the real storage."""

    @pytest.fixture
    def storage(self, open_storage: OpenStorage) -> CheckpointStorage:
        return open_storage()

    # --- the storage operations ---------------------------------------------------------

    def test_starts_empty(self, storage: CheckpointStorage) -> None:
        assert storage.names() == [], "open_storage must give an empty location"
        assert isinstance(storage.url, str) and storage.url

    def test_round_trip_bytes(self, storage: CheckpointStorage) -> None:
        payloads = {
            "binary": bytes(range(256)) * 3,
            "empty": b"",
            "step-000000000001/nested/deeper.bin": os.urandom(1000),
        }
        for name, data in payloads.items():
            write(storage, name, data)
        for name, data in payloads.items():
            assert read(storage, name) == data, name
        assert sorted(storage.names()) == sorted(payloads)

    def test_a_large_object_written_in_pieces(self, storage: CheckpointStorage) -> None:
        piece = os.urandom(1 << 20)
        with storage.writer("large") as handle:
            for _ in range(4):
                handle.write(piece)
        assert read(storage, "large") == piece * 4

    def test_missing_object_is_file_not_found(self, storage: CheckpointStorage) -> None:
        with pytest.raises(FileNotFoundError), storage.reader("absent"):
            pass

    def test_overwrite_replaces_the_whole_object(self, storage: CheckpointStorage) -> None:
        write(storage, "obj", b"x" * 1000)
        write(storage, "obj", b"short")
        assert read(storage, "obj") == b"short"
        assert storage.names() == ["obj"]

    def test_an_unfinished_write_is_invisible(self, open_storage: OpenStorage) -> None:
        storage, other = open_storage(), open_storage()
        write(storage, "old", b"previous")
        with storage.writer("new") as handle:
            handle.write(b"half of it")
            for client in (storage, other):
                assert "new" not in client.names(), "names() shows an object being written"
                with pytest.raises(FileNotFoundError), client.reader("new"):
                    pass
        assert read(other, "new") == b"half of it"
        with storage.writer("old") as handle:
            handle.write(b"replacement, half")
            assert read(other, "old") == b"previous", "an unfinished overwrite is visible"
        assert read(other, "old") == b"replacement, half"

    def test_an_exception_in_the_writer_leaves_nothing(
        self, storage: CheckpointStorage, open_storage: OpenStorage
    ) -> None:
        with pytest.raises(_Crash), storage.writer("crashed") as handle:
            handle.write(b"partial data")
            raise _Crash
        assert storage.names() == []
        with pytest.raises(FileNotFoundError), open_storage().reader("crashed"):
            pass

    def test_an_exception_while_overwriting_keeps_the_old_object(
        self, storage: CheckpointStorage
    ) -> None:
        write(storage, "obj", b"intact")
        with pytest.raises(_Crash), storage.writer("obj") as handle:
            handle.write(b"garbage")
            raise _Crash
        assert read(storage, "obj") == b"intact"
        assert storage.names() == ["obj"]

    def test_another_client_sees_complete_objects(
        self, storage: CheckpointStorage, open_storage: OpenStorage
    ) -> None:
        write(storage, "step-000000000005/state.pt", b"state")
        other = open_storage()
        assert other.names() == ["step-000000000005/state.pt"]
        assert read(other, "step-000000000005/state.pt") == b"state"

    def test_delete_an_object(self, storage: CheckpointStorage) -> None:
        write(storage, "a", b"1")
        write(storage, "b", b"2")
        storage.delete("a")
        assert storage.names() == ["b"]
        with pytest.raises(FileNotFoundError), storage.reader("a"):
            pass

    def test_delete_a_prefix_and_nothing_beside_it(self, storage: CheckpointStorage) -> None:
        for name in ("step-1/state.pt", "step-1/manifest.json", "step-1/shards/0.distcp"):
            write(storage, name, b"old")
        for name in ("step-10/state.pt", "step-1.bak", "other"):
            write(storage, name, b"keep")
        storage.delete("step-1")
        assert sorted(storage.names()) == ["other", "step-1.bak", "step-10/state.pt"]

    def test_deleting_nothing_is_fine(self, storage: CheckpointStorage) -> None:
        storage.delete("never-written")
        storage.delete("no/such/prefix")
        assert storage.names() == []

    # --- rallypoint's checkpoints on top ------------------------------------------------

    def _checkpointer(self, storage: CheckpointStorage, keep_last: int = 3) -> Any:
        pytest.importorskip("torch")
        from rallypoint.checkpoint import Checkpointer

        return Checkpointer(storage=storage, keep_last=keep_last, rank=0, world_size=1)

    def test_checkpoints_rotate(self, storage: CheckpointStorage) -> None:
        checkpointer = self._checkpointer(storage, keep_last=2)
        for step in (10, 20, 30, 40):
            checkpointer.save({"step": step}, step)
        assert checkpointer.steps() == [30, 40]
        loaded = checkpointer.load_latest()
        assert loaded is not None and (loaded.step, loaded.state) == (40, {"step": 40})
        assert not any(
            name.startswith(("step-000000000010", "step-000000000020")) for name in storage.names()
        )

    def test_a_corrupt_checkpoint_falls_back_to_the_one_before(
        self, storage: CheckpointStorage
    ) -> None:
        from rallypoint.checkpoint import manifest

        checkpointer = self._checkpointer(storage)
        checkpointer.save({"weights": [1.0, 2.0]}, 1)
        checkpointer.save({"weights": [3.0, 4.0]}, 2)
        write(storage, f"{manifest.directory(2)}/state.pt", b"bit rot")
        loaded = self._checkpointer(storage).load_latest()
        assert loaded is not None and loaded.step == 1
        assert loaded.state == {"weights": [1.0, 2.0]}
        assert len(loaded.skipped) == 1 and manifest.directory(2) in loaded.skipped[0]

    def test_an_unfinished_checkpoint_is_skipped_and_cleaned_up(
        self, storage: CheckpointStorage
    ) -> None:
        from rallypoint.checkpoint import manifest

        checkpointer = self._checkpointer(storage)
        checkpointer.save({"step": 1}, 1)
        checkpointer.save({"step": 2}, 2)
        storage.delete(f"{manifest.directory(2)}/{manifest.MANIFEST}")  # died before the manifest
        loaded = self._checkpointer(storage).load_latest()
        assert loaded is not None and loaded.step == 1
        assert "unfinished" in loaded.skipped[0]
        checkpointer.save({"step": 3}, 3)
        assert checkpointer.steps() == [1, 3]
        assert not any(name.startswith(manifest.directory(2)) for name in storage.names())

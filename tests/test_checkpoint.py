"""Checkpoints: the file storage, the format on top (manifest, checksums, rotation,
fallback) and the recovery chain of a real job: crash, restart, resume, same weights."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from launch import rallypoint, worker
from rallypoint.checkpoint import Checkpointer, CheckpointError, FileStorage
from rallypoint.checkpoint import manifest as mf

pytestmark = pytest.mark.usefixtures("agent_tmpdir")


def state_of(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


# --- storage -------------------------------------------------------------------------------


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    storage = FileStorage(str(tmp_path))
    with storage.writer("a/blob") as handle:
        handle.write(b"old")
    with pytest.raises(RuntimeError), storage.writer("a/blob") as handle:
        handle.write(b"new, half")
        raise RuntimeError("the process dies here")
    with storage.reader("a/blob") as handle:
        assert handle.read() == b"old"
    assert storage.names() == ["a/blob"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["blob"]


def test_file_urls_and_plain_paths_are_the_same_place(tmp_path: Path) -> None:
    FileStorage(str(tmp_path)).delete("nothing")  # deleting what is absent is fine
    with FileStorage(f"file://{tmp_path}").writer("x") as handle:
        handle.write(b"1")
    assert FileStorage(str(tmp_path)).names() == ["x"]


# --- the checkpoint format -----------------------------------------------------------------


def test_save_load_and_keep_last(tmp_path: Path) -> None:
    checkpointer = Checkpointer(str(tmp_path), keep_last=2, rank=0, world_size=4)
    assert checkpointer.load_latest() is None
    for step in range(5):
        checkpointer.save(state_of(step), step)
    assert checkpointer.steps() == [3, 4]
    loaded = checkpointer.load_latest()
    assert loaded is not None
    assert (loaded.step, loaded.world_size, loaded.skipped) == (4, 4, ())
    assert torch.equal(loaded.state["w"], torch.full((4,), 4.0))
    manifest = json.loads((tmp_path / mf.directory(4) / "manifest.json").read_text())
    assert (
        manifest["files"]["state.pt"]["size"]
        == (tmp_path / mf.directory(4) / "state.pt").stat().st_size
    )


def test_only_rank_0_writes(tmp_path: Path) -> None:
    Checkpointer(str(tmp_path), rank=1).save(state_of(1), 1)
    assert FileStorage(str(tmp_path)).names() == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-manifest", "bad-manifest"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    checkpointer = Checkpointer(str(tmp_path), rank=0)
    checkpointer.save(state_of(1), 1)
    checkpointer.save(state_of(2), 2)
    newest = tmp_path / mf.directory(2)
    state_file = newest / "state.pt"
    data = state_file.read_bytes()
    if damage == "truncate":
        state_file.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        state_file.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    elif damage == "no-manifest":
        (newest / "manifest.json").unlink()
    else:
        (newest / "manifest.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="rallypoint.checkpoint"):
        loaded = Checkpointer(str(tmp_path), rank=1).load_latest()
    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.state["w"], torch.full((4,), 1.0))
    assert len(loaded.skipped) == 1 and mf.directory(2) in loaded.skipped[0]
    reason = {
        "truncate": "has", "flip": "does not match its checksum",
        "no-manifest": "unfinished (no manifest)", "bad-manifest": "unreadable manifest",
    }[damage]  # fmt: skip
    assert reason in loaded.skipped[0]
    assert f"checkpoint {mf.directory(2)} skipped" in caplog.text
    assert f"loaded checkpoint {mf.directory(1)} instead" in caplog.text


def test_an_asynchronous_save_writes_the_state_as_it_was(tmp_path: Path) -> None:
    """Training goes on at once, and its optimizer's step waits for the copy: the
    checkpoint holds the tensors as they were when ``save`` was called."""
    checkpointer = Checkpointer(str(tmp_path), rank=0)
    weight = torch.nn.Parameter(torch.full((4,), 1.0))
    optimizer = torch.optim.SGD([weight], lr=100.0)
    checkpointer.save({"w": weight.detach()}, 7, asynchronous=True)
    weight.sum().backward()
    optimizer.step()  # changes the tensor in place, once its copy is done
    checkpointer.wait()
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.step == 7
    assert torch.equal(loaded.state["w"], torch.full((4,), 1.0))
    assert torch.equal(weight.detach(), torch.full((4,), -99.0))


def test_an_asynchronous_save_whose_tensor_changes_outside_an_optimizer_says_so(
    tmp_path: Path,
) -> None:
    """A change the save cannot see coming (an in-place update outside an optimizer, before
    the copy is done) makes the save fail with one sentence, not a torn checkpoint."""
    checkpointer = Checkpointer(str(tmp_path), rank=0)
    checkpointer.save(state_of(1), 1)
    state = {"w": torch.zeros(8 << 20)}  # 32 MB: its copy takes a while
    checkpointer.save(state, 2, asynchronous=True)
    state["w"].add_(1)
    try:
        checkpointer.wait()
    except CheckpointError as error:  # the change came before the copy was done
        assert "'w' changed while it was copied" in str(error)
        assert checkpointer.steps() == [1]
    else:  # the copy was done first: then it holds the tensor as it was
        loaded = checkpointer.load_latest()
        assert loaded is not None and loaded.step == 2 and float(loaded.state["w"].max()) == 0.0


def test_no_location_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RALLYPOINT_CHECKPOINT_URL", raising=False)
    with pytest.raises(CheckpointError, match="--checkpoint-dir"):
        Checkpointer()


def test_a_process_killed_during_an_asynchronous_save_leaves_the_previous(
    tmp_path: Path,
) -> None:
    root = tmp_path / "checkpoints"
    script = textwrap.dedent(
        f"""
        import os, signal, time
        from pathlib import Path
        import torch
        from rallypoint.checkpoint import Checkpointer

        root = Path({str(root)!r})
        checkpointer = Checkpointer(str(root), rank=0)
        checkpointer.save({{"w": torch.ones(4)}}, 1)
        checkpointer.save({{"w": torch.zeros(64, 1024, 1024)}}, 2, asynchronous=True)
        deadline = time.monotonic() + 30
        while not list(root.glob("step-*2/.tmp-state.pt-*")):  # the write has begun
            assert time.monotonic() < deadline
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True)
    assert result.returncode == -9, result.stderr.decode()
    checkpointer = Checkpointer(str(root), rank=0)
    assert checkpointer.steps() == [1]
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.state["w"], torch.ones(4))
    assert loaded.skipped == (f"{mf.directory(2)}: unfinished (no manifest)",)
    checkpointer.save({"w": torch.ones(4)}, 3)  # the next save clears the leftovers
    assert sorted(p.name for p in root.iterdir()) == [mf.directory(1), mf.directory(3)]


# --- the recovery chain, end to end --------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_killed_worker_resumes_and_ends_with_the_same_weights(
    tmp_path: Path, asynchronous: bool
) -> None:
    mode = ["--asynchronous"] if asynchronous else []

    def train(name: str, *extra: str) -> Path:
        out = tmp_path / f"{name}.pt"
        events = tmp_path / f"{name}.jsonl"
        result = rallypoint(
            "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            "--checkpoint-dir", str(tmp_path / name), "--event-log", str(events),
            worker("ckpt_train.py"), "23", str(out), *mode, *extra,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return out

    interrupted = train("interrupted", "--kill-at", "17")
    uninterrupted = train("uninterrupted")
    records = [
        json.loads(line) for line in (tmp_path / "interrupted.jsonl").read_text().splitlines()
    ]
    failed = [r for r in records if r["event"] == "worker_failed"]
    assert failed and failed[0]["signal"] == "SIGKILL"
    loads = [r for r in records if r["event"] == "checkpoint_loaded"]
    # Both ranks resumed from the newest checkpoint before the kill: step 15 (an
    # asynchronous save of step 15 may still be running when rank 0 is stopped: then 10).
    assert {r["step"] for r in loads} in ({15}, {10} if asynchronous else {15}), loads
    assert len(loads) == 2
    saves = [r for r in records if r["event"] == "checkpoint_saved"]
    assert saves and all(r["bytes"] > 0 and r["seconds"] >= 0 for r in saves)
    assert all(r["asynchronous"] is asynchronous for r in saves)
    ours, reference = torch.load(interrupted), torch.load(uninterrupted)
    assert ours.keys() == reference.keys()
    for name in ours:
        assert torch.equal(ours[name], reference[name]), name  # bit for bit
    assert os.listdir(tmp_path / "interrupted")  # the checkpoints are still there


def test_sharded_checkpoints_are_verified_like_the_others(tmp_path: Path) -> None:
    root = tmp_path / "sharded"

    def run(*args: str) -> str:
        result = rallypoint(
            "run", "--standalone", "--nproc-per-node", "2", "--checkpoint-dir", str(root),
            worker("sharded.py"), *args,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result.stdout

    run("save", "1", "10")
    run("save", "2", "20")
    manifest = json.loads((root / mf.directory(2) / "manifest.json").read_text())
    assert manifest["format"] == "dcp"
    assert any(name.startswith("shards/") for name in manifest["files"])
    out = run("load")
    assert "rank=0 step=2 value=20" in out and "rank=1 step=2 value=21" in out
    shard = next(p for p in (root / mf.directory(2) / "shards").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-1])  # truncated: step 2 is skipped
    out = run("load")
    assert "rank=0 step=1 value=10" in out and "rank=1 step=1 value=11" in out

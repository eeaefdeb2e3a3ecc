"""Checkpoint faults: the disk fills up during a save, a checkpoint file is truncated or has
a flipped byte, the checkpoint directory turns read-only.

The jobs are ``tests/workers/faulty.py`` with ``--save-every``: rank 0 saves a checkpoint
every 5 steps (``rallypoint.checkpoint``), every rank resumes from the newest one and checks
that it holds the state of its step. Full and read-only disks are small tmpfs mounts, which
needs root (a container's root is enough where it may mount); elsewhere those tests skip.

What is expected (docs/checkpointing.md, "Errors"): a save that cannot be written raises
``CheckpointError`` naming the cause, after removing what it wrote; the checkpoints saved
before stay loadable. Uncaught, the error ends the worker, and the job fails with it as the
root cause. A damaged checkpoint is skipped with a warning and the one before is loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fault_setups import Recovery
from faulty_job import job_directory, records, run_faulty

from launch import assert_no_worker_left, events
from rallypoint.checkpoint import Checkpointer
from rallypoint.checkpoint import manifest as mf

#: The state rank 0 saves, in KiB: two fit on the 2 MiB disk, a third does not.
STATE_KB = 700
DISK = "2m"


@pytest.fixture
def job(tmp_path: Path) -> Path:
    return job_directory(tmp_path)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the block; the test skips where this
    process may not mount."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system (tmpfs) needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        unmounted = subprocess.run(["umount", str(path)], capture_output=True, timeout=30)
        if unmounted.returncode != 0:  # something still has a file open: detach it anyway
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def make_read_only(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, timeout=30)


def save_steps(directory: Path, *steps: int, state_kb: int = 16) -> None:
    """Checkpoints as faulty.py saves them, written by this process."""
    checkpointer = Checkpointer(str(directory), rank=0)
    for step in steps:
        state = {"w": torch.full((state_kb * 256,), float(step)), "step": step}
        checkpointer.save(state, step)


def assert_intact(directory: Path, steps: list[int]) -> None:
    """Exactly ``steps`` are on disk, complete, and the newest loads with its own state;
    nothing half-written is left (temporary files, unfinished checkpoints)."""
    checkpointer = Checkpointer(str(directory), rank=1)
    assert checkpointer.steps() == steps
    names = checkpointer.storage.names()
    assert {name.split("/")[0] for name in names} == {mf.directory(step) for step in steps}
    leftovers = [p for p in directory.rglob("*") if p.name.startswith(".tmp-")]
    assert leftovers == [], leftovers
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.step == steps[-1] and loaded.skipped == ()
    assert torch.equal(loaded.state["w"], torch.full_like(loaded.state["w"], steps[-1]))


def failure_report(job: Path) -> dict[str, object]:
    (path,) = (job / "logs").glob("*/failure.json")
    root = json.loads(path.read_text())["root_cause"]
    assert isinstance(root, dict)
    return root


def seconds_to_failure_report(job: Path) -> float:
    """From the worker's failure (its traceback) to the agent's exit with the report."""
    failed = events(job / "events.log", "worker_failed")
    (stopping,) = events(job / "events.log", "agent_stopping")
    return round(stopping["wall_time"] - failed[0]["timestamp"], 2)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["synchronous", "asynchronous"])
@pytest.mark.fault(
    "Disk full during a checkpoint save",
    expected=(
        "the save raises CheckpointError naming ENOSPC and removes what it wrote; the "
        "previous checkpoints stay loadable; the job fails with that root cause"
    ),
)
def test_a_full_disk_fails_the_save_not_the_checkpoints(
    job: Path, tmp_path: Path, recovery: Recovery, asynchronous: bool
) -> None:
    with tmpfs(tmp_path / "checkpoints", DISK) as directory:
        args = ["--steps", "20", "--save-every", "5", "--state-kb", str(STATE_KB)]
        if asynchronous:
            args.append("--asynchronous")  # the error surfaces in the next save, step 15
        options = ("--checkpoint-dir", str(directory), "--log-dir", str(job / "logs"))
        result = run_faulty(job, *args, options=options, restarts=0)
        assert result.returncode == 1, result.stderr
        root = failure_report(job)
        assert root["rank"] == 0, root
        message = str(root["message"])
        assert "CheckpointError: " in message, root
        assert "checkpoint of step 10 not saved" in message, root
        assert "No space left on device" in message, root
        if asynchronous:
            assert "the background checkpoint save failed" in message
            # ... and logged by the writer the moment it failed, not only at the next save
            assert "asynchronous save: checkpoint of step 10 not saved" in result.stderr
        recovery.seconds = seconds_to_failure_report(job)
        recovery.notes.append("to the failure report")
        assert_no_worker_left(str(job))
        assert_intact(directory, [0, 5])


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
@pytest.mark.fault(
    "Newest checkpoint damaged (truncated file, flipped byte)",
    expected="skipped with a warning; every rank resumes from the one before; the job finishes",
)
def test_a_damaged_checkpoint_is_skipped_and_the_job_resumes_before_it(
    job: Path, tmp_path: Path, recovery: Recovery, damage: str
) -> None:
    directory = tmp_path / "checkpoints"
    save_steps(directory, 0, 5, 10)
    state_file = directory / mf.directory(10) / "state.pt"
    data = state_file.read_bytes()
    if damage == "truncated":
        state_file.write_bytes(data[: len(data) // 2])
        reason = f"state.pt has {len(data) // 2} bytes, the manifest says {len(data)}"
    else:
        middle = len(data) // 2
        state_file.write_bytes(data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :])
        reason = "state.pt does not match its checksum"
    args = ("--steps", "20", "--save-every", "5")
    result = run_faulty(job, *args, options=("--checkpoint-dir", str(directory)), restarts=0)
    assert result.returncode == 0, result.stderr
    skipped = f"checkpoint {mf.directory(10)} skipped: {reason}"
    assert result.stderr.count(skipped) == 2, result.stderr  # a warning from each rank
    loaded = records(job, "loaded")
    assert [(row["step"], row["skipped"]) for row in loaded] == [
        (5, [f"{mf.directory(10)}: {reason}"])
    ] * 2
    load_events = events(job / "events.log", "checkpoint_loaded")
    assert [(e["step"], e["skipped"]) for e in load_events] == [(5, 1), (5, 1)]
    recovery.seconds = round(max(e["seconds"] for e in load_events), 3)
    recovery.notes.append("the load that skips the damaged checkpoint")
    assert sorted(row["rank"] for row in records(job, "done")) == [0, 1]
    assert_no_worker_left(str(job))
    assert_intact(directory, [5, 10, 15])  # step 10 saved again, whole


@pytest.mark.fault(
    "Checkpoint directory read-only",
    expected=(
        "the newest checkpoint still loads; the first save raises CheckpointError naming "
        "the read-only file system; the job fails with that root cause"
    ),
)
def test_a_read_only_checkpoint_directory_fails_the_save(
    job: Path, tmp_path: Path, recovery: Recovery
) -> None:
    with tmpfs(tmp_path / "checkpoints", DISK) as directory:
        save_steps(directory, 0, 5)
        make_read_only(directory)
        args = ("--steps", "20", "--save-every", "5")
        options = ("--checkpoint-dir", str(directory), "--log-dir", str(job / "logs"))
        result = run_faulty(job, *args, options=options, restarts=0)
        assert result.returncode == 1, result.stderr
        assert [row["step"] for row in records(job, "loaded")] == [5, 5]
        root = failure_report(job)
        assert root["rank"] == 0, root
        message = str(root["message"])
        assert "CheckpointError: checkpoint of step 10 not saved" in message, root
        assert "Read-only file system" in message, root
        recovery.seconds = seconds_to_failure_report(job)
        recovery.notes.append("to the failure report")
        assert_no_worker_left(str(job))
        assert_intact(directory, [0, 5])

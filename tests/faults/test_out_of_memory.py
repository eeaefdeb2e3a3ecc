"""A worker killed by the kernel's out-of-memory killer is reported as out of memory, not
as a plain SIGKILL: in the console report, failure.json and the event log. The agent runs
in a memory cgroup of the test's with a limit the worker exceeds."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_setups import Recovery

from launch import RALLYPOINT, clean_environment, events, worker
from rallypoint.agent.processes import oom

LIMIT = 400 << 20


def _memory_cgroup_root() -> Path | None:
    """This process's memory cgroup directory, v1 or v2, if it can take a child."""
    counter = oom.counter_file()
    return None if counter is None else counter.parent


@pytest.fixture
def cgroup(tmp_path: Path) -> Iterator[Path]:
    """A child memory cgroup limited to LIMIT bytes (skipped where none can be made: not
    root, no memory controller)."""
    root = _memory_cgroup_root()
    if root is None:
        pytest.skip("no memory cgroup to make a child of")
    child = root / f"rallypoint-test-{os.getpid()}-{tmp_path.name}"
    try:
        child.mkdir()
    except OSError as error:
        pytest.skip(f"cannot make a memory cgroup here: {error.strerror}")
    try:
        limit = child / "memory.limit_in_bytes"
        (limit if limit.exists() else child / "memory.max").write_text(str(LIMIT))
        yield child
    finally:
        child.rmdir()


@pytest.mark.fault(
    "Worker killed by the kernel's out-of-memory killer",
    expected="reported as killed by SIGKILL (out of memory), in the report, failure.json "
    "and the event log",
)
def test_an_oom_killed_worker_is_reported_as_out_of_memory(
    cgroup: Path, tmp_path: Path, recovery: Recovery
) -> None:
    log = tmp_path / "agent.log"
    command = [
        RALLYPOINT, "run", "--log-dir", str(tmp_path / "logs"),
        "--event-log", str(log.with_suffix(".jsonl")), worker("hog.py"),
    ]  # fmt: skip
    script = f'echo $$ > {cgroup / "cgroup.procs"} && exec "$@"'
    result = subprocess.run(
        ["sh", "-c", script, "sh", *command],
        capture_output=True,
        text=True,
        env=clean_environment(),
        timeout=120,
    )
    log.write_text(result.stderr)
    assert result.returncode == 1, result.stderr
    assert "root cause: rank 0 (local rank 0)" in result.stderr
    assert "killed by SIGKILL (out of memory)" in result.stderr, result.stderr
    (report,) = (tmp_path / "logs").glob("*/failure.json")
    root = json.loads(report.read_text())["root_cause"]
    assert (root["signal"], root["out_of_memory"]) == ("SIGKILL", True)
    (failed,) = events(log, "worker_failed")
    assert failed["out_of_memory"] is True


def test_a_sigkill_by_hand_is_not_out_of_memory(tmp_path: Path) -> None:
    from faulty_job import job_directory, run_faulty

    job = job_directory(tmp_path)
    result = run_faulty(job, "--fault", "sigkill", "--at", "2", "--steps", "5", restarts=0)
    assert result.returncode == 1, result.stderr
    assert "killed by SIGKILL" in result.stderr
    assert "out of memory" not in result.stderr


def test_the_kernel_log_names_the_pids_it_killed(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(
        "6,421,1,-;[  pid  ]   uid  tgid total_vm      rss name\n"
        "6,423,2,-;oom-kill:constraint=CONSTRAINT_MEMCG,task=python3,pid=4242,uid=0\n"
        "3,424,3,-;Memory cgroup out of memory: Killed process 4343 (python3) total-vm:1kB\n"
    )
    assert oom.killed_pids([4242, 4343, 4444], kmsg=str(log)) == {4242, 4343}
    assert oom.killed_pids([1], kmsg=str(tmp_path / "absent")) is None

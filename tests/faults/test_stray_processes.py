"""Nothing a job starts outlives its agent: not the workers, not what the workers start.

Each worker (tests/workers/spawner.py) starts a ``subprocess.Popen`` child, a
``multiprocessing`` fork child, a child in a process group of its own and a daemon that
escaped by a double fork and ``setsid``; every one of them must be gone once the agent is
SIGKILLed, once a worker group is restarted, once the job ends, and once the keeper that
holds the workers is killed.
"""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fault_setups import Recovery

from launch import rallypoint, start_rallypoint, wait_gone, worker

#: Agent SIGKILLs in a row, each counted: the issue's bar is zero processes left every time.
RUNS = 20


def start_job(tag: Path, *options: str, then: str = "sleep") -> subprocess.Popen[str]:
    """A standalone agent of two spawner.py workers writing to ``tag``."""
    return start_rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", *options,
        worker("spawner.py"), str(tag), "--then", then,
        log=tag / "agent.log",
    )  # fmt: skip


def spawned(tag: Path, attempt: int, timeout: float = 60) -> list[int]:
    """The pids that attempt ``attempt``'s two workers wrote: theirs and their children's."""
    deadline = time.monotonic() + timeout
    paths = [tag / f"pids-{attempt}-{rank}.json" for rank in (0, 1)]
    while not all(path.exists() for path in paths):
        assert time.monotonic() < deadline, (tag / "agent.log").read_text()
        time.sleep(0.02)
    return [pid for path in paths for pid in json.loads(path.read_text()).values()]


def tagged(tag: Path) -> list[int]:
    """Processes still running whose command line names ``tag``."""
    found = subprocess.run(["pgrep", "-f", str(tag)], capture_output=True, text=True, timeout=10)
    return [int(pid) for pid in found.stdout.split()]


def children(pid: int) -> list[int]:
    text = ""
    for task in Path(f"/proc/{pid}/task").iterdir():
        text += (task / "children").read_text()
    return [int(child) for child in text.split()]


def left_after(pids: list[int], timeout: float = 10) -> list[int]:
    """Those of ``pids`` still running after ``timeout`` seconds (zombies count as gone)."""
    try:
        wait_gone(pids, timeout)
    except AssertionError:
        return [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    return []


@pytest.mark.fault(
    "Agent SIGKILL, workers with children of every kind",
    expected=f"nothing of the job is left, {RUNS} times out of {RUNS}: workers, their "
    "Popen, fork, own-group and double-forked setsid children, and the keeper",
)
def test_nothing_outlives_a_sigkilled_agent(tmp_path: Path, recovery: Recovery) -> None:
    def one_run(run: int) -> tuple[list[int], float]:
        """An agent SIGKILLed once its workers started everything: what is left, and how
        long the rest took to go."""
        tag = tmp_path / f"run-{run}"
        tag.mkdir()
        agent = start_job(tag)
        try:
            pids = spawned(tag, 0)
            keeper = children(agent.pid)
            assert len(keeper) == 1, keeper
            assert len(pids) == 10, pids
            killed_at = time.monotonic()
            agent.kill()
            agent.wait(timeout=30)
            return left_after([*pids, *keeper]), time.monotonic() - killed_at
        finally:
            agent.kill()

    with ThreadPoolExecutor(2) as pool:  # two agents at a time: the runs are independent
        runs = list(pool.map(one_run, range(RUNS)))
    left = [pid for found, _ in runs for pid in found]
    assert left == [], f"processes left after {RUNS} agent SIGKILLs: {left}"
    assert tagged(tmp_path) == []
    recovery.seconds = round(max(seconds for _, seconds in runs), 2)
    recovery.notes.append(f"{RUNS} runs; the slowest was cleared in this many seconds")


@pytest.mark.fault(
    "Worker fails, its children of every kind still running",
    expected="the restarted attempt starts with nothing of the first left running",
)
def test_a_restart_leaves_nothing_of_the_attempt_before(tmp_path: Path, recovery: Recovery) -> None:
    agent = start_job(tmp_path, "--max-restarts", "1", then="fail-once")
    try:
        first = spawned(tmp_path, 0)
        began = time.monotonic()
        spawned(tmp_path, 1)
        recovery.seconds = round(time.monotonic() - began, 2)
        assert left_after(first, timeout=0) == [], (tmp_path / "agent.log").read_text()
    finally:
        agent.kill()
        agent.wait(timeout=30)
    assert left_after(tagged(tmp_path)) == []


@pytest.mark.fault(
    "Workers succeed, leaving children of every kind running",
    expected="the agent exits 0 at once, and nothing the workers started is left",
)
def test_the_end_of_the_job_leaves_nothing(tmp_path: Path, recovery: Recovery) -> None:
    agent = start_job(tmp_path, then="exit0")
    try:
        pids = spawned(tmp_path, 0)
        began = time.monotonic()
        assert agent.wait(timeout=30) == 0, (tmp_path / "agent.log").read_text()
        recovery.seconds = round(time.monotonic() - began, 2)
        # The children held the workers' stdout: the agent did not wait for them.
        assert time.monotonic() - began < 8, (tmp_path / "agent.log").read_text()
    finally:
        agent.kill()
    assert left_after(pids, timeout=0) == []
    assert tagged(tmp_path) == []


@pytest.mark.fault(
    "Workers stopped or ended, their multiprocessing helpers still running",
    expected="what they left gets SIGTERM and 2 s (HELPER_GRACE) before SIGKILL: a "
    "resource tracker unlinks the semaphores of its stopped worker",
)
def test_what_workers_leave_gets_sigterm_before_sigkill(tmp_path: Path, recovery: Recovery) -> None:
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        worker("helpers.py"), str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # Rank 0 was stopped (SIGTERM) while its lock was registered: its tracker unlinked it.
    name = (tmp_path / "0-0.sem").read_text().lstrip("/")
    assert not Path(f"/dev/shm/sem.{name}").exists()
    # The helpers that handle SIGTERM got it, after a failure and at the job's end; the
    # ones that ignore it were killed.
    assert sorted(path.name for path in tmp_path.glob("*.term")) == [
        "0-0.term", "0-1.term", "1-0.term", "1-1.term",
    ]  # fmt: skip
    assert "process(es) the workers had left running" in result.stderr
    assert left_after(tagged(tmp_path)) == []


@pytest.mark.fault(
    "The keeper (the process holding the workers) SIGKILLed",
    expected="the workers die with it, what they started is stopped by the agent, and a "
    "new keeper starts the restarted workers",
)
def test_a_killed_keeper_is_replaced_and_leaves_nothing(tmp_path: Path, recovery: Recovery) -> None:
    agent = start_job(tmp_path, "--max-restarts", "1")
    try:
        first = spawned(tmp_path, 0)
        (keeper,) = children(agent.pid)
        began = time.monotonic()
        subprocess.run(["kill", "-KILL", str(keeper)], check=True, timeout=10)
        second = spawned(tmp_path, 1)
        recovery.seconds = round(time.monotonic() - began, 2)
        assert left_after(first) == [], (tmp_path / "agent.log").read_text()
        log = (tmp_path / "agent.log").read_text()
        assert "keeper process" in log
        # Stopped with the failed group, not only when the next keeper starts.
        assert "the workers had left running" in log.split("keeper process")[0], log
        agent.kill()
        agent.wait(timeout=30)
        assert left_after(second) == []
    finally:
        agent.kill()
    assert tagged(tmp_path) == []

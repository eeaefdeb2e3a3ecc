"""A standalone job of ``tests/workers/faulty.py`` and what its workers recorded: shared by
the worker and checkpoint fault tests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from launch import rallypoint, worker


def job_directory(tmp_path: Path) -> Path:
    """Where the workers of a test write, and their tag: a directory of its own, since a
    store server of the test has ``tmp_path`` in its command line too."""
    path = tmp_path / "faulty-job"
    path.mkdir()
    return path


def run_faulty(
    job: Path, *script_args: str, options: tuple[str, ...] = (), restarts: int = 1
) -> subprocess.CompletedProcess[str]:
    """``rallypoint run --standalone`` of two ``faulty.py`` workers writing to ``job``, with
    its event log in ``job/events.jsonl``; ``options`` go to the agent."""
    return rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts),
        "--event-log", str(job / "events.jsonl"), *options,
        worker("faulty.py"), str(job), *script_args,
        timeout=180,
    )  # fmt: skip


def records(job: Path, name: str) -> list[dict[str, Any]]:
    """The workers' ``name`` records (``training``, ``loaded``, ``done``), in order."""
    path = job / "record.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [row for row in map(json.loads, lines) if row["event"] == name]


def fault_time(job: Path) -> float:
    """When rank 1 injected the fault (wall time)."""
    fault = json.loads((job / "fault.json").read_text())
    assert fault["rank"] == 1, fault
    return float(fault["at"])


def seconds_to_training(job: Path, since: float, world: int = 2) -> float:
    """From ``since`` to the moment every rank trains again (has completed an all-reduce)."""
    again: dict[int, float] = {}
    for row in records(job, "training"):
        if row["at"] > since:
            again[row["rank"]] = min(row["at"], again.get(row["rank"], row["at"]))
    assert sorted(again) == list(range(world)), f"not every rank trained again: {again}"
    return round(max(again.values()) - since, 2)

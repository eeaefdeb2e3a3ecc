"""Each worker draws its own random numbers, warm as cold, as under torchrun.

The same script (tests/workers/random_sources.py) runs under ``rallypoint run`` (warm, the
default), ``rallypoint run --warm-start off`` and ``torchrun``, two workers, one failure
and a restart, once without seeding and once seeded. One test per random source a training
script draws from: without a seed it differs between the ranks and between the restarts
under every launcher; with one it is the same under all three.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from launch import rallypoint, torchrun, worker

LAUNCHERS = {
    "warm": lambda *args, **kw: rallypoint("run", *args, **kw),
    "cold": lambda *args, **kw: rallypoint("run", "--warm-start", "off", *args, **kw),
    "torchrun": torchrun,
}
#: What the script draws: Python's, numpy's and torch's generators, what they decide in
#: training (a dropout mask, a shuffled order, the data loader's worker seeds), CUDA's.
SOURCES = ["python", "numpy", "torch", "dropout", "shuffle", "loader_workers", "cuda"]
#: The draws of one run, by (restart, rank).
Draws = dict[tuple[int, int], dict[str, Any]]


def run(launcher: str, seeded: bool, directory: Path) -> Draws:
    directory.mkdir(parents=True)
    (directory / "tmp").mkdir()
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    script = [worker("random_sources.py"), str(directory), *(["--seed"] if seeded else [])]
    result = LAUNCHERS[launcher](*args, *script, env={"TMPDIR": str(directory / "tmp")})
    assert result.returncode == 0, result.stderr
    return {
        (restart, rank): json.loads((directory / f"{restart}-{rank}.json").read_text())
        for restart in (0, 1)
        for rank in (0, 1)
    }


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def draws(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Draws]:
    """Every launcher's draws, seeded and not: six jobs, run once per session however
    many test processes ask (pytest-xdist's workers share the session's base folder)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    results = shared / "warm-random.json"
    with _locked(shared / "warm-random.lock"):
        if not results.exists():
            found = {
                f"{launcher} {seeded}": {
                    f"{restart} {rank}": drawn
                    for (restart, rank), drawn in run(
                        launcher, seeded, shared / "warm-random" / f"{launcher}-{seeded}"
                    ).items()
                }
                for launcher in LAUNCHERS
                for seeded in (False, True)
            }
            results.write_text(json.dumps(found))
    loaded = json.loads(results.read_text())
    return {
        (launcher, seeded): {
            (restart, rank): loaded[f"{launcher} {seeded}"][f"{restart} {rank}"]
            for restart in (0, 1)
            for rank in (0, 1)
        }
        for launcher in LAUNCHERS
        for seeded in (False, True)
    }


@pytest.mark.parametrize("source", SOURCES)
def test_each_worker_draws_its_own_and_a_seed_gives_the_same_everywhere(
    source: str, draws: dict[tuple[str, bool], Draws]
) -> None:
    if source == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: the GPU check (shared/device) runs this one")
    for launcher in LAUNCHERS:
        drawn = {key: value[source] for key, value in draws[launcher, False].items()}
        for restart in (0, 1):
            assert drawn[restart, 0] != drawn[restart, 1], f"{launcher}: ranks, restart {restart}"
        for rank in (0, 1):
            assert drawn[0, rank] != drawn[1, rank], f"{launcher}: restarts, rank {rank}"
    seeded = {
        launcher: {key: value[source] for key, value in draws[launcher, True].items()}
        for launcher in LAUNCHERS
    }
    assert seeded["warm"] == seeded["cold"] == seeded["torchrun"]

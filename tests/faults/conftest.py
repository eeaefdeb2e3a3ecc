"""The fault-injection suite's fixtures: one store per backend, and the record each test
leaves for docs/reliability.md (``docs/gen_reliability.py`` runs this folder and renders
the records as the table)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_setups import BACKENDS, Backend, Recovery, c10d_backend, etcd_backend, redis_backend

#: Where the records go, one JSON line each; unset in a plain test run (nothing written).
RECORDS = "RALLYPOINT_RELIABILITY_RECORDS"


@pytest.fixture(autouse=True)
def _agent_runs_in_tmp(agent_tmpdir: Path) -> None:
    """Run directories of the agents each fault leaves behind land in the test's tmp_path."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    if report.when == "call":
        item.stash[_OUTCOME] = report.outcome
    return report


_OUTCOME = pytest.StashKey[str]()


@pytest.fixture
def recovery(request: pytest.FixtureRequest) -> Iterator[Recovery]:
    """The test's measurement; written, with its ``fault`` marker and outcome, to the
    records file when ``RALLYPOINT_RELIABILITY_RECORDS`` names one."""
    measured = Recovery()
    yield measured
    path = os.environ.get(RECORDS)
    marker = request.node.get_closest_marker("fault")
    if not path or marker is None:
        return
    params = getattr(request.node, "callspec", None)
    backend = params.params.get("backend") if params is not None else None
    record = {
        "fault": marker.args[0],
        "expected": marker.kwargs["expected"],
        "backend": getattr(backend, "name", backend) or "any",
        "outcome": request.node.stash.get(_OUTCOME, "error"),
        "seconds": measured.seconds,
        "notes": measured.notes,
        "test": request.node.nodeid,
        "line": request.node.location[1],
    }
    with Path(path).open("a") as handle:  # one short append per test: atomic across workers
        handle.write(json.dumps(record) + "\n")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """A rendezvous backend with its own store: a fresh etcd or redis-server for the test,
    or (c10d) a free port on which the first agent hosts the store."""
    make = {"c10d": c10d_backend, "etcd": etcd_backend, "redis": redis_backend}[request.param]
    with make(tmp_path) as made:
        yield made

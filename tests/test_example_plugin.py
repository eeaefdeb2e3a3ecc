"""The worked third-party plugin, docs/plugins/example-plugin, installed as a user would:
listed by `rallypoint plugins`, offered by `rallypoint run --help`, passing its own tests
(rallypoint's conformance suites) and used by a real job.

It is installed with pip, without build isolation, from a copy (the build leaves files in
its source folder), into a folder of this test's own that goes on ``PYTHONPATH``
(``pip install --target``) rather than into the virtual environment: a plugin installed in
the environment would change the names every other test sees (several check the exact
list of restart policies) for as long as it stays there, including in a test run beside
this one. Removing the folder uninstalls it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch import pip_install_target
from rallypoint.testing.helpers import CliRunner, clean_environment

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "plugins" / "example-plugin"
TIMEOUT = 120


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("example-plugin")
    source = root / "rallypoint-example"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    pip_install_target([source], root / "site")
    yield root / "site"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def runner(tmp_path: Path) -> CliRunner:
    return CliRunner(cwd=tmp_path, timeout=TIMEOUT)


def test_listed_by_rallypoint_plugins(site: Path, runner: CliRunner) -> None:
    result = runner.run("plugins", pythonpath=[site])
    assert result.exit_code == 0, result.output
    assert "example  [active]  rallypoint-example 0.1.0\n" in result.stdout
    assert "    restart policy: failure-window\n" in result.stdout
    assert "    rank assigner: topology-file\n" in result.stdout
    listing = json.loads(runner.run("plugins", "--json", pythonpath=[site]).stdout)
    assert "failure-window" in listing["available"]["restart policy"]
    assert "topology-file" in listing["available"]["rank assigner"]
    keys = [option["name"] for option in listing["options"]["restart policy"]["failure-window"]]
    assert keys == ["max_failures", "window", "delay"]


def test_offered_by_run_help(site: Path, runner: CliRunner) -> None:
    result = runner.run("run", "--help", pythonpath=[site], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "Restart policy: backoff, failure-window, max-restarts, never." in result.stdout
    assert "Rank assignment: ordered, sticky, topology, topology-file." in result.stdout


def test_its_own_tests_pass(site: Path) -> None:
    """Its tests subclass the restart policy and rank assigner conformance suites and use
    the `rallypoint_pm` fixture of rallypoint's pytest plugin, loaded by its entry point."""
    tests = site.parent / "rallypoint-example"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=tests,
        env=clean_environment({"PYTHONPATH": str(site)}),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_a_job_uses_both(site: Path, runner: CliRunner, tmp_path: Path) -> None:
    """Workers that always fail: `failure-window` stops the job at the second failure
    although --max-restarts allows five; `topology-file` placed the node by the file."""
    topology = tmp_path / "topology"
    topology.write_text(f"{socket.gethostname()}  rack-1\n")
    log = tmp_path / "attempts.log"
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] != '0':\n"
        "    time.sleep(60)  # stopped by the agent when rank 0 fails\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(os.environ['TORCHELASTIC_RESTART_COUNT'] + '\\n')\n"
        "sys.exit(3)\n"
    )
    result = runner.run(
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "5",
        "--restart-policy",
        "failure-window",
        "--restart-conf",
        "max_failures=2,window=60",
        "--rank-assigner",
        "topology-file",
        str(script),
        pythonpath=[site],
        env={"RALLYPOINT_EXAMPLE_TOPOLOGY": str(topology)},
    )
    assert result.exit_code == 1, result.output
    assert log.read_text().split() == ["0", "1"], result.output  # two attempts, then no more
    assert "2 failures within 60 s on this node" in result.stderr
    assert f"topology-file: 1 of 1 nodes placed by {topology}" in result.stderr

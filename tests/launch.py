"""Run ``rallypoint`` and ``torchrun`` as a user would: as subprocesses, bounded in time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The `install_plugin` fixture (tests/conftest.py): install a plugin for one test.
InstallPlugin = Callable[..., Path]

BIN = Path(sys.executable).parent
RALLYPOINT = str(BIN / "rallypoint")
TORCHRUN = str(BIN / "torchrun")
WORKERS = Path(__file__).parent / "workers"


def clean_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher settings, plus ``extra``."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RALLYPOINT_", "PET_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return {**base, **(extra or {})}


def _run(
    command: str,
    args: tuple[str, ...],
    env: dict[str, str] | None,
    cwd: Path | None,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [command, *args],
        env=clean_environment(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rallypoint(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return _run(RALLYPOINT, args, env, cwd, timeout)


def torchrun(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return _run(TORCHRUN, args, env, cwd, timeout)


def worker(name: str) -> str:
    """Path of a worker script in tests/workers/."""
    return str(WORKERS / name)


# --- real agents, as separate processes --------------------------------------------------


def start_rallypoint(*args: str, log: Path) -> subprocess.Popen[str]:
    """``rallypoint ARGS`` in the background, its stdout and stderr going to ``log``."""
    with log.open("w") as handle:
        return subprocess.Popen(
            [RALLYPOINT, *args],
            env=clean_environment(),
            stdout=handle,
            stderr=subprocess.STDOUT,
            text=True,
        )


def start_agent(
    backend: str,
    endpoint: str,
    run_id: str,
    nnodes: str,
    *args: str,
    conf: str,
    log: Path,
    nproc: int = 2,
) -> subprocess.Popen[str]:
    """One node of an elastic job: ``rallypoint run`` on ``--rdzv-backend backend`` (at most
    3 restarts), ``args`` after the rendezvous options (more options, then the script)."""
    return start_rallypoint(
        "run", "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--max-restarts", "3",
        "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", conf, *args, log=log,
    )  # fmt: skip


def events(log: Path, name: str) -> list[dict[str, Any]]:
    """The events called ``name`` in the event log next to ``log`` (its ``.jsonl``), every
    record of it first checked against the events' declarations (``declared``)."""
    path = log.with_suffix(".jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    for record in records:
        declared(record)
    return [record for record in records if record["event"] == name]


def declared(record: dict[str, Any]) -> None:
    """A record of an event log holds only fields its event declares
    (``rallypoint.events.EVENTS``, from which the docs' tables are written)."""
    from rallypoint.events import COMMON_FIELDS, EVENTS

    specs = {spec.name: spec for spec in EVENTS}
    assert record["event"] in specs, f"an event no declaration names: {record}"
    extra = set(record) - set(COMMON_FIELDS) - set(specs[record["event"]].fields)
    assert not extra, f"{record['event']} has fields it does not declare: {sorted(extra)}"


def wait_for_text(log: Path, text: str, timeout: float = 120) -> None:
    """Until ``text`` is in ``log``: agents print as they go, there is no event to await."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"{text!r} never appeared:\n{log.read_text()}"
        time.sleep(0.1)


def wait_for_port(port: int, timeout: float = 60) -> None:
    """Until something listens on ``port`` of 127.0.0.1 (the first c10d agent's store, so
    that the next agent does not host one too)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"no store on port {port}")


def kill(*agents: subprocess.Popen[str] | None) -> None:
    """SIGKILL the agents that still run, and reap them: a node lost, or a test's ``finally``."""
    for agent in agents:
        if agent is not None:
            agent.kill()
            agent.wait(timeout=30)


def exit_codes(agents: list[subprocess.Popen[str]], timeout: float) -> list[int]:
    """The agents' exit codes, waiting at most ``timeout`` s for each; all killed after."""
    try:
        return [agent.wait(timeout=timeout) for agent in agents]
    finally:
        kill(*agents)


def assert_no_worker_left(tag: str, within: float = 0.0) -> None:
    """No process runs whose command line contains ``tag`` (unique to the test's workers),
    or none after ``within`` seconds: workers of an agent just SIGKILLed get their parent's
    death signal and end some milliseconds later."""
    deadline = time.monotonic() + within
    while True:
        found = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True, timeout=10)
        if not found.stdout.strip() or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    assert found.stdout.strip() == "", f"orphan workers: {found.stdout.split()}"


def wait_gone(pids: list[int], timeout: float = 30) -> None:
    """Until none of ``pids`` runs (a zombie left for init to reap has ended)."""
    deadline = time.monotonic() + timeout
    while running := [pid for pid in pids if _running(pid)]:
        assert time.monotonic() < deadline, f"processes {running} outlived their agent"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def pip_install_target(sources: list[Path], site: Path) -> None:
    """``pip install`` the distributions at ``sources`` into ``site``, offline."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--disable-pip-version-check",
            "-q",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            *map(str, sources),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )

"""A job run again under the same ``--rdzv-id``, as a scheduler restarts it (a Kubernetes
Job, a Slurm requeue, a user running the command again): after a run that failed, one
whose agents were all SIGKILLed, and one that finished cleanly, two new agents form their
round within last_call_timeout + 2 s and train, never counting the dead run's nodes."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from elastic_job import ElasticJob
from fault_setups import BACKENDS, Backend, Recovery, on_backends

from launch import events, exit_codes, kill, rallypoint, wait_for_text, worker

#: The fault suite's --rdzv-conf last_call_timeout (fault_setups.COMMON_CONF).
LAST_CALL = 1.0
SIZE, BATCH = 32, 2


class LightJob:
    """Two agents of run id ``job`` with one torch-free worker each (tests/workers/light.py),
    which hold until ``release()``: the rendezvous is what these tests are about."""

    def __init__(self, backend: Backend, directory: Path, nnodes: str = "1:2") -> None:
        directory.mkdir()
        self.backend, self.directory, self.nnodes = backend, directory, nnodes
        (directory / "hold").touch()
        self.agents: list[tuple[subprocess.Popen[str], Path]] = []

    def start(self, name: str, *args: str) -> tuple[subprocess.Popen[str], Path]:
        log = self.directory / f"{name}.log"
        agent = self.backend.start_agent(
            "job", self.nnodes, worker("light.py"), str(self.directory), *args,
            log=log, nproc=1, max_restarts=None,
        )  # fmt: skip
        self.agents.append((agent, log))
        return agent, log

    def start_together(self, *args: str) -> None:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda name: self.start(name, *args), ("a", "b")))

    def wait_training(self, world: int) -> None:
        for _, log in self.agents:
            wait_for_text(log, f"world={world} at=", timeout=60)

    def release(self) -> None:
        (self.directory / "hold").unlink(missing_ok=True)

    def codes(self) -> list[int]:
        return exit_codes([agent for agent, _ in self.agents], timeout=60)

    def text(self) -> str:
        return "\n".join(log.read_text() for _, log in self.agents)

    def close(self) -> None:
        kill(*(agent for agent, _ in self.agents))


def failed_run(backend: Backend, tmp_path: Path) -> None:
    """Both agents exit 1: the last rank's worker exits 1, no restart allowed (the default);
    --nnodes 2, so that both are in the round that fails however slowly one starts."""
    job = LightJob(backend, tmp_path / "failed", nnodes="2")
    try:
        job.start_together("--fail")
        assert job.codes() == [1, 1], job.text()
    finally:
        job.close()


def killed_run(backend: Backend, tmp_path: Path) -> None:
    """Both agents SIGKILLed while they train; back once their liveness lapsed (lease_ttl,
    key_ttl: 3 s), as when a scheduler starts the job again."""
    job = LightJob(backend, tmp_path / "killed")
    try:
        job.start_together()
        job.wait_training(world=2)
    finally:
        job.close()
    if backend.name == "c10d":
        return  # the store went with its agent
    deadline = time.monotonic() + 30
    while condition(backend) == "running":
        assert time.monotonic() < deadline, "the killed agents stayed alive"
        time.sleep(0.2)


def finished_run(backend: Backend, tmp_path: Path) -> None:
    job = LightJob(backend, tmp_path / "finished")
    try:
        job.start_together()
        job.wait_training(world=2)
        job.release()
        assert job.codes() == [0, 0], job.text()
    finally:
        job.close()


def condition(backend: Backend) -> str:
    """The run's condition, as `rallypoint rendezvous status` reads it."""
    status = rallypoint(
        "rendezvous", "status", "--rdzv-backend", backend.name, "--rdzv-endpoint",
        backend.endpoint, "--rdzv-id", "job", "--rdzv-conf", backend.conf, "--json",
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    return str(json.loads(status.stdout)["condition"])


BEFORE = {"failed": failed_run, "killed": killed_run, "finished": finished_run}


def _rerun_case(backend: str, before: str) -> Any:
    name = (
        "The job run again under its --rdzv-id after every agent was SIGKILLed"
        if before == "killed"
        else f"The job run again under its --rdzv-id after a run that {before}"
    )
    expected = (
        "both new agents form their round within last_call_timeout + 2 s "
        "(the dead run's nodes are never counted) and train"
    )
    marks = [pytest.mark.fault(name, expected=expected)]
    if before == "finished" and backend != "redis":  # nothing of it is left: one backend
        marks.append(pytest.mark.soak)
    return pytest.param(backend, before, marks=marks, id=f"{backend}-{before}")


@pytest.mark.parametrize(
    ("backend", "before"),
    [_rerun_case(backend, before) for before in BEFORE for backend in BACKENDS],
    indirect=["backend"],
)
def test_a_rerun_starts_at_once(
    backend: Backend, tmp_path: Path, recovery: Recovery, before: str
) -> None:
    BEFORE[before](backend, tmp_path)
    job = LightJob(backend, tmp_path / "again")
    try:
        job.start_together()
        job.wait_training(world=2)
        job.release()
        codes = job.codes()
    finally:
        job.close()
    assert codes == [0, 0], job.text()
    # The first round formed at once once both agents were up (their imports done):
    # nobody waited for the dead run's nodes. (Under load one agent may reach the store
    # after the last call, and join in the next round.)
    started = [events(log, "agent_started")[0]["wall_time"] for _, log in job.agents]
    formed = [events(log, "rendezvous_completed")[0]["wall_time"] for _, log in job.agents]
    took = max(formed) - max(started)
    recovery.seconds = round(took, 2)
    recovery.notes.append(f"{max(formed) - min(started):.1f} s from the first agent's start")
    assert took < LAST_CALL + 2, f"the first round formed {took:.1f} s after both agents started"
    if backend.name != "c10d" and before != "finished":
        assert "starting it afresh" in job.text(), job.text()
    assert backend.keys("job") == []  # the re-run finished cleanly: nothing left


@pytest.mark.parametrize("backend", ["etcd", "redis"], indirect=True)  # c10d's store ends
def test_status_says_a_run_is_abandoned(backend: Backend, tmp_path: Path) -> None:
    killed_run(backend, tmp_path)  # returns once the killed agents' liveness lapsed
    status = rallypoint(
        "rendezvous", "status", "--rdzv-backend", backend.name, "--rdzv-endpoint",
        backend.endpoint, "--rdzv-id", "job", "--rdzv-conf", backend.conf, "--json",
    )  # fmt: skip
    report = json.loads(status.stdout)
    assert report["condition"] == "abandoned", report
    assert all(not member["alive"] for member in report["members"])
    text = rallypoint(
        "rendezvous", "status", "--rdzv-backend", backend.name, "--rdzv-endpoint",
        backend.endpoint, "--rdzv-id", "job", "--rdzv-conf", backend.conf,
    ).stdout  # fmt: skip
    assert "(abandoned: no agent of it is alive" in text, text


def test_clear_refuses_a_live_run_and_clears_a_dead_one(backend: Backend, tmp_path: Path) -> None:
    if backend.name == "c10d":
        result = rallypoint(
            "rendezvous", "clear", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            backend.endpoint, "--rdzv-id", "job",
        )  # fmt: skip
        assert result.returncode == 2 and "nothing to clear" in result.stderr, result.stderr
        return
    clear = ("rendezvous", "clear", "--rdzv-backend", backend.name, "--rdzv-endpoint",
             backend.endpoint, "--rdzv-id", "job", "--rdzv-conf", backend.conf)  # fmt: skip
    job = LightJob(backend, tmp_path / "live")
    try:
        _, log = job.start("a")
        wait_for_text(log, "world=1 at=", timeout=60)
        refused = rallypoint(*clear)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "agents of it are alive; stop them first, or give --force" in refused.stderr
    finally:
        job.close()
    # SIGKILLed: its lease (key) lapses lease_ttl (key_ttl) = 3 s later; until then it is alive.
    deadline = time.monotonic() + 30
    while (cleared := rallypoint(*clear)).returncode != 0 and time.monotonic() < deadline:
        assert "agents of it are alive" in cleared.stderr, cleared.stderr
        time.sleep(0.5)
    assert cleared.returncode == 0, cleared.stderr
    assert cleared.stdout.startswith("run job: cleared (")
    assert backend.keys("job") == []


@pytest.mark.parametrize("backend", ["redis"], indirect=True)  # the check is the protocol's
def test_another_shape_under_a_live_id_is_one_sentence(backend: Backend, tmp_path: Path) -> None:
    job = LightJob(backend, tmp_path / "live")
    try:
        _, live = job.start("a")
        wait_for_text(live, "world=1 at=", timeout=60)
        log = tmp_path / "mistake.log"
        mistake = backend.start_agent("job", "3", worker("light.py"), str(tmp_path), log=log)
        assert mistake.wait(timeout=60) == 2, log.read_text()
    finally:
        job.close()
    (line,) = log.read_text().strip().splitlines()
    assert line == (
        "rallypoint: error: --rdzv-id 'job' is the id of a running job of --nnodes 1:2, and "
        "this agent has --nnodes 3: give this job its own --rdzv-id, or stop that one first."
    )
    assert not events(log, "workers_started")


@on_backends("redis")
def test_a_failure_after_too_many_nodes_were_lost_names_them(
    backend: Backend, tmp_path: Path
) -> None:
    """--nnodes 2: node b is SIGKILLed; node a's worker fails (its peer is gone) and the
    next round cannot form: the report names the lost node before the gloo error. (On
    c10d the first agent hosts the store: the victim, started second, does not.)"""
    # join_timeout: long enough for the second agent to start on a loaded 2-core machine
    # (it imports torch), short enough for the failing round to end the test soon.
    job = ElasticJob(backend, tmp_path, nnodes="2", size=SIZE, batch=BATCH, step_seconds=0.2,
                     options=("--rdzv-conf", backend.conf + ",join_timeout=15"))  # fmt: skip
    try:
        a = job.start("a")
        b = job.start("b")
        a.wait_for_step(world=4)
        victim = b.events("rendezvous_completed")[-1]
        b.process.kill()
        assert a.process.wait(timeout=60) == 1, a.text()
    finally:
        job.close()
    text = a.text()
    lost = victim["members"][victim["group_rank"]]
    assert f"root cause: node {lost} of the round was lost (no heartbeat)" in text, text
    assert "fewer than 2 nodes joined within join_timeout=15 s" in text

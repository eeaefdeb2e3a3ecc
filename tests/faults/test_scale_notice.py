"""Joins and departures that cost the running job next to nothing, on every backend, with
real agents (tests/workers/notice_steps.py: a gloo all-reduce every 0.1 s, a save through
``rallypoint.checkpoint`` when ``should_save(step, every=10)`` says so).

- A node that comes to a running job gets ready beside it (here: a preloaded module that
  takes seconds to import) while the job trains on, and joins only then; the running
  workers save at one step before they stop, and the new round resumes from it.
- A node told to stop (SIGTERM) has every worker of the job save at one step first: the
  survivor resumes from the step it reached, although saves are every 10 steps.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

from fault_setups import Backend, on_backends

from launch import assert_no_worker_left, kill, wait_for_text, worker

NNODES = "1:2"
STEP_SECONDS, EVERY = "0.1", "10"
STEP = re.compile(r"step=(\d+) rank=0 world=(\d+) at=")
RESUMED = re.compile(r"resumed step=(\d+) rank=0 world=(\d+) from=(\w+)")


class Job:
    """Agents of one run on ``backend``, one worker each, sharing a checkpoint directory."""

    def __init__(self, backend: Backend, tmp_path: Path) -> None:
        self.backend, self.tmp_path = backend, tmp_path
        self.run_id = f"notice-{uuid.uuid4().hex[:8]}"
        self.tag = f"notice-{uuid.uuid4().hex}"
        self.agents: list[subprocess.Popen[str]] = []

    def start(self, name: str, *options: str, conf: str = "") -> Path:
        log = self.tmp_path / f"{name}.log"
        script = (worker("notice_steps.py"), STEP_SECONDS, EVERY, self.tag)
        checkpoints = (
            "--checkpoint-dir",
            str(self.tmp_path / "ckpt"),
            "--checkpoint-memory",
            "16MB",
        )
        self.agents.append(
            self.backend.start_agent(
                self.run_id, NNODES, *checkpoints, *options, *script, log=log, nproc=1, conf=conf
            )
        )
        return log

    def close(self) -> None:
        kill(*self.agents)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert_no_worker_left(self.tag)
                return
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def steps(text: str, world: int) -> list[int]:
    return [int(s) for s, w in STEP.findall(text) if int(w) == world]


def wait_for_steps(log: Path, world: int, count: int, since: int = 0, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while len(steps(log.read_text()[since:], world)) < count:
        if time.monotonic() >= deadline:
            # Every agent's log of the job, not only the one waited on: what the others
            # did is what kept this one from its steps.
            others = "".join(
                f"\n--- {other.name}:\n{other.read_text()}"
                for other in sorted(log.parent.glob("*.log"))
                if other != log
            )
            raise AssertionError(f"no {count} steps at world {world}:\n{log.read_text()}{others}")
        time.sleep(0.05)


@on_backends("c10d", "etcd", "redis")
def test_a_node_told_to_stop_has_the_job_save_first(backend: Backend, tmp_path: Path) -> None:
    job = Job(backend, tmp_path)
    try:
        a = job.start("a")
        wait_for_steps(a, world=1, count=1)
        b = job.start("b")
        wait_for_steps(a, world=2, count=5)
        job.agents[1].send_signal(signal.SIGTERM)
        assert job.agents[1].wait(timeout=60) == 128 + signal.SIGTERM, b.read_text()
        mark = a.read_text().rindex("world=2 at=")
        wait_for_steps(a, world=1, count=1, since=mark)
        text = a.read_text()
    finally:
        job.close()
    reached = max(steps(text, world=2))
    resumed = [(int(s), src) for s, w, src in RESUMED.findall(text) if int(w) == 1]
    assert resumed, text
    step, source = resumed[-1]
    assert step == reached, f"resumed from {step}, the job had reached {reached}:\n{text}"
    assert source in ("memory", "peer"), text
    said = re.search(r"saving at step (\d+) before this node stops", b.read_text())
    assert said, b.read_text()
    assert f"the round ends: saving at step {said.group(1)}" in text, text


@on_backends("c10d", "etcd", "redis")
def test_a_joining_node_gets_ready_beside_the_running_job(backend: Backend, tmp_path: Path) -> None:
    job = Job(backend, tmp_path)
    try:
        a = job.start("a")
        wait_for_steps(a, world=1, count=1)
        b = job.start("b", "--preload", "slow_import")
        wait_for_text(b, "getting ready beside round")
        # The job trains on, at its size, while the newcomer imports.
        wait_for_steps(a, world=1, count=5, since=len(a.read_text()))
        wait_for_text(b, "ready after")
        wait_for_steps(a, world=2, count=1)
        text, joined = a.read_text(), b.read_text()
    finally:
        job.close()
    assert re.search(r"getting ready beside round \d+: importing torch.*slow_import", joined), (
        joined
    )
    assert joined.index("ready after") < joined.index("this node is group rank"), joined
    assert text.index("world=2 at=") > text.rindex("world=1 at="), text
    # The round the newcomer ended was saved on notice: the job redid no step.
    resumed = [int(s) for s, w, _ in RESUMED.findall(text) if int(w) == 2]
    assert resumed == [max(steps(text, world=1))], text


@on_backends("c10d")
def test_a_node_never_ready_gives_up(backend: Backend, tmp_path: Path) -> None:
    job = Job(backend, tmp_path)
    try:
        a = job.start("a")
        wait_for_steps(a, world=1, count=1)
        b = job.start("b", "--preload", "slow_import", conf="ready_timeout=1")
        assert job.agents[1].wait(timeout=60) == 1, b.read_text()
        mark = len(a.read_text())
        wait_for_steps(a, world=1, count=3, since=mark)  # the job never noticed
        text, joined = a.read_text(), b.read_text()
    finally:
        job.close()
    assert "was not ready to start workers within ready_timeout=1 s" in joined, joined
    assert "Traceback" not in joined, joined
    assert "world=2" not in text, text


@on_backends("c10d")
def test_with_warm_start_off_a_node_is_ready_once_its_agent_is_up(
    backend: Backend, tmp_path: Path
) -> None:
    job = Job(backend, tmp_path)
    try:
        a = job.start("a")
        wait_for_steps(a, world=1, count=1)
        b = job.start("b", "--warm-start", "off", "--preload", "slow_import")
        wait_for_steps(a, world=2, count=1)
        joined = b.read_text()
    finally:
        job.close()
    assert "importing" not in joined, joined  # nothing to preload: no wait for it
    assert "warm start is off" in joined, joined


@on_backends("c10d")
def test_agents_with_the_job_token_share_checkpoints_and_refuse_another(
    backend: Backend, tmp_path: Path
) -> None:
    """The peer transfers of a job with a token: its nodes fetch from each other; a node
    with another token is kept out at the rendezvous, before it asks anyone for anything
    (a stray client of the peer port: tests/test_job_token.py)."""
    mine, other = tmp_path / "token", tmp_path / "other-token"
    mine.write_text("the job's secret\n")
    other.write_text("another job's secret\n")
    job = Job(backend, tmp_path)
    try:
        a = job.start("a", conf=f"token_file={mine}")
        wait_for_steps(a, world=1, count=11)  # a save (every 10 steps) to fetch
        b = job.start("b", conf=f"token_file={mine}")
        wait_for_steps(a, world=2, count=1)
        wait_for_steps(a, world=2, count=11)
        stray = job.start("stray", conf=f"token_file={other}")
        code = job.agents[-1].wait(timeout=60)
        text, joined, refused = a.read_text(), b.read_text(), stray.read_text()
    finally:
        job.close()
    assert "fetched the job's newest checkpoint" in joined, joined
    assert code == 1, refused
    assert "this node's job token is not the one the job's nodes use" in refused, refused
    assert "fetched" not in refused and "Traceback" not in refused, refused
    assert "refused a checkpoint transfer" not in text, text

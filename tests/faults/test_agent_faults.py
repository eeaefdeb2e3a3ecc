"""Agent faults on every backend: one node's agent is SIGKILLed, SIGTERMed, or SIGKILLed and
started again by its scheduler, in a ``--nnodes 1:2`` job of two agents with one gloo
worker each (tests/workers/elastic_train.py: an epoch through ElasticSampler, a checkpoint
every step). One worker per node: what is tested is the nodes, and each worker started costs
a torch import of CPU time the suite is short of.

On c10d one agent hosts the store and losing it ends the job (a documented limit, tested in
tests/test_rendezvous.py): there the fault hits the other agent. On etcd and Redis, whose
store is a server of its own, it hits the node of group rank 0, whose host was the master.

The agents run with the default ``--max-restarts`` (0): losing a node while MIN remain uses
up no restart, so a job a user starts with the defaults survives it.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from elastic_job import ElasticJob, Node, assert_no_restart_used
from fault_setups import BACKENDS, Backend, Recovery, on_backends

from launch import exit_codes, wait_for_text, wait_gone

#: One epoch of 32 samples in batches of 2: 16 steps of 0.1 s on one node (world size 1), 8
#: on two; the last waits for the test's ``release()``.
SIZE, BATCH, STEP_SECONDS = 32, 2, 0.1
SHUTDOWN_TIMEOUT = 10


def start_job(
    backend: Backend, tmp_path: Path, options: tuple[str, ...] = ()
) -> tuple[ElasticJob, Node, Node]:
    """Two agents training together at world size 2, with the default --max-restarts and
    ``options``: the job, the survivor, the victim."""
    job = ElasticJob(
        backend, tmp_path, nnodes="1:2", nproc=1, size=SIZE, batch=BATCH,
        step_seconds=STEP_SECONDS, shutdown_timeout=SHUTDOWN_TIMEOUT, max_restarts=None,
        options=options,
    )  # fmt: skip
    try:
        nodes = job.start_together("a", "b")
        for node in nodes:
            node.wait_for_step(world=2)
        host = job.hosting()
    except BaseException:
        job.close()
        raise
    if host is not None:
        victim = next(node for node in nodes if node is not host)
    else:
        victim = next(n for n in nodes if n.events("rendezvous_completed")[-1]["group_rank"] == 0)
    survivor = next(node for node in nodes if node is not victim)
    return job, survivor, victim


SURVIVED = (
    "its workers die with it; the other node re-forms a round without it (no restart used) "
    "and the job finishes, every sample seen once"
)


#: Losing a node on each backend with the defaults; under ``never`` on Redis by default
#: (the same code path on every backend), and on c10d and etcd in ``make soak``.
SIGKILL_CASES = [
    pytest.param(
        backend,
        options,
        marks=[
            pytest.mark.fault(name, expected=expected),
            *([pytest.mark.soak] if options and backend != "redis" else []),
        ],
        id=f"{backend}-{'never' if options else 'defaults'}",
    )
    for options, name, expected in (
        ((), "Agent SIGKILL", SURVIVED),
        (
            ("--restart-policy", "never"),
            "Agent SIGKILL, `--restart-policy never`",
            f"a node lost is not a failure the policy can refuse: {SURVIVED}",
        ),
    )
    for backend in BACKENDS
]


@pytest.mark.parametrize(("backend", "options"), SIGKILL_CASES, indirect=["backend"])
def test_agent_sigkill(
    backend: Backend, tmp_path: Path, recovery: Recovery, options: tuple[str, ...]
) -> None:
    job, survivor, victim = start_job(backend, tmp_path, options)
    try:
        orphans = victim.worker_pids()
        killed_at = time.time()
        victim.process.kill()
        job.release()
        wait_gone(orphans)
        assert survivor.process.wait(timeout=90) == 0, survivor.text()
    finally:
        job.close()
    reformed = survivor.rounds_after(killed_at)[0]
    recovery.seconds = reformed["wall_time"] - killed_at
    assert reformed["group_world_size"] == 1, survivor.text()
    assert_no_restart_used(survivor)
    job.assert_every_sample_once()
    job.assert_no_worker_left()


@pytest.mark.fault(
    "Agent SIGTERM",
    expected="its workers get SIGTERM and exit, it exits 143 (stopped by SIGTERM); the other "
    "node re-forms a round without it (no restart used) and the job finishes",
)
@on_backends("c10d")
def test_agent_sigterm(backend: Backend, tmp_path: Path, recovery: Recovery) -> None:
    job, survivor, victim = start_job(backend, tmp_path)
    try:
        since = victim.mark()  # its workers of earlier rounds were stopped with SIGTERM too
        stopped_at = time.time()
        victim.process.send_signal(signal.SIGTERM)
        job.release()
        code = victim.process.wait(timeout=SHUTDOWN_TIMEOUT + 30)
        stopped_in = time.time() - stopped_at
        assert code == 128 + signal.SIGTERM, victim.text()
        assert survivor.process.wait(timeout=90) == 0, survivor.text()
    finally:
        job.close()
    text = victim.text()[since:]
    assert "received SIGTERM: stopping workers" in text, text
    assert text.count("sigterm rank=") == 1, f"its worker handles the SIGTERM:\n{text}"
    assert "with SIGKILL" not in text, f"a worker had to be killed:\n{text}"
    assert stopped_in < SHUTDOWN_TIMEOUT, f"the agent took {stopped_in:.1f} s to stop"
    (stopping,) = victim.events("agent_stopping")
    assert (stopping["exit_code"], stopping["reason"]) == (143, "stopped by SIGTERM")
    reformed = survivor.rounds_after(stopped_at)[0]
    recovery.seconds = reformed["wall_time"] - stopped_at
    recovery.notes.append(f"the stopped agent exited {stopped_in:.1f} s after SIGTERM")
    assert reformed["group_world_size"] == 1, survivor.text()
    assert_no_restart_used(survivor)
    job.assert_every_sample_once()
    job.assert_no_worker_left()


@pytest.mark.fault(
    "Agent SIGKILLed and restarted by its scheduler",
    expected="the new agent, with the same command line, joins the running job in a "
    "scale-up round and both nodes finish",
)
@on_backends("redis")
def test_agent_restarted_by_its_scheduler(
    backend: Backend, tmp_path: Path, recovery: Recovery
) -> None:
    job, survivor, victim = start_job(backend, tmp_path)
    try:
        killed_at = time.time()
        victim.process.kill()
        survivor.wait_for_step(world=1)  # training alone
        restarted_at = time.time()
        restarted = job.start(victim.name + "-restarted")  # the same command line
        restarted.wait_for_event("workers_started")
        job.release()
        codes = exit_codes([survivor.process, restarted.process], timeout=90)
        assert codes == [0, 0], survivor.text() + restarted.text()
    finally:
        job.close()
    joined = restarted.events("rendezvous_completed")[0]
    assert joined["group_world_size"] == 2, restarted.text()
    recovery.seconds = joined["wall_time"] - restarted_at
    alone = survivor.rounds_after(killed_at)[0]
    recovery.notes.append(
        "from the new agent's start to its first round; the survivor had re-formed alone "
        f"{alone['wall_time'] - killed_at:.1f} s after the kill"
    )
    scaled = [(e["old_nodes"], e["new_nodes"]) for e in survivor.events("scale_changed")]
    assert scaled[-2:] == [(2, 1), (1, 2)], scaled
    assert_no_restart_used(survivor)
    assert job.assert_every_sample_once()["worlds"][-1] == 2
    job.assert_no_worker_left()


@pytest.mark.fault(
    "Agent SIGTERM while it waits in the rendezvous",
    expected="it leaves the rendezvous at once and exits 143 (stopped by SIGTERM), without "
    "waiting for join_timeout",
)
def test_agent_sigterm_in_the_rendezvous(
    backend: Backend, tmp_path: Path, recovery: Recovery
) -> None:
    job = ElasticJob(backend, tmp_path, nnodes="2", size=SIZE, batch=BATCH, step_seconds=0)
    try:
        waiting = job.start("waiting")  # --nnodes 2 and no other node: it waits (60 s)
        wait_for_text(waiting.log, "1 of 2:2 nodes joined", timeout=60)  # the progress line
        stopped_at = time.time()
        waiting.process.send_signal(signal.SIGTERM)
        code = waiting.process.wait(timeout=30)
        recovery.seconds = time.time() - stopped_at
    finally:
        job.close()
    assert code == 128 + signal.SIGTERM, waiting.text()
    assert "received SIGTERM while in the rendezvous: leaving" in waiting.text()
    (stopping,) = waiting.events("agent_stopping")
    assert stopping["reason"] == "stopped by SIGTERM"
    assert recovery.seconds < 10, "it waited for the rendezvous (join_timeout=60)"
    assert not waiting.events("workers_started")

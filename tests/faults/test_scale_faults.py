"""Membership churn: nodes join and leave a running job again and again, ten changes in one
run, and the job still finishes with every epoch's samples seen once.

Node ``a`` stays (on c10d it hosts the store, which must not go); ``b`` and ``c`` come and
go: started, stopped with SIGTERM or killed with SIGKILL, started again under new names, in
a ``--nnodes 1:3`` job with one gloo worker per node (tests/workers/elastic_train.py: three
epochs through ElasticSampler, a checkpoint through rallypoint.checkpoint every step). Each
change waits until the job trains at the new size, then the next one comes, mid-epoch.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from elastic_job import ElasticJob, Node, assert_no_restart_used
from fault_setups import Backend, Recovery

from launch import exit_codes, wait_gone

#: The changes, in order: (what, which node).
PLAN = [
    ("join", "b1"),
    ("join", "c1"),
    ("sigterm", "b1"),
    ("sigkill", "c1"),
    ("join", "b2"),
    ("join", "c2"),
    ("sigkill", "b2"),
    ("sigterm", "c2"),
    ("join", "b3"),
    ("join", "c3"),
]
#: Three epochs of 160 samples, batches of 2 per worker, a step every 0.1 s: 1 to 3 workers
#: take 2 to 6 samples a step, so the epochs outlast most of the changes.
SIZE, EPOCHS, BATCH, STEP_SECONDS = 160, 3, 2, 0.1


@pytest.mark.fault(
    "Membership churn: 10 joins and leaves (SIGTERM, SIGKILL) in one run",
    expected="every change re-forms the job at its new size without using a restart; the "
    "job finishes with every sample of every epoch seen once",
)
@pytest.mark.parametrize(
    "backend",
    # The longest fault test (two minutes of a 2-core CI machine): ``make soak`` only.
    # ``make test`` changes membership in tests/test_data.py, the demo's test and the
    # agent faults.
    [pytest.param(name, marks=pytest.mark.soak) for name in ("c10d", "etcd", "redis")],
    indirect=True,
)
def test_ten_membership_changes(backend: Backend, tmp_path: Path, recovery: Recovery) -> None:
    job = ElasticJob(
        backend, tmp_path, nnodes="1:3", nproc=1, size=SIZE, epochs=EPOCHS, batch=BATCH,
        step_seconds=STEP_SECONDS,
    )  # fmt: skip
    members: list[Node] = []
    seconds: list[float] = []
    try:
        anchor = job.start("a")
        anchor.wait_for_step(world=1)
        for action, name in PLAN:
            since = anchor.mark()
            began = time.time()
            if action == "join":
                members.append(job.start(name))
            else:
                (node,) = [n for n in members if n.name == name]
                members.remove(node)
                leave(node, action)
            world = 1 + len(members)
            anchor.wait_for_training(world, since)
            reformed = [e for e in anchor.rounds_after(began) if e["group_world_size"] == world]
            seconds.append(reformed[0]["wall_time"] - began)
        job.release()
        nodes = [anchor, *members]
        codes = exit_codes([node.process for node in nodes], timeout=90)
        assert codes == [0] * len(nodes), "\n".join(node.text() for node in nodes)
    finally:
        job.close()
    recovery.seconds = max(seconds)
    recovery.notes.append(
        "the longest of the 10 changes (from a node's start or signal to the round at the "
        f"new size); all: {', '.join(f'{s:.1f}' for s in seconds)}"
    )
    changes = [(e["old_nodes"], e["new_nodes"]) for e in anchor.events("scale_changed")]
    assert len(changes) >= len(PLAN), changes
    assert_no_restart_used(anchor)
    report = job.assert_every_sample_once()
    assert set(report["worlds"]) == {1, 2, 3}, report["worlds"]  # the sizes it trained at
    job.assert_no_worker_left()


def leave(node: Node, how: str) -> None:
    """Stop a node: SIGTERM (it stops its workers and exits 143) or SIGKILL (its workers die
    with it)."""
    if how == "sigterm":
        node.process.send_signal(signal.SIGTERM)
        assert node.process.wait(timeout=40) == 128 + signal.SIGTERM, node.text()
        return
    workers = node.worker_pids()
    node.process.kill()
    node.process.wait(timeout=30)
    wait_gone(workers)

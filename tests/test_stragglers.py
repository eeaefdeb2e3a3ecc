"""Stragglers (``--straggler-factor``, ``rallypoint.agent.monitoring.stragglers``): a node made slow
on purpose in a real two-node job, and the rules on paces whose answer is known."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from launch import rallypoint, worker
from rallypoint import goodput
from rallypoint.agent.monitoring.stragglers import stragglers
from rallypoint.rendezvous import records

TRAIN = worker("mem_train.py")


def test_a_node_made_slow_on_purpose_is_named_a_straggler(tmp_path: Path) -> None:
    """Two nodes of one worker each; node b's computes 0.2 s more per step before the
    all-reduce (both step at its pace): b, and only b, is named, once, in its log. 100
    steps: time for a few paces of each node to be measured and shared."""
    import launch
    from servers import free_port

    port = free_port()
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}

    def start(name: str) -> Any:
        return launch.start_agent(
            "c10d", f"127.0.0.1:{port}", "straggler", "2", "--checkpoint-memory", "64MB",
            "--event-log", str(logs[name].with_suffix(".jsonl")), TRAIN, "100",
            "--step-seconds", "0.05", "--busy-rank", "1", "--busy-seconds", "0.2",
            conf="heartbeat_timeout=3,last_call_timeout=1", log=logs[name], nproc=1,
        )  # fmt: skip

    agents = [start("a")]
    launch.wait_for_port(port)  # a hosts the store, and its worker is rank 0
    agents.append(start("b"))
    try:
        codes = launch.exit_codes(agents, timeout=180)
        assert codes == [0, 0], [log.read_text() for log in logs.values()]
    finally:
        launch.kill(*agents)
    named = {name: launch.events(log, "straggler") for name, log in logs.items()}
    assert (len(named["a"]), len(named["b"])) == (0, 1), named
    [event_] = named["b"]
    assert event_["ratio"] > 1.5 and event_["pace"] > 0.15  # its 0.2 s of busy CPU (in ticks)
    assert "this node is a straggler" in logs["b"].read_text()
    account = goodput.account(goodput.read(list(tmp_path.glob("*.jsonl")))[0])
    assert [s["node"] for s in account.stragglers] == [event_["node"]]
    assert "straggler: node" in goodput.summary(account)


def test_the_node_above_the_factor_times_the_others_median_is_named() -> None:
    paces = {"a": 0.10, "b": 0.11, "c": 0.30, "d": 0.09}
    found = stragglers(paces, 1.5)
    assert list(found) == ["c"]
    assert found["c"]["median"] == pytest.approx(0.10) and found["c"]["ratio"] == pytest.approx(3)
    assert stragglers({"a": 0.1}, 1.5) == {}  # alone: nobody to compare with
    assert stragglers(paces, 4) == {}


def test_a_node_record_carries_its_pace_to_the_rank_assigner() -> None:
    record = records.NodeRecord("n1", "h", 2, 1234, run_id="job", pace=0.25)
    assert records.decode_node("/rallypoint/job/0/node/1", records.encode(record)).pace == 0.25
    bare = records.NodeRecord("n1", "h", 2, 1234, run_id="job")
    assert b"pace" not in records.encode(bare)  # nothing added for a node without steps


@pytest.mark.parametrize("value", ["1", "0.5", "-2", "fast"])
def test_a_bad_straggler_factor_is_one_sentence(value: str) -> None:
    done = rallypoint("run", "--straggler-factor", value, TRAIN, "1", timeout=60)
    assert done.returncode == 2 and "--straggler-factor" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_node_s_pace_is_its_least_busy_worker_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 saving checkpoints works more per step than its node's other ranks: the node
    is as fast as its least busy worker."""
    from rallypoint.agent.monitoring import stragglers as module

    cpu = {1: 0.0, 2: 0.0}
    monkeypatch.setattr(module, "_cpu_seconds", lambda pid: cpu[pid])
    pace = module.Pace()
    for step in range(5):
        pace.sample([1, 2], step)
        cpu[1] += 0.5  # rank 0: its saves on top
        cpu[2] += 0.2
    assert pace.seconds() == pytest.approx(0.2)

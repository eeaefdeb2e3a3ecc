"""Multi-node jobs: real agents as separate processes on the c10d and static backends,
gloo workers.

The protocol itself is checked store by store by ``rallypoint.testing.store_conformance``
(tests/test_store_conformance.py)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from launch import RALLYPOINT, clean_environment, worker
from rallypoint.rendezvous.memory import MemoryStore
from rallypoint.rendezvous.protocol import RetryingStore
from rallypoint.rendezvous.store import StoreError, StoreUnavailable
from servers import free_port

pytestmark = pytest.mark.usefixtures("agent_tmpdir")


# --- real agents -------------------------------------------------------------------------


def start_agent(
    port: int, run_id: str, nnodes: str, *args: str, log: Path, nproc: int = 2
) -> subprocess.Popen[str]:
    command = [
        RALLYPOINT, "run", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
        "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", run_id, "--rdzv-conf", "heartbeat_timeout=3,last_call_timeout=1", *args,
    ]  # fmt: skip
    return _popen(command, log)


def start_static(port: int, nnodes: int, node_rank: int, *args: str, log: Path) -> Any:
    command = [
        RALLYPOINT, "run", "--nnodes", str(nnodes), "--nproc-per-node", "2",
        "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
        "--rdzv-conf", "join_timeout=60", *args,
    ]  # fmt: skip
    return _popen(command, log)


def _popen(command: list[str], log: Path) -> subprocess.Popen[str]:
    handle = log.open("w")
    return subprocess.Popen(
        command, env=clean_environment(), stdout=handle, stderr=subprocess.STDOUT, text=True
    )


def wait_for_store(port: int, timeout: float = 60) -> None:
    """Until the first agent hosts the c10d store, so the next one does not."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"no store on port {port}")


def test_two_nodes_all_reduce(tmp_path: Path) -> None:
    port = free_port()
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    agents = [start_agent(port, "job", "2", worker("allreduce.py"), "5", log=log) for log in logs]
    try:
        codes = [agent.wait(timeout=180) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    output = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], output
    for rank in range(4):
        assert f"done rank={rank} world=4 attempt=0" in output


def test_a_killed_node_leaves_no_orphan_and_the_survivor_trains_on(tmp_path: Path) -> None:
    port = free_port()
    survivor_log, victim_log = tmp_path / "survivor.log", tmp_path / "victim.log"
    survivor = start_agent(
        port, "job", "1:2", worker("steps.py"), "30", str(tmp_path), log=survivor_log
    )
    wait_for_store(port)  # the survivor hosts the store; losing its host ends a c10d job
    victim = start_agent(
        port, "job", "1:2", worker("steps.py"), "30", str(tmp_path), log=victim_log
    )
    try:
        deadline = time.monotonic() + 120
        while "world=4" not in survivor_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "world=4" in survivor_log.read_text(), survivor_log.read_text()
        killed_at = time.time()
        victim.kill()
        victim.wait(timeout=30)
        deadline = time.monotonic() + 120
        while "world=2 sum=2" not in survivor_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        survivor.terminate()  # it trains on: enough seen, stop it gracefully
        assert survivor.wait(timeout=60) == 128 + signal.SIGTERM, survivor_log.read_text()
    finally:
        survivor.kill()
        victim.kill()
    text = survivor_log.read_text()
    resumed = [float(t) for t in re.findall(r"world=2 sum=2 at=([\d.]+)", text)]
    assert resumed, text
    # heartbeat_timeout=3: the round re-forms within it; the new workers need ~2 s to start.
    assert resumed[0] - killed_at < 3 + 6, f"resumed after {resumed[0] - killed_at:.1f} s"
    leftovers = subprocess.run(
        ["pgrep", "-f", f"steps.py 30 {tmp_path}"], capture_output=True, text=True, timeout=10
    )
    assert leftovers.stdout.strip() == "", "orphan workers"


def test_a_node_joining_a_running_job_scales_it_up(tmp_path: Path) -> None:
    port = free_port()
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start_agent(port, "job", "1:2", worker("steps.py"), "25", str(tmp_path), log=first_log)
    wait_for_store(port)
    second = None
    try:
        deadline = time.monotonic() + 120
        while "world=2 sum=2" not in first_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "world=2 sum=2" in first_log.read_text(), first_log.read_text()
        second = start_agent(
            port, "job", "1:2", worker("steps.py"), "25", str(tmp_path), log=second_log
        )
        deadline = time.monotonic() + 120
        while "world=4 sum=4" not in second_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        second.terminate()  # both trained at world size 4: stop them gracefully
        first.terminate()
        assert second.wait(timeout=60) == 128 + signal.SIGTERM, second_log.read_text()
        assert first.wait(timeout=60) == 128 + signal.SIGTERM, first_log.read_text()
    finally:
        first.kill()
        if second is not None:
            second.kill()
    assert "world=4 sum=4" in first_log.read_text()
    assert "world=4 sum=4" in second_log.read_text()
    # A membership change does not use up a restart.
    assert "restart 1 of" not in first_log.read_text()


def test_losing_the_store_host_is_reported_clearly(tmp_path: Path) -> None:
    port = free_port()
    host_log, other_log = tmp_path / "host.log", tmp_path / "other.log"
    host = start_agent(port, "job", "2", worker("steps.py"), "30", str(tmp_path), log=host_log)
    wait_for_store(port)
    other = start_agent(port, "job", "2", worker("steps.py"), "30", str(tmp_path), log=other_log)
    try:
        deadline = time.monotonic() + 120
        while "world=4" not in other_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        host.kill()
        host.wait(timeout=30)
        assert other.wait(timeout=60) == 1
    finally:
        host.kill()
        other.kill()
    assert "the agent hosting it may have died" in other_log.read_text()
    assert "Traceback" not in other_log.read_text().split("rallypoint: error:")[-1]
    leftovers = subprocess.run(
        ["pgrep", "-f", f"steps.py 30 {tmp_path}"], capture_output=True, text=True, timeout=10
    )
    assert leftovers.stdout.strip() == "", "orphan workers"


def test_rendezvous_status_shows_the_running_round(tmp_path: Path) -> None:
    port = free_port()
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    agents = [start_agent(port, "job", "2", worker("steps.py"), "30", str(tmp_path), log=logs[0])]
    wait_for_store(port)
    agents.append(
        start_agent(port, "job", "2", worker("steps.py"), "30", str(tmp_path), log=logs[1])
    )
    try:
        deadline = time.monotonic() + 120
        while "world=4" not in logs[0].read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "world=4" in logs[0].read_text(), logs[0].read_text()
        endpoint = f"127.0.0.1:{port}"
        common = ["--rdzv-endpoint", endpoint, "--rdzv-conf", "heartbeat_timeout=3"]
        result = subprocess.run(
            [RALLYPOINT, "rendezvous", "status", "--rdzv-id", "job", *common, "--json"],
            env=clean_environment(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        other = subprocess.run(
            [RALLYPOINT, "rendezvous", "status", "--rdzv-id", "other-job", *common],
            env=clean_environment(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        for agent in agents:
            agent.kill()
            agent.wait(timeout=30)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["round"] == 0 and not report["forming"]
    assert [m["group_rank"] for m in report["members"]] == [0, 1]
    assert all(m["alive"] and m["nproc"] == 2 for m in report["members"])
    assert report["waiting"] == 0
    assert other.stdout.strip() == "run other-job: no rendezvous in this store"


def test_static_nodes_take_the_node_ranks_given(tmp_path: Path) -> None:
    port = free_port()
    logs = {rank: tmp_path / f"node{rank}.log" for rank in (1, 0)}
    # Node rank 1 first: it waits for node rank 0, which hosts the store.
    agents = [start_static(port, 2, r, worker("allreduce.py"), "5", log=logs[r]) for r in logs]
    try:
        codes = [agent.wait(timeout=180) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    output = {rank: log.read_text() for rank, log in logs.items()}
    assert codes == [0, 0], output
    for node_rank, text in output.items():
        for local_rank in range(2):
            rank = node_rank * 2 + local_rank
            assert f"done rank={rank} world=4 attempt=0" in text, text


def test_static_nodes_with_the_same_node_rank_are_a_clear_error(tmp_path: Path) -> None:
    port = free_port()
    logs = [tmp_path / f"node{i}.log" for i in range(3)]
    ranks = [0, 1, 1]  # and no node rank 2
    agents = [
        start_static(port, 3, rank, worker("allreduce.py"), "5", log=log)
        for rank, log in zip(ranks, logs, strict=True)
    ]
    try:
        codes = [agent.wait(timeout=120) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    texts = [log.read_text() for log in logs]
    assert all(code != 0 for code in codes), texts
    for text in texts:
        errors = [line for line in text.splitlines() if "error" in line]
        assert len(errors) == 1, text
        assert "--node-rank 1 was given to 2 nodes" in errors[0], text
        assert "Traceback" not in text


def test_two_runs_on_one_store_never_mix(tmp_path: Path) -> None:
    port = free_port()
    runs = ["job-a", "job-b", "job-a", "job-b"]
    logs = [tmp_path / f"{run}-{i}.log" for i, run in enumerate(runs)]
    events = [log.with_suffix(".jsonl") for log in logs]

    def start(index: int) -> subprocess.Popen[str]:
        script = ["--event-log", str(events[index]), worker("allreduce.py"), "3"]
        return start_agent(port, runs[index], "2", *script, log=logs[index], nproc=1)

    agents = [start(0)]
    wait_for_store(port)
    agents += [start(index) for index in range(1, 4)]
    try:
        codes = [agent.wait(timeout=180) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0, 0, 0], texts
    # Each run's two nodes are each other's members, and nobody else's.
    node_ids, members = [], []
    for path in events:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        node_ids.append(records[0]["node"])
        (completed,) = [r for r in records if r["event"] == "rendezvous_completed"]
        members.append(set(completed["members"]))
    assert members[0] == members[2] == {node_ids[0], node_ids[2]}
    assert members[1] == members[3] == {node_ids[1], node_ids[3]}


def test_a_malformed_record_in_the_store_is_a_clear_error(tmp_path: Path) -> None:
    from rallypoint.rendezvous.tcpstore import TCPStoreClient

    port = free_port()
    store = TCPStoreClient("127.0.0.1", port, is_host=True, timeout=30)
    try:
        store.set("/rallypoint/job/state", b"\x80\x04K\x00.")  # a pickle: never loaded
        log = tmp_path / "agent.log"
        agent = start_agent(
            port, "job", "2", "--rdzv-conf", "is_host=false", worker("allreduce.py"), "3", log=log
        )
        code = agent.wait(timeout=60)
    finally:
        store.close()
    text = log.read_text()
    assert code == 1, text
    assert text.strip().splitlines()[-1].startswith("rallypoint: error: ")
    assert "'/rallypoint/job/state' is not JSON" in text
    assert "Traceback" not in text


# --- store outages -------------------------------------------------------------------------


class FlakyStore(MemoryStore):
    """A real in-memory store that refuses every operation while ``down`` is set."""

    down = threading.Event()

    def add(self, key: str, amount: int) -> int:
        if self.down.is_set():
            raise StoreUnavailable("the store is restarting")
        return super().add(key, amount)


def test_an_outage_shorter_than_retry_timeout_is_ridden_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = RetryingStore(FlakyStore(), retry_timeout=10)
    FlakyStore.down.set()
    threading.Timer(1.0, FlakyStore.down.clear).start()
    began = time.monotonic()
    with caplog.at_level("INFO", logger="rallypoint.rendezvous"):
        assert store.add("/k", 1) == 1
    took = time.monotonic() - began
    assert 0.9 < took < 5, took
    assert "rendezvous store unreachable (the store is restarting); retrying" in caplog.text
    assert "rendezvous store reachable again after" in caplog.text


def test_an_outage_longer_than_retry_timeout_is_a_clear_error() -> None:
    store = RetryingStore(FlakyStore(), retry_timeout=1)
    FlakyStore.down.set()
    try:
        began = time.monotonic()
        with pytest.raises(StoreError, match=r"still unreachable after retry_timeout=1 s"):
            store.add("/k", 1)
        assert time.monotonic() - began < 3
    finally:
        FlakyStore.down.clear()

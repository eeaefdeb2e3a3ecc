"""Multi-node rendezvous: the protocol over a real TCPStore, and real agents on c10d."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch import RALLYPOINT, clean_environment, worker
from rallypoint.builtins.rank_assigners import ordered
from rallypoint.extensions import NodeSpec, RankAssigner
from rallypoint.rendezvous import records
from rallypoint.rendezvous.protocol import RendezvousTimeout, Settings, StoreRendezvous
from rallypoint.rendezvous.store import StoreError
from rallypoint.rendezvous.tcpstore import TCPStoreClient
from servers import free_port

ORDERED = RankAssigner("ordered", "", ordered)


@pytest.fixture(autouse=True)
def _agent_temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent_tmp = tmp_path / "agent-tmp"
    agent_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(agent_tmp))


@pytest.fixture
def store_port() -> Iterator[int]:
    """A TCPStore hosted by the test for the protocol-level tests."""
    port = free_port()
    host = TCPStoreClient("127.0.0.1", port, is_host=True, timeout=30)
    yield port
    host.close()


def handler(
    port: int, run_id: str, name: str, low: int, high: int, **conf: float
) -> StoreRendezvous:
    store = TCPStoreClient("127.0.0.1", port, is_host=False, timeout=30)
    settings = Settings.from_conf(low, high, {"last_call_timeout": 2.0, **conf})
    return StoreRendezvous(store, run_id, NodeSpec(name, host="127.0.0.1"), 2, ORDERED, settings)


def join_all(handlers: list[StoreRendezvous]) -> list[object]:
    results: list[object] = [None] * len(handlers)

    def join(index: int) -> None:
        try:
            results[index] = handlers[index].next_round()
        except Exception as error:  # reported by the assertion below
            results[index] = error

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_concurrent_joins_agree_on_members_and_ranks(store_port: int) -> None:
    nodes = [handler(store_port, "job", f"node{i}", 8, 8) for i in range(8)]
    try:
        began = time.monotonic()
        assignments = join_all(nodes)
        took = time.monotonic() - began
    finally:
        for node in nodes:
            node.close()
    infos = [a.info for a in assignments]  # type: ignore[attr-defined]
    assert sorted(info.group_rank for info in infos) == list(range(8))
    assert len({(info.members, info.master_port, info.round) for info in infos}) == 1
    assert all(info.world_size == 16 for info in infos)
    # MAX joined: the round closes at once, not after the 2 s last call.
    assert took < 2


def test_two_run_ids_on_one_store_never_mix(store_port: int) -> None:
    nodes = [handler(store_port, f"job{i % 2}", f"n{i}", 2, 2) for i in range(4)]
    try:
        assignments = join_all(nodes)
    finally:
        for node in nodes:
            node.close()
    by_job: dict[str, set[str]] = {"job0": set(), "job1": set()}
    for index, assignment in enumerate(assignments):
        by_job[f"job{index % 2}"].update(assignment.info.members)  # type: ignore[attr-defined]
    assert by_job == {"job0": {"n0", "n2"}, "job1": {"n1", "n3"}}


def test_a_late_node_ends_the_round_when_there_is_room(store_port: int) -> None:
    first = handler(store_port, "job", "a", 1, 2, last_call_timeout=0.5)
    late = handler(store_port, "job", "b", 1, 2, last_call_timeout=0.5)
    try:
        assert first.next_round().info.group_world_size == 1
        assert first.nodes_waiting() == 0
        result: list[object] = []
        thread = threading.Thread(target=lambda: result.append(late.next_round()))
        thread.start()
        deadline = time.monotonic() + 10
        while first.nodes_waiting() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.nodes_waiting() == 1
        again = first.next_round()
        thread.join(30)
        assert again.info.group_world_size == 2
        assert result[0].info.members == again.info.members  # type: ignore[attr-defined]
    finally:
        first.close()
        late.close()


def test_malformed_records_are_clear_errors(store_port: int) -> None:
    store = TCPStoreClient("127.0.0.1", store_port, is_host=False, timeout=30)
    store.set("/rallypoint/job/state", b"\x80\x04K\x00.")  # a pickle, never loaded
    node = handler(store_port, "job", "a", 1, 1)
    try:
        with pytest.raises(StoreError, match="'/rallypoint/job/state' is not JSON"):
            node.next_round()
    finally:
        node.close()
    with pytest.raises(StoreError, match="version 9"):
        records.decode_int("k", json.dumps({"kind": "counter", "version": 9, "value": 1}).encode())
    with pytest.raises(StoreError, match="not a rallypoint round record"):
        records.decode_round("k", json.dumps({"kind": "node", "version": 1}).encode())
    with pytest.raises(StoreError, match="malformed"):
        records.decode_node("k", json.dumps({"kind": "node", "version": 1, "host": "h"}).encode())


# --- real agents -------------------------------------------------------------------------


def start_agent(
    port: int, run_id: str, nnodes: str, *args: str, log: Path
) -> subprocess.Popen[str]:
    command = [
        RALLYPOINT, "run", "--nnodes", nnodes, "--nproc-per-node", "2", "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        "--rdzv-conf", "heartbeat_timeout=3,last_call_timeout=1", *args,
    ]  # fmt: skip
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
        assert survivor.wait(timeout=120) == 0, survivor_log.read_text()
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
        assert first.wait(timeout=180) == 0, first_log.read_text()
        assert second.wait(timeout=180) == 0, second_log.read_text()
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


def test_a_node_that_finds_the_job_full_never_forms_a_second_job(store_port: int) -> None:
    members = [handler(store_port, "job", f"m{i}", 1, 2) for i in range(2)]
    extra = handler(store_port, "job", "extra", 1, 2, join_timeout=3, last_call_timeout=0.5)
    try:
        assignments = join_all(members)
        assert all(a.info.group_world_size == 2 for a in assignments)  # type: ignore[attr-defined]
        with pytest.raises(RendezvousTimeout, match="this node was not needed"):
            extra.next_round()
        # The running job was not disturbed.
        assert [m.nodes_waiting() for m in members] == [0, 0]
    finally:
        for node in [*members, extra]:
            node.close()

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

import pytest

import launch
from launch import (
    assert_no_worker_left,
    exit_codes,
    kill,
    rallypoint,
    start_rallypoint,
    wait_for_port,
    wait_for_text,
    worker,
)
from rallypoint.interfaces import StoreError, StoreUnavailable
from rallypoint.rendezvous.memory_store import MemoryStore
from rallypoint.rendezvous.retrying import RetryingStore
from rallypoint.rendezvous.tcpstore import TCPStoreClient
from servers import free_port

pytestmark = pytest.mark.usefixtures("agent_tmpdir")


# --- real agents -------------------------------------------------------------------------


def start_agent(
    port: int, run_id: str, nnodes: str, *args: str, log: Path, nproc: int = 2
) -> subprocess.Popen[str]:
    conf = "heartbeat_timeout=3,last_call_timeout=1"
    endpoint = f"127.0.0.1:{port}"
    return launch.start_agent(
        "c10d", endpoint, run_id, nnodes, *args, conf=conf, log=log, nproc=nproc
    )


def start_static(
    port: int, nnodes: int, node_rank: int, *args: str, log: Path
) -> subprocess.Popen[str]:
    return start_rallypoint(
        "run", "--nnodes", str(nnodes), "--nproc-per-node", "2",
        "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
        "--rdzv-conf", "join_timeout=60", *args, log=log,
    )  # fmt: skip


def test_two_nodes_all_reduce(tmp_path: Path) -> None:
    port = free_port()
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    agents = [start_agent(port, "job", "2", worker("allreduce.py"), "5", log=log) for log in logs]
    codes = exit_codes(agents, timeout=180)
    output = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], output
    for rank in range(4):
        assert f"done rank={rank} world=4 attempt=0" in output


@pytest.mark.soak  # make test: tests/faults (agent SIGKILL, an agent restarted, churn)
def test_a_killed_node_leaves_no_orphan_and_the_survivor_trains_on(tmp_path: Path) -> None:
    port = free_port()
    survivor_log, victim_log = tmp_path / "survivor.log", tmp_path / "victim.log"
    survivor = start_agent(
        port, "job", "1:2", worker("steps.py"), "30", str(tmp_path), log=survivor_log
    )
    wait_for_port(port)  # the survivor hosts the store; losing its host ends a c10d job
    victim = start_agent(
        port, "job", "1:2", worker("steps.py"), "30", str(tmp_path), log=victim_log
    )
    try:
        wait_for_text(survivor_log, "world=4")
        killed_at = time.time()
        kill(victim)
        wait_for_text(survivor_log, "world=2 sum=2")
        survivor.terminate()  # it trains on: enough seen, stop it gracefully
        assert survivor.wait(timeout=60) == 128 + signal.SIGTERM, survivor_log.read_text()
    finally:
        kill(survivor, victim)
    text = survivor_log.read_text()
    resumed = [float(t) for t in re.findall(r"world=2 sum=2 at=([\d.]+)", text)]
    assert resumed, text
    # heartbeat_timeout=3: the round re-forms within it; the new workers need ~2 s to start.
    assert resumed[0] - killed_at < 3 + 6, f"resumed after {resumed[0] - killed_at:.1f} s"
    assert_no_worker_left(f"steps.py 30 {tmp_path}")


@pytest.mark.soak  # make test: tests/faults (agent SIGKILL, an agent restarted, churn)
def test_a_node_joining_a_running_job_scales_it_up(tmp_path: Path) -> None:
    port = free_port()
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start_agent(port, "job", "1:2", worker("steps.py"), "25", str(tmp_path), log=first_log)
    wait_for_port(port)
    second = None
    try:
        wait_for_text(first_log, "world=2 sum=2")
        second = start_agent(
            port, "job", "1:2", worker("steps.py"), "25", str(tmp_path), log=second_log
        )
        wait_for_text(second_log, "world=4 sum=4")
        second.terminate()  # both trained at world size 4: stop them gracefully
        first.terminate()
        assert second.wait(timeout=60) == 128 + signal.SIGTERM, second_log.read_text()
        assert first.wait(timeout=60) == 128 + signal.SIGTERM, first_log.read_text()
    finally:
        kill(first, second)
    assert "world=4 sum=4" in first_log.read_text()
    assert "world=4 sum=4" in second_log.read_text()
    # A membership change does not use up a restart.
    assert "restart 1 of" not in first_log.read_text()


def test_losing_the_store_host_is_reported_clearly(tmp_path: Path) -> None:
    port = free_port()
    host_log, other_log = tmp_path / "host.log", tmp_path / "other.log"
    host = start_agent(port, "job", "2", worker("steps.py"), "30", str(tmp_path), log=host_log)
    wait_for_port(port)
    other = start_agent(port, "job", "2", worker("steps.py"), "30", str(tmp_path), log=other_log)
    try:
        wait_for_text(other_log, "world=4")
        kill(host)
        assert other.wait(timeout=60) == 1
    finally:
        kill(host, other)
    assert "the agent hosting it may have died" in other_log.read_text()
    assert "Traceback" not in other_log.read_text().split("rallypoint: error:")[-1]
    assert_no_worker_left(f"steps.py 30 {tmp_path}")


def test_rendezvous_status_shows_the_running_round(tmp_path: Path) -> None:
    port = free_port()
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    agents = [start_agent(port, "job", "2", worker("steps.py"), "30", str(tmp_path), log=logs[0])]
    wait_for_port(port)
    agents.append(
        start_agent(port, "job", "2", worker("steps.py"), "30", str(tmp_path), log=logs[1])
    )
    try:
        wait_for_text(logs[0], "world=4")
        endpoint = f"127.0.0.1:{port}"
        common = ["--rdzv-endpoint", endpoint, "--rdzv-conf", "heartbeat_timeout=3"]
        result = rallypoint(
            "rendezvous", "status", "--rdzv-id", "job", *common, "--json", timeout=60
        )
        other = rallypoint("rendezvous", "status", "--rdzv-id", "other-job", *common, timeout=60)
    finally:
        kill(*agents)
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
    codes = exit_codes(agents, timeout=180)
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
    codes = exit_codes(agents, timeout=120)
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
        conf = ["--rdzv-conf", "is_host=false,last_call_timeout=1"]
        return start_agent(port, runs[index], "2", *conf, *script, log=logs[index], nproc=1)

    # The store outlives both jobs (an agent hosting it would end it when its job ends).
    store = TCPStoreClient("127.0.0.1", port, is_host=True, timeout=30)
    try:
        agents = [start(index) for index in range(4)]
        codes = exit_codes(agents, timeout=180)
    finally:
        store.close()
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


class _StallingWorld:
    """A clock that the test moves: each pause of a retry takes what was asked and
    ``stall`` seconds more (the process stood still: SIGSTOP, a host that stalled)."""

    def __init__(self, stall: float) -> None:
        self.now, self.stall = 0.0, stall

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds + self.stall


class _FailingTwice:
    """A store whose first two operations find it unreachable."""

    def __init__(self) -> None:
        self.failures = 2

    def add(self, key: str, amount: int) -> int:
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("cut off")
        return 1


def test_time_the_process_stood_still_between_tries_does_not_count() -> None:
    """Two failed tries 0.1 s apart, but the process stood still for 30 s after the first:
    the store was out of reach for 0.3 s, not 30, so the third try is made and succeeds
    (before: 'still unreachable after retry_timeout=20 s' when the process woke)."""
    world = _StallingWorld(stall=30.0)
    store = RetryingStore(_FailingTwice(), retry_timeout=20, world=world)  # type: ignore[arg-type]
    assert store.add("/k", 1) == 1
    assert world.now > 60  # it did stand still, twice
    world = _StallingWorld(stall=0.5)  # a pause a little late is no stall: it counts
    store = RetryingStore(_FailingTwice(), retry_timeout=0.3, world=world)  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="still unreachable after retry_timeout"):
        store.add("/k", 1)


def test_an_exit_barrier_of_a_round_the_others_left_does_not_wait() -> None:
    """Node a finishes round 0 while node b, taking it for gone, went on to round 1: a's
    exit barrier returns once it sees the job past its round, not after its timeout."""
    from rallypoint.builtins.rank_assigners import register_rank_assigners
    from rallypoint.extensions import NodeSpec
    from rallypoint.rendezvous.protocol import StoreRendezvous
    from rallypoint.rendezvous.settings import Settings

    store = MemoryStore()
    ordered = register_rank_assigners()[0]
    settings = Settings.from_conf(2, 2, {"last_call_timeout": 0.2, "heartbeat_timeout": 3})
    a, b = (
        StoreRendezvous(store, "job", NodeSpec(name, host="h"), 1, ordered, settings)
        for name in ("a", "b")
    )
    try:
        joined = threading.Thread(target=b.next_round)
        joined.start()
        a.next_round()
        joined.join(10)
        b.request_new_round()  # b went on without a
        began = time.monotonic()
        a.exit_barrier(60)
        assert time.monotonic() - began < 5
    finally:
        a.close()
        b.close()


def test_a_joiner_is_alive_before_its_record_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node b comes while a's heartbeat thread has yet to run (a loaded host): b must find
    a alive, not take the run for abandoned and start it afresh without a."""
    from rallypoint.builtins.rank_assigners import register_rank_assigners
    from rallypoint.extensions import NodeSpec
    from rallypoint.rendezvous.heartbeat import Heartbeat
    from rallypoint.rendezvous.keys import Keys
    from rallypoint.rendezvous.protocol import StoreRendezvous
    from rallypoint.rendezvous.settings import Settings

    run = Heartbeat.run

    def late_run(self: Heartbeat, *args: object) -> object:
        time.sleep(2)
        return (yield from run(self, *args))  # type: ignore[arg-type]

    monkeypatch.setattr(Heartbeat, "run", late_run)
    store = MemoryStore()
    ordered = register_rank_assigners()[0]
    conf = {"last_call_timeout": 0.2, "heartbeat_timeout": 30, "join_timeout": 8}
    settings = Settings.from_conf(2, 2, conf)
    a, b = (
        StoreRendezvous(store, "job", NodeSpec(name, host="h"), 1, ordered, settings)
        for name in ("a", "b")
    )
    results: list[object] = []
    try:
        joined = threading.Thread(target=lambda: results.append(a.next_round()))
        joined.start()
        first = Keys("/rallypoint", "job").of_round(0, "node", 1)
        assert store.wait([first], 5)
        assert b.next_round().info.members == ("a", "b")
        joined.join(10)
        assert len(results) == 1
    finally:
        a.close()
        b.close()


def test_a_plugin_handler_without_a_method_the_agent_calls_is_refused() -> None:
    from rallypoint.agent.statemachine.rendezvous_handler import checked_handler
    from rallypoint.errors import UsageError

    class Partial:
        def next_round(self) -> None: ...

    with pytest.raises(UsageError, match=r"without nodes_waiting, request_new_round, .*paces"):
        checked_handler("mine", Partial())


def test_a_plugin_handler_gets_the_optional_methods_from_the_base_class() -> None:
    from rallypoint.agent.statemachine.rendezvous_handler import checked_handler
    from rallypoint.sdk import RendezvousHandler

    class Mine(RendezvousHandler):
        def next_round(self):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def nodes_waiting(self) -> int:
            return 0

        def request_new_round(self) -> None: ...

        def exit_barrier(self, timeout: float) -> None: ...

        def close(self) -> None: ...

    handler = checked_handler("mine", Mine())
    assert handler.gone(["a"]) == [] and handler.paces() == {} and handler.waits() == {}
    handler.fail("why")  # nothing to do: the others see this node leave

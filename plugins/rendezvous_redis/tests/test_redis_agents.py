"""Real agents on the redis backend: ``rallypoint run`` processes with gloo workers, and
a real redis-server (restarted, or failed over by Sentinel, during training)."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_py
from redis_setups import sentinel_group, status

import launch
from launch import assert_no_worker_left, kill, wait_for_text, worker
from servers import RedisServer, start_redis

pytestmark = pytest.mark.usefixtures("rallypoint_agent_tmpdir")

CONF = "heartbeat_timeout=3,key_ttl=2,last_call_timeout=1,retry_timeout=30"


#: ``start_agent(endpoint, run_id, nnodes, *args, log=..., nproc=2, conf=CONF)``
start_agent = functools.partial(launch.start_agent, "redis", conf=CONF)


def events(path: Path, name: str) -> list[dict[str, object]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [record for record in records if record["event"] == name]


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


def test_two_agents_all_reduce_and_status_shows_them(redis: RedisServer, tmp_path: Path) -> None:
    endpoint = f"redis://127.0.0.1:{redis.port}/2"
    conf = CONF + ",prefix=team-a"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    agents = [
        start_agent(
            endpoint, "job", "2", worker("steps.py"), "4", str(tmp_path), log=log, conf=conf
        )
        for log in logs
    ]
    try:
        wait_for_text(logs[0], "world=4 sum=4")
        kept = keys_in(redis, db=2)  # while the job runs
        report = status("--rdzv-endpoint", endpoint, "--rdzv-id", "job", "--rdzv-conf",
                        "prefix=team-a", "--json")  # fmt: skip
        codes = [agent.wait(timeout=120) for agent in agents]
    finally:
        kill(*agents)
    output = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], output
    for rank in range(4):
        assert f"done rank={rank} world=4" in output
    assert report.returncode == 0, report.stderr
    shown = json.loads(report.stdout)
    assert shown["round"] == 0 and not shown["forming"] and shown["waiting"] == 0
    assert [m["group_rank"] for m in shown["members"]] == [0, 1]
    assert all(m["alive"] and m["nproc"] == 2 for m in shown["members"])
    # Everything the job kept is in database 2, under the prefix and the run id; and once
    # it finished cleanly, nothing is left.
    assert kept and all(key.startswith("team-a/job/") for key in kept), kept
    assert keys_in(redis, db=2) == []


def keys_in(redis: RedisServer, db: int) -> list[str]:
    client = redis_py.Redis(port=redis.port, db=db, decode_responses=True)
    try:
        return [str(key) for key in client.keys("*")]
    finally:
        client.close()


def test_a_killed_agent_expires_and_the_survivor_trains_on(
    redis: RedisServer, tmp_path: Path
) -> None:
    endpoint = f"127.0.0.1:{redis.port}"
    survivor_log, victim_log = tmp_path / "survivor.log", tmp_path / "victim.log"
    survivor_events = tmp_path / "survivor.jsonl"
    script = [worker("steps.py"), "6", str(tmp_path)]
    survivor = start_agent(
        endpoint, "job", "1:2", "--event-log", str(survivor_events), *script, log=survivor_log
    )
    victim = start_agent(endpoint, "job", "1:2", *script, log=victim_log)
    try:
        wait_for_text(survivor_log, "world=4")
        killed_at = time.time()
        kill(victim)
        assert survivor.wait(timeout=120) == 0, survivor_log.read_text()
    finally:
        kill(survivor, victim)
    text = survivor_log.read_text()
    assert "world=2 sum=2" in text, text
    (again,) = [e for e in events(survivor_events, "rendezvous_completed") if e["round"] != 0]
    reformed = float(again["wall_time"]) - killed_at  # type: ignore[arg-type]
    print(f"re-formed {reformed:.2f} s after the SIGKILL")
    # key_ttl=2: the victim's key is gone 2 s after its last refresh; +2 s to notice and form.
    assert reformed < 2 + 2, f"the survivor re-formed {reformed:.1f} s after the kill"
    assert_no_worker_left(f"steps.py 6 {tmp_path}")


@pytest.mark.soak  # make test: tests/faults (agent SIGKILL, an agent restarted, churn)
def test_a_node_joining_a_running_job_scales_it_up(redis: RedisServer, tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{redis.port}"
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    # The job trains until the second node is in, however long its start takes (a job of a
    # fixed length may end before it on a loaded machine).
    stop = tmp_path / "stop"
    script = [worker("train_until.py"), str(stop)]
    first = start_agent(endpoint, "job", "1:2", *script, log=first_log)
    second = None
    try:
        wait_for_text(first_log, "world=2 sum=2")
        second = start_agent(endpoint, "job", "1:2", *script, log=second_log)
        wait_for_text(second_log, "world=4 sum=4")
        stop.touch()
        assert first.wait(timeout=120) == 0, first_log.read_text()
        assert second.wait(timeout=120) == 0, second_log.read_text()
    finally:
        kill(first, second)
    assert "world=4 sum=4" in first_log.read_text()
    assert "world=4 sum=4" in second_log.read_text()
    assert "restart 1 of" not in first_log.read_text()


def test_a_sentinel_failover_during_training(tmp_path: Path) -> None:
    with sentinel_group(tmp_path) as group:
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        conf = CONF + f",sentinel_master={group.name}"
        agents = [
            start_agent(
                group.endpoint,
                "job",
                "2",
                worker("steps.py"),
                "10",
                str(tmp_path),
                log=log,
                nproc=1,
                conf=conf,
            )
            for log in logs
        ]
        try:
            wait_for_text(logs[0], "world=2 sum=2")
            group.master.stop()  # the replica is promoted
            deadline = time.monotonic() + 60
            while group.master_port() != group.replica.port:
                assert time.monotonic() < deadline, "the sentinels never failed over"
                time.sleep(0.2)
            codes = [agent.wait(timeout=120) for agent in agents]
        finally:
            kill(*agents)
        output = "".join(log.read_text() for log in logs)
        assert codes == [0, 0], output
        assert "done rank=0 world=2" in output and "done rank=1 world=2" in output, output
        assert "rendezvous store reachable again" in output, "the failover went unnoticed"

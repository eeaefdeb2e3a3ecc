"""Real agents (``rallypoint run`` processes, gloo workers) on ``--rdzv-backend etcd``, and
the command line's errors, against real etcd servers."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from etcd_servers import PASSWORD, USER, Certificates, TlsEtcd

import launch
from launch import (
    assert_no_worker_left,
    events,
    exit_codes,
    kill,
    rallypoint,
    wait_for_text,
    worker,
)
from servers import EtcdServer, free_port

pytestmark = pytest.mark.usefixtures("rallypoint_agent_tmpdir")

# Dead agents are found within lease_ttl (their lease expires) + heartbeat_timeout / 3.
CONF = "heartbeat_timeout=3,lease_ttl=3,last_call_timeout=1,connect_timeout=5"
WAIT = 90  # seconds for an agent to print what it does at a stage of the job


def start_agent(
    endpoint: str, nnodes: str, *script: str, log: Path, nproc: int = 2, conf: str = CONF
) -> subprocess.Popen[str]:
    """An agent of run ``job`` writing its events next to ``log`` (``.jsonl``)."""
    event_log = str(log.with_suffix(".jsonl"))
    return launch.start_agent(
        "etcd", endpoint, "job", nnodes, "--event-log", event_log, *script,
        conf=conf, log=log, nproc=nproc,
    )  # fmt: skip


def finish(agents: list[subprocess.Popen[str]], logs: list[Path], timeout: float = 90) -> None:
    codes = exit_codes(agents, timeout)
    assert codes == [0] * len(agents), "\n".join(log.read_text() for log in logs)


def status(endpoint: str, *args: str, run_id: str = "job") -> subprocess.CompletedProcess[str]:
    return rallypoint(
        "rendezvous", "status", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint,
        "--rdzv-id", run_id, *args, timeout=60,
    )  # fmt: skip


# --- jobs ----------------------------------------------------------------------------------


def test_two_agents_train_together_and_status_shows_them(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    script = (worker("steps.py"), "4", str(tmp_path))
    agents = [start_agent(etcd_server.endpoint, "2", *script, log=log) for log in logs]
    try:
        wait_for_text(logs[0], "world=4 sum=4", WAIT)
        report = status(etcd_server.endpoint, "--rdzv-conf", "heartbeat_timeout=3", "--json")
        other = status(etcd_server.endpoint, run_id="other-job")
    finally:
        finish(agents, logs)
    assert report.returncode == 0, report.stderr
    shown = json.loads(report.stdout)
    assert shown["round"] == 0 and not shown["forming"]
    assert [m["group_rank"] for m in shown["members"]] == [0, 1]
    assert all(m["alive"] and m["nproc"] == 2 for m in shown["members"])
    assert shown["waiting"] == 0
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == "run other-job: no rendezvous in this store"
    output = "".join(log.read_text() for log in logs)
    for rank in range(4):
        assert f"done rank={rank} world=4" in output


def test_a_killed_agent_lease_expires_and_the_survivor_trains_alone(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    survivor_log, victim_log = tmp_path / "survivor.log", tmp_path / "victim.log"
    script = (worker("steps.py"), "3", str(tmp_path))
    survivor = start_agent(etcd_server.endpoint, "1:2", *script, log=survivor_log)
    victim = start_agent(etcd_server.endpoint, "1:2", *script, log=victim_log)
    try:
        wait_for_text(survivor_log, "world=4 sum=4", WAIT)
        killed_at = time.time()
        kill(victim)  # nothing revokes its lease: etcd expires it
        assert survivor.wait(timeout=90) == 0, survivor_log.read_text()
    finally:
        kill(survivor, victim)
    text = survivor_log.read_text()
    assert "world=2 sum=2" in text, text
    rounds = events(survivor_log, "rendezvous_completed")
    assert [r["group_world_size"] for r in rounds] == [2, 1], rounds
    # lease_ttl=3: the new round within lease_ttl + 2 s of the kill.
    assert rounds[1]["wall_time"] - killed_at < 3 + 2, rounds[1]["wall_time"] - killed_at
    assert_no_worker_left(f"steps.py 3 {tmp_path}")


def test_a_third_node_joins_a_running_job(etcd_server: EtcdServer, tmp_path: Path) -> None:
    logs = [tmp_path / f"node{i}.log" for i in range(3)]
    # The job trains until the third node is in: a job of a fixed length ended before it
    # on a loaded 2-core machine (its agent took 6 s to start, then 8 s to import torch),
    # and it then started a job of its own.
    stop = tmp_path / "stop"
    script = (worker("train_until.py"), str(stop))
    agents = [
        start_agent(etcd_server.endpoint, "1:3", *script, log=log, nproc=1) for log in logs[:2]
    ]
    try:
        wait_for_text(logs[0], "world=2 sum=2", WAIT)
        agents.append(start_agent(etcd_server.endpoint, "1:3", *script, log=logs[2], nproc=1))
        wait_for_text(logs[2], "world=3 sum=3", WAIT)
        stop.touch()
    finally:
        finish(agents, logs)
    for log in logs:
        assert "world=3 sum=3" in log.read_text()
    assert "restart 1 of" not in logs[0].read_text()  # a membership change is no restart


def test_the_job_fails_over_when_a_cluster_member_dies(
    etcd_cluster: list[EtcdServer], tmp_path: Path
) -> None:
    endpoints = ",".join(member.endpoint for member in etcd_cluster)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    script = (worker("steps.py"), "4", str(tmp_path))
    agents = [start_agent(endpoints, "2", *script, log=log, nproc=1) for log in logs]
    try:
        wait_for_text(logs[0], "world=2 sum=2", WAIT)
        etcd_cluster[0].stop()  # the member both agents talk to (the first that answered)
    finally:
        finish(agents, logs)
    for log in logs:
        assert len(events(log, "rendezvous_completed")) == 1, log.read_text()
        assert "done rank=" in log.read_text()


# --- errors on the command line -------------------------------------------------------------


def run_fails(endpoint: str, conf: str, tmp_path: Path) -> str:
    result = rallypoint(
        "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
        "--rdzv-endpoint", endpoint, "--rdzv-id", "job", "--rdzv-conf", conf,
        worker("allreduce.py"), "1", cwd=tmp_path, timeout=60,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("rallypoint: error: ")]
    assert len(errors) == 1, output
    return errors[0]


def test_an_unreachable_endpoint_is_named_after_the_connect_timeout(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    began = time.monotonic()
    error = run_fails(endpoint, "connect_timeout=1", tmp_path)
    assert f"cannot reach etcd at {endpoint} within connect_timeout=1 s" in error
    assert time.monotonic() - began < 30


def test_a_wrong_password_is_refused_clearly(auth_etcd: EtcdServer, tmp_path: Path) -> None:
    error = run_fails(auth_etcd.endpoint, f"user={USER},password=wrong", tmp_path)
    assert f"etcd at {auth_etcd.endpoint} refused user 'root': wrong user name or password" in error
    assert "wrong" not in error.split("password")[-1]  # the secret is never printed
    missing = run_fails(auth_etcd.endpoint, "connect_timeout=5", tmp_path)
    assert "requires authentication: give --rdzv-conf user=NAME,password=SECRET" in missing


def test_the_right_password_is_accepted(auth_etcd: EtcdServer) -> None:
    result = status(auth_etcd.endpoint, "--rdzv-conf", f"user={USER},password={PASSWORD}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "run job: no rendezvous in this store"


def test_a_tls_failure_is_named(
    tls_etcd: TlsEtcd, certificates: Certificates, tmp_path: Path
) -> None:
    client = f"cert={certificates.client_cert},key={certificates.client_key}"
    wrong_ca = run_fails(
        tls_etcd.tls_endpoint, f"ca_cert={certificates.other_ca},{client}", tmp_path
    )
    assert f"TLS with etcd at {tls_etcd.tls_endpoint} failed (CERTIFICATE_VERIFY_FAILED" in wrong_ca
    assert "check --rdzv-conf ca_cert" in wrong_ca
    no_client_cert = run_fails(tls_etcd.tls_endpoint, f"ca_cert={certificates.ca}", tmp_path)
    assert f"TLS with etcd at {tls_etcd.tls_endpoint} failed" in no_client_cert
    plaintext = run_fails(tls_etcd.tls_endpoint, "connect_timeout=1", tmp_path)
    assert "(if etcd serves TLS, give ca_cert)" in plaintext


def test_tls_with_client_certificates_works(tls_etcd: TlsEtcd, certificates: Certificates) -> None:
    conf = (
        f"ca_cert={certificates.ca},cert={certificates.client_cert},key={certificates.client_key}"
    )
    result = status(f"https://{tls_etcd.tls_endpoint}", "--rdzv-conf", conf)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "run job: no rendezvous in this store"

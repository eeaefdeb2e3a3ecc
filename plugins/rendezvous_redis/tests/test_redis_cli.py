"""What a user sees when the Redis is wrong: unreachable, a refused password, a failed TLS
handshake, a server that evicts keys; and the endpoint forms that work (URL, TLS, ACL
user, $REDIS_PASSWORD, Sentinel), through ``rallypoint rendezvous status`` and ``run``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import redis as redis_py
from redis_setups import make_certificates, sentinel_group, start_tls_redis, status

from launch import RALLYPOINT, clean_environment, worker
from servers import free_port, start_redis

NO_ROUND = "run job: no rendezvous in this store"


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line the CLI prints for an error; no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("rallypoint: error: "), result.stderr
    return lines[-1]


def test_an_unreachable_server_is_one_clear_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    result = status("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job")
    assert result.returncode == 1
    line = error_line(result)
    assert f"cannot reach Redis at 127.0.0.1:{port}" in line
    assert "is redis-server running there, without TLS" in line
    # An agent retries for retry_timeout first, saying so, then gives up the same way.
    run = subprocess.run(
        [RALLYPOINT, "run", "--nnodes", "2", "--rdzv-backend", "redis",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
         "--rdzv-conf", "retry_timeout=1,connect_timeout=1", worker("allreduce.py"), "1"],
        env=clean_environment(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "retried for 1 s" in error_line(run)
    assert "retrying for up to 1 s" in run.stderr


def test_a_refused_password_is_one_clear_line(tmp_path: Path) -> None:
    server = start_redis(tmp_path, extra_args=("--requirepass", "s3cret"))
    try:
        endpoint = ["--rdzv-endpoint", f"127.0.0.1:{server.port}", "--rdzv-id", "job"]
        wrong = status(*endpoint, "--rdzv-conf", "password=wrong")
        missing = status(*endpoint)
        from_env = status(*endpoint, env={"REDIS_PASSWORD": "s3cret"})
        in_url = status("--rdzv-endpoint", f"redis://:s3cret@127.0.0.1:{server.port}/0",
                        "--rdzv-id", "job")  # fmt: skip
    finally:
        server.stop()
    for result in (wrong, missing):
        assert result.returncode == 1
        line = error_line(result)
        assert f"Redis at 127.0.0.1:{server.port} refused authentication" in line
        assert "$REDIS_PASSWORD" in line
    assert "WRONGPASS" in wrong.stderr and "NOAUTH" in missing.stderr
    assert "s3cret" not in wrong.stderr + missing.stderr
    assert from_env.returncode == 0 and from_env.stdout.strip() == NO_ROUND, from_env.stderr
    assert in_url.returncode == 0 and in_url.stdout.strip() == NO_ROUND, in_url.stderr


def test_an_acl_user_with_a_password(tmp_path: Path) -> None:
    server = start_redis(tmp_path)
    admin = redis_py.Redis(port=server.port)
    try:
        # Only its prefix's keys and channels, and the commands the store uses.
        admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", "rdzv", "on", ">pw", "~ours/*", "&ours/*", "-@all",
            "+@read", "+@write", "+@scripting", "+@pubsub", "+ping", "+config|get",
        )  # fmt: skip
        endpoint = f"127.0.0.1:{server.port}"
        ok = status("--rdzv-endpoint", endpoint, "--rdzv-id", "job",
                    "--rdzv-conf", "username=rdzv,password=pw,prefix=ours")  # fmt: skip
        outside = status("--rdzv-endpoint", endpoint, "--rdzv-id", "job",
                         "--rdzv-conf", "username=rdzv,password=pw,prefix=theirs")  # fmt: skip
        wrong = status("--rdzv-endpoint", f"redis://rdzv:nope@{endpoint}", "--rdzv-id", "job")
    finally:
        admin.close()
        server.stop()
    assert ok.returncode == 0 and ok.stdout.strip() == NO_ROUND, ok.stderr
    assert "the ACL user may not do this" in error_line(outside)
    assert "refused authentication for user 'rdzv'" in error_line(wrong)


def test_tls(tmp_path: Path) -> None:
    certificates = make_certificates(tmp_path / "certs")
    server, tls_port = start_tls_redis(tmp_path, certificates)
    try:
        url = f"rediss://127.0.0.1:{tls_port}"
        trusted = status("--rdzv-endpoint", url, "--rdzv-id", "job",
                         "--rdzv-conf", f"ssl_ca_certs={certificates.ca}")  # fmt: skip
        by_option = status("--rdzv-endpoint", f"127.0.0.1:{tls_port}", "--rdzv-id", "job",
                           "--rdzv-conf", f"ssl_ca_certs={certificates.ca}")  # fmt: skip
        untrusted = status("--rdzv-endpoint", url, "--rdzv-id", "job",
                           "--rdzv-conf", f"ssl_ca_certs={certificates.other_ca}")  # fmt: skip
        plain_port = status("--rdzv-endpoint", f"rediss://127.0.0.1:{server.port}",
                            "--rdzv-id", "job", "--rdzv-conf", "connect_timeout=1")  # fmt: skip
        not_tls = status("--rdzv-endpoint", f"redis://127.0.0.1:{tls_port}",
                         "--rdzv-id", "job", "--rdzv-conf", "connect_timeout=1")  # fmt: skip
    finally:
        server.stop()
    assert trusted.returncode == 0 and trusted.stdout.strip() == NO_ROUND, trusted.stderr
    assert by_option.returncode == 0 and by_option.stdout.strip() == NO_ROUND, by_option.stderr
    line = error_line(untrusted)
    assert f"TLS with Redis at 127.0.0.1:{tls_port} failed" in line
    assert "CERTIFICATE_VERIFY_FAILED" in line
    # A TLS client at a plain port, and a plain client at a TLS port: the hint says which.
    assert "with TLS on that port" in error_line(plain_port)
    assert "without TLS (else: rediss://)" in error_line(not_tls)


def test_a_server_that_evicts_keys_is_warned_about(tmp_path: Path) -> None:
    server = start_redis(tmp_path, extra_args=("--maxmemory-policy", "allkeys-lru"))
    try:
        result = status("--rdzv-endpoint", f"127.0.0.1:{server.port}", "--rdzv-id", "job")
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "maxmemory-policy" in line]
    assert len(warnings) == 1, result.stderr
    assert "allkeys-lru" in warnings[0] and "noeviction" in warnings[0]


@pytest.mark.parametrize(
    ("endpoint", "conf", "message"),
    [
        ("memcached://127.0.0.1:1", "", "unsupported scheme 'memcached'"),
        ("sentinel://127.0.0.1:26379", "", "sentinel_master=NAME"),
        ("redis://127.0.0.1:1/zero", "", "the path must be a database number"),
        ("redis://127.0.0.1:1/0?db=1", "", "give settings with --rdzv-conf"),
        (
            "127.0.0.1:1",
            "ssl_ca_certs=/no/such/ca.crt",
            "ssl_ca_certs=/no/such/ca.crt: no such file",
        ),
    ],
)
def test_a_malformed_endpoint_is_a_usage_error(endpoint: str, conf: str, message: str) -> None:
    result = status("--rdzv-endpoint", endpoint, "--rdzv-id", "job", "--rdzv-conf", conf)
    assert result.returncode == 2, result.stderr
    assert message in error_line(result)


def test_a_key_ttl_shorter_than_two_refreshes_is_refused() -> None:
    run = subprocess.run(
        [RALLYPOINT, "run", "--nnodes", "2", "--rdzv-backend", "redis",
         "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "job",
         "--rdzv-conf", "heartbeat_timeout=30,key_ttl=10", worker("allreduce.py"), "1"],
        env=clean_environment(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "key_ttl=10 is shorter than two key refreshes" in error_line(run)


def test_status_through_sentinel(tmp_path: Path) -> None:
    with sentinel_group(tmp_path, sentinels=1) as group:
        # quorum 2 with one sentinel never fails over, but it names the master
        result = status("--rdzv-endpoint", group.endpoint, "--rdzv-id", "job",
                        "--rdzv-conf", f"sentinel_master={group.name}")  # fmt: skip
        unknown = status("--rdzv-endpoint", group.endpoint, "--rdzv-id", "job",
                         "--rdzv-conf", "sentinel_master=nobody")  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == NO_ROUND, result.stderr
    assert "Redis master 'nobody'" in error_line(unknown)

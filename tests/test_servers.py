"""Tests for the real-server harness in ``servers.py``.

Every other integration test trusts these fixtures, so this proves each one
yields a server that a real client can use, and that stopping it leaves
nothing running.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import socket
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

import servers
from servers import (
    EtcdServer,
    PrometheusServer,
    RedisServer,
    ServerExitedError,
    ServerProcess,
    ServerStartError,
    find_binary,
    free_port,
    process_alive,
    require_binary,
    start_etcd,
    start_prometheus,
    start_redis,
    wait_until,
)

# Loopback only: a configured HTTP proxy must not intercept these requests.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))

STARTERS: dict[str, Callable[[Path], ServerProcess]] = {
    "etcd": start_etcd,
    "redis": start_redis,
    "prometheus": start_prometheus,
}


def _import_client(module: str, pip_name: str) -> ModuleType:
    """Import a client library, skipping locally / failing in CI if broken."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        message = f"cannot import {module} ({exc}); pip install {pip_name}"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


def _http_json(url: str, payload: dict[str, Any] | None = None) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    with _HTTP.open(url, data=data, timeout=5) as response:
        return json.load(response)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# ------------------------------------------------------------------ etcd


def test_etcd_put_get_with_pyetcd(etcd_server: EtcdServer) -> None:
    pyetcd = _import_client("pyetcd", "etcd-sdk-python protobuf")
    client = pyetcd.client(host="127.0.0.1", port=etcd_server.client_port, timeout=5)
    try:
        client.put("/rallypoint/test", "hello")
        value, meta = client.get("/rallypoint/test")
        assert value == b"hello"
        assert meta.version == 1
        assert client.get("/rallypoint/missing") == (None, None)
    finally:
        client.close()


def test_etcd_put_get_via_json_gateway(etcd_server: EtcdServer) -> None:
    _http_json(f"{etcd_server.url}/v3/kv/put", {"key": _b64("k"), "value": _b64("v")})
    reply = _http_json(f"{etcd_server.url}/v3/kv/range", {"key": _b64("k")})
    assert [base64.b64decode(kv["value"]) for kv in reply["kvs"]] == [b"v"]


def test_etcd_endpoint_shape(etcd_server: EtcdServer) -> None:
    assert etcd_server.endpoint == f"127.0.0.1:{etcd_server.client_port}"
    assert etcd_server.client_port != etcd_server.peer_port
    assert etcd_server.is_running()


# ----------------------------------------------------------------- redis


def test_redis_set_get(redis_server: RedisServer) -> None:
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    try:
        assert client.set("rallypoint:test", "hello")
        assert client.get("rallypoint:test") == b"hello"
    finally:
        client.close()


def test_redis_extra_args_override_defaults(tmp_path: Path) -> None:
    # With a password Redis answers PING with -NOAUTH; that must count as up.
    with start_redis(tmp_path, extra_args=("--requirepass", "s3cret")) as server:
        assert "--requirepass" in server.argv
        client = redis.Redis(port=server.port, password="s3cret", socket_timeout=5)
        try:
            assert client.ping()
        finally:
            client.close()


# ------------------------------------------------------------ prometheus


def test_prometheus_api_answers(prometheus_server: PrometheusServer) -> None:
    info = _http_json(f"{prometheus_server.url}/api/v1/status/buildinfo")
    assert info["status"] == "success"
    assert info["data"]["version"].startswith("2.")
    # vector(1) needs no scraped data, so this checks query() without waiting
    # for the first scrape (Prometheus only starts scraping after ~5 s).
    assert [r["value"][1] for r in prometheus_server.query("vector(1)")] == ["1"]
    with pytest.raises(RuntimeError, match="failed"):
        prometheus_server.query("this is not promql(")


def test_prometheus_config_lists_targets(tmp_path: Path) -> None:
    with start_prometheus(tmp_path, scrape_targets=["127.0.0.1:9"]) as server:
        assert isinstance(server, PrometheusServer)
        config = json.loads(server.config_path.read_text())
        jobs = {job["job_name"]: job for job in config["scrape_configs"]}
        assert jobs["rallypoint"]["static_configs"] == [{"targets": ["127.0.0.1:9"]}]


# -------------------------------------------------------------- lifecycle


@pytest.mark.parametrize("kind", sorted(STARTERS))
def test_stop_leaves_no_process(kind: str, tmp_path: Path) -> None:
    server = STARTERS[kind](tmp_path)
    pid = server.pid
    assert process_alive(pid)
    server.stop()
    assert not server.is_running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    server.stop()  # idempotent


def test_stop_escalates_to_sigkill_for_the_whole_group(tmp_path: Path) -> None:
    # The shell and its child ignore SIGTERM, so only the SIGKILL to the
    # process group can end the child that the shell forked.
    script = "trap '' TERM; sleep 60 & echo $! > child.pid; wait"
    proc = servers._spawn(ServerProcess, "sh", "/bin/sh", ["/bin/sh", "-c", script], tmp_path, {})
    child_pid_file = tmp_path / "child.pid"
    assert wait_until(
        lambda: child_pid_file.exists() and child_pid_file.read_text().endswith("\n"), 5
    )
    child = int(child_pid_file.read_text())
    proc.stop(timeout=0.2)
    assert proc.process.returncode == -9
    assert wait_until(lambda: not process_alive(child), 5)


@pytest.mark.parametrize("kind", sorted(STARTERS))
def test_start_retries_when_port_is_taken(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Bound but not listening: the server's bind fails, yet our readiness
    # probes get "connection refused" at once instead of a silent listener.
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        taken = blocker.getsockname()[1]
        ports = iter([taken])
        monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or free_port())
        with STARTERS[kind](tmp_path) as server:
            assert taken not in server.ports.values()
            assert server.is_running()


def test_start_failure_reports_log_tail(tmp_path: Path) -> None:
    with pytest.raises(ServerExitedError, match="no-such-directive"):
        start_redis(tmp_path, extra_args=("--no-such-directive", "1"))


def test_readiness_timeout_stops_server_and_raises(tmp_path: Path) -> None:
    proc = servers._spawn(
        ServerProcess, "sleeper", "/bin/sh", ["/bin/sh", "-c", "echo hi; exec sleep 60"],
        tmp_path, {},
    )  # fmt: skip
    with pytest.raises(ServerStartError, match=r"not ready after 0\.5s(.|\n)*hi"):
        servers._wait_ready(proc, lambda: False, 0.5)
    assert not proc.is_running()


# ---------------------------------------------------------------- helpers


def test_free_port_is_bindable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))


def test_find_binary() -> None:
    assert find_binary("sh") is not None
    assert find_binary("rallypoint-no-such-binary") is None


def test_require_binary_returns_path_when_present() -> None:
    assert require_binary("sh", "dash") == find_binary("sh")


def test_require_binary_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="apt-get install rp-pkg"):
        require_binary("rallypoint-no-such-binary", "rp-pkg")


@pytest.mark.parametrize("ci", [None, ""])
def test_require_binary_skips_outside_ci(ci: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="make test"):
        require_binary("rallypoint-no-such-binary", "rp-pkg")


@pytest.fixture(autouse=True)
def _no_leaked_servers() -> Iterator[None]:
    """Every server a test starts must be stopped by the time it ends."""
    before = set(servers._LIVE)
    yield
    leaked = set(servers._LIVE) - before
    for pid in leaked:
        servers._LIVE[pid].stop()
    assert not leaked, f"servers left running: {leaked}"

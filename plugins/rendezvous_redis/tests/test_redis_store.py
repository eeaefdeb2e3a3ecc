"""The Redis store against the store conformance suite, on a real redis-server."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from rallypoint.sdk import RendezvousRequest, StoreUnavailable
from rallypoint.testing.store_conformance import Connect, Outage, StoreConformance
from rallypoint_redis import OPTIONS
from rallypoint_redis.store import connect_store
from servers import RedisServer, start_redis


def request_for(endpoint: str, **conf: object) -> RendezvousRequest:
    options = {option.name: option.default for option in OPTIONS}
    return RendezvousRequest("job", endpoint, {**options, **conf})


def pause(server: RedisServer, seconds: float) -> None:
    """Make ``server`` unreachable for ``seconds``, keeping its data (SIGSTOP, SIGCONT)."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)  # the outage itself: how long the server is gone
    finally:
        os.kill(server.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


class TestRedisStore(StoreConformance):
    @pytest.fixture
    def connect(self, redis: RedisServer) -> Connect:
        request = request_for(f"127.0.0.1:{redis.port}", connect_timeout=1.0)
        return lambda: connect_store(request)

    # autouse: the suite looks for `outage` in request.fixturenames, which lists only the
    # fixtures a test uses, so a plain fixture would be missed and the outage test skipped.
    @pytest.fixture(autouse=True)
    def outage(self, redis: RedisServer) -> Outage:
        return lambda seconds: pause(redis, seconds)


def test_scripts_run_on_a_server_that_forgot_them(redis: RedisServer) -> None:
    """A restarted server or a failed-over replica has no cached scripts: EVALSHA answers
    NOSCRIPT and the store runs the script's text instead."""
    store = connect_store(request_for(f"127.0.0.1:{redis.port}"))
    try:
        key = f"/scripts/{time.monotonic_ns()}"
        assert store.add(key, 1) == 1
        store._command("SCRIPT", "FLUSH")
        assert store.add(key, 1) == 2
        assert store.compare_set(key + "/cas", None, b"x") == b"x"
        store.set(key + "/set", b"v")
        assert store.get(key + "/set") == b"v"
    finally:
        store.close()


def test_a_command_connection_that_broke_is_opened_again(redis: RedisServer) -> None:
    """The server closed the store's connection (a restart, a timeout, CLIENT KILL): that
    command is StoreUnavailable, which the protocol retries, and the next one reconnects."""
    store = connect_store(request_for(f"127.0.0.1:{redis.port}"))
    other = connect_store(request_for(f"127.0.0.1:{redis.port}"))
    try:
        key = f"/reconnect/{time.monotonic_ns()}"
        store.set(key, b"before")
        other._command("CLIENT", "KILL", "ID", store._command("CLIENT", "ID"))
        with pytest.raises(StoreUnavailable):
            store.get(key)
        assert store.get(key) == b"before"
    finally:
        store.close()
        other.close()

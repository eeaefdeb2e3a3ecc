"""The Redis store against the store conformance suite, on a real redis-server."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from rallypoint.extensions import RendezvousRequest
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

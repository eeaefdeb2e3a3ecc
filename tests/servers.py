"""Start real etcd, Redis and Prometheus servers for tests.

Rallypoint talks to these services over the network, so the tests that matter
run against the genuine binaries instead of fakes: fakes would agree with our
own misunderstanding of the protocols.  This module launches each server on
free loopback ports inside a temporary directory, waits (bounded) until it
actually answers, and tears it down without leaving processes behind.

Import the fixtures from ``conftest.py``::

    from servers import etcd_server, redis_server, prometheus_server  # noqa: F401
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

__all__ = [
    "DEFAULT_READY_TIMEOUT",
    "EtcdServer",
    "PrometheusServer",
    "RedisServer",
    "ServerExitedError",
    "ServerProcess",
    "ServerStartError",
    "etcd_server",
    "etcd_server_session",
    "find_binary",
    "free_port",
    "process_alive",
    "prometheus_server",
    "prometheus_server_session",
    "redis_server",
    "redis_server_session",
    "require_binary",
    "restart_redis",
    "spawn_etcd",
    "spawn_redis",
    "start_etcd",
    "start_prometheus",
    "start_redis",
    "wait_etcd_ready",
    "wait_redis_ready",
    "wait_until",
]

#: Upper bound on how long a server may take to become ready.  Generous
#: because CI machines can be slow, but finite so a broken server fails the
#: test instead of hanging the run.
DEFAULT_READY_TIMEOUT = 30.0

#: Attempts to start a server (the first plus up to 3 retries) when it dies
#: before becoming ready.  The usual cause is losing the race between
#: :func:`free_port` releasing a port and the server binding it; a fresh set of
#: ports almost always fixes that.
START_ATTEMPTS = 4

#: Readiness polling backoff: start fast so the common case costs little,
#: and cap it so we notice readiness promptly even after a slow start.
_BACKOFF_START = 0.01
_BACKOFF_CAP = 0.2

#: How long ``stop()`` waits after SIGTERM before escalating to SIGKILL.
_STOP_GRACE = 10.0
#: How long to wait for the kernel to reap a SIGKILLed process.
_KILL_WAIT = 5.0

_LOG_TAIL_LINES = 40

_DEBIAN_PACKAGES = {
    "etcd": "etcd-server",
    "redis-server": "redis-server",
    "prometheus": "prometheus",
}

# urllib honours http_proxy/HTTP_PROXY; a proxy can never reach our loopback
# servers, so talk to them directly whatever the environment says.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))

_T = TypeVar("_T")
_S = TypeVar("_S", bound="ServerProcess")


class ServerStartError(RuntimeError):
    """A server did not become ready; the message carries its log tail."""


class ServerExitedError(ServerStartError):
    """A server process exited before it became ready (often a port race)."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    The kernel picks the port, so parallel test runs don't collide.  There is
    an unavoidable window between closing our socket and the server binding
    the port; the ``start_*`` functions retry with new ports when they lose.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_ports(count: int) -> list[int]:
    """``count`` different ports, each free a moment ago: once its probe socket is closed,
    ``free_port`` may hand the same port out again at once (an etcd given one port for
    its client and its peer URLs fails to start)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def find_binary(name: str) -> str | None:
    """Return the path of executable ``name``, or None if it isn't installed.

    Looks on PATH first, then in /usr/bin and /usr/sbin, because Debian
    packages install servers there and CI or sudo may run with a minimal PATH.
    """
    found = shutil.which(name)
    if found is not None:
        return found
    for directory in ("/usr/bin", "/usr/sbin"):
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def require_binary(name: str, debian_package: str) -> str:
    """Return the path of ``name``, or end the test if it is missing.

    Locally a missing server only skips the test, so a developer without
    e.g. Prometheus can still run everything else.  In CI (``CI`` set and
    non-empty) a missing server is a broken environment, and silently skipping
    would let the real-server tests rot, so it fails instead.
    """
    path = find_binary(name)
    if path is not None:
        return path
    message = (
        f"{name} not found on PATH or in /usr/bin, /usr/sbin: "
        f"apt-get install {debian_package}, "
        "or run `make test`, which installs it"
    )
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


# Servers that are running, so an interpreter exiting without fixture
# teardown (e.g. Ctrl-C at a bad moment) still doesn't leak daemons.
_LIVE: dict[int, ServerProcess] = {}


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE.values()):
        server.stop()


@dataclass
class ServerProcess:
    """A server started from its binary, in its own process group.

    Its own session (``start_new_session=True``) means pytest's Ctrl-C isn't
    delivered to it mid-test, and ``stop()`` can kill it together with any
    helpers it forked, using the process group.
    """

    name: str
    binary: str
    argv: list[str]
    data_dir: Path
    ports: dict[str, int]
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)
    _stopped: bool = field(default=False, init=False, repr=False)

    @property
    def pid(self) -> int:
        """Process id of the server (also its process group id)."""
        return self.process.pid

    def is_running(self) -> bool:
        """Whether the server process has not exited."""
        return self.process.poll() is None

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """Return the last ``lines`` lines of the server's log, for errors."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<cannot read {self.log_path}: {exc}>"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = _STOP_GRACE) -> None:
        """Stop the server and everything in its process group.

        SIGTERM first so the server can shut down cleanly, SIGKILL if it
        hasn't exited within ``timeout`` seconds.  The group is signalled
        while the leader is still unreaped, so the group id cannot have been
        recycled.  Safe to call more than once.
        """
        if self._stopped:
            return
        self._stopped = True
        _LIVE.pop(self.pid, None)
        pgid = self.pid  # start_new_session makes the server a group leader
        if self.process.poll() is None:
            _killpg(pgid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _killpg(pgid, signal.SIGKILL)
                self.process.wait(timeout=_KILL_WAIT)
        # Children that ignored SIGTERM or outlived the leader.
        _killpg(pgid, signal.SIGKILL)

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@dataclass
class EtcdServer(ServerProcess):
    """A single-member etcd cluster."""

    @property
    def client_port(self) -> int:
        """Port of the client (gRPC and HTTP gateway) listener."""
        return self.ports["client"]

    @property
    def peer_port(self) -> int:
        """Port of the raft peer listener."""
        return self.ports["peer"]

    @property
    def endpoint(self) -> str:
        """``host:port`` form that etcd clients and rendezvous configs take."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """Client URL, for the HTTP/JSON gateway and ``/health``."""
        return f"http://{self.endpoint}"


@dataclass
class RedisServer(ServerProcess):
    """A standalone Redis server."""

    host: str = "127.0.0.1"

    @property
    def port(self) -> int:
        """TCP port Redis listens on."""
        return self.ports["redis"]

    @property
    def url(self) -> str:
        """``redis://`` URL for database 0, as redis-py's from_url takes."""
        return f"redis://{self.host}:{self.port}/0"


@dataclass
class PrometheusServer(ServerProcess):
    """A Prometheus server scraping the given targets every second."""

    config_path: Path = field(default=Path())

    @property
    def port(self) -> int:
        """Port of the web UI and HTTP API."""
        return self.ports["web"]

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://127.0.0.1:{self.port}"

    def query(self, expr: str, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Run an instant PromQL query and return ``data.result``.

        Raises RuntimeError if Prometheus reports an error, so a typo in a
        query fails loudly instead of looking like "no data".
        """
        params = urllib.parse.urlencode({"query": expr})
        url = f"{self.url}/api/v1/query?{params}"
        try:
            with _HTTP.open(url, timeout=timeout) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:  # 400/422 carry a JSON error
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for_query(
        self,
        expr: str,
        predicate: Callable[[list[dict[str, Any]]], bool] = bool,
        timeout: float = 15.0,
    ) -> list[dict[str, Any]]:
        """Poll ``expr`` until ``predicate(result)`` holds; bounded.

        Scrapes happen asynchronously (every second here), so tests asserting
        on scraped data need to wait for a scrape rather than sleep.
        """
        last: list[dict[str, Any]] = []

        def probe() -> bool:
            nonlocal last
            last = self.query(expr)
            return predicate(last)

        if not wait_until(probe, timeout):
            raise TimeoutError(f"{expr!r} did not match within {timeout}s; last={last}")
        return last


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    """The next ``size`` bytes of ``sock``; ConnectionError if it closes first."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie awaiting its reaper counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # reaped between the two (ESRCH)
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(probe: Callable[[], bool], timeout: float) -> bool:
    """Call ``probe`` with backoff until it returns true; False on timeout.

    Tests should wait for a condition this way instead of sleeping a fixed
    time: it returns as soon as the condition holds (first retry after 10 ms,
    doubling up to 200 ms) and still gives up after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    delay = _BACKOFF_START
    while True:
        if probe():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, _BACKOFF_CAP)


def _spawn(
    cls: type[_S],
    name: str,
    binary: str,
    argv: list[str],
    data_dir: Path,
    ports: dict[str, int],
    *,
    env: dict[str, str] | None = None,
    **extra: Any,
) -> _S:
    """Start ``argv`` in a new session with output going to a log file.

    The log is appended to, so a server started again on its directory keeps the log of
    its first life.
    """
    log_path = data_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=data_dir,
            env=env,
            start_new_session=True,
        )
    server = cls(
        name=name,
        binary=binary,
        argv=argv,
        data_dir=data_dir,
        ports=ports,
        log_path=log_path,
        process=process,
        **extra,
    )
    _LIVE[server.pid] = server
    return server


def _wait_ready(server: ServerProcess, probe: Callable[[], bool], timeout: float) -> None:
    """Block until ``probe()`` succeeds, or stop the server and raise.

    Checks the process is alive both before and after each probe: a server
    that lost the port race may exit right after another process on that port
    answered our probe, and that must not count as ready.
    """

    def ready() -> bool:
        if not server.is_running():
            raise ServerExitedError(_describe(server, "exited before becoming ready"))
        return probe() and server.is_running()

    try:
        ok = wait_until(ready, timeout)
    except BaseException:
        server.stop()
        raise
    if not ok:
        message = _describe(server, f"not ready after {timeout}s")
        server.stop()
        raise ServerStartError(message)


def _describe(server: ServerProcess, what: str) -> str:
    return (
        f"{server.name} (pid {server.pid}, exit code {server.process.poll()}) {what}\n"
        f"command: {' '.join(server.argv)}\n"
        f"log {server.log_path}, last lines:\n{server.log_tail()}"
    )


def _start_with_retries(attempt: Callable[[], _T]) -> _T:
    """Run ``attempt`` up to START_ATTEMPTS times while servers die early."""
    for remaining in range(START_ATTEMPTS - 1, -1, -1):
        try:
            return attempt()
        except ServerExitedError:
            if remaining == 0:
                raise
    raise AssertionError("unreachable")


def _fresh_dir(tmp_dir: Path | str, prefix: str) -> Path:
    """A new directory under ``tmp_dir``, so several servers can share it."""
    Path(tmp_dir).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=tmp_dir))


def _http_ok(url: str, check: Callable[[bytes], bool] = lambda _: True) -> bool:
    try:
        with _HTTP.open(url, timeout=1.0) as response:
            return response.status == 200 and check(response.read())
    # Refused, reset, 503 (HTTPError), a non-HTTP listener, a bad body.
    except (OSError, http.client.HTTPException, ValueError):
        return False


# --------------------------------------------------------------------- etcd


def start_etcd(
    tmp_dir: Path | str,
    *,
    extra_args: Sequence[str] = (),
    timeout: float = DEFAULT_READY_TIMEOUT,
) -> EtcdServer:
    """Start a one-member etcd cluster and wait until ``/health`` is true.

    ``/health`` only turns true once the member has elected itself leader,
    so the server accepts writes as soon as this returns.
    """

    def attempt() -> EtcdServer:
        data_dir = _fresh_dir(tmp_dir, "etcd-")
        client, peer = free_ports(2)
        server = spawn_etcd(data_dir, client_port=client, peer_port=peer, extra_args=extra_args)
        wait_etcd_ready(server, timeout)
        return server

    return _start_with_retries(attempt)


def spawn_etcd(
    data_dir: Path,
    *,
    client_port: int,
    peer_port: int,
    name: str = "default",
    cluster: str | None = None,
    state: str = "new",
    token: str | None = None,
    extra_urls: Sequence[str] = (),
    extra_args: Sequence[str] = (),
) -> EtcdServer:
    """Start one etcd member on ``data_dir`` without waiting for it (see wait_etcd_ready).

    The members of a cluster become healthy only together, and one started again on its
    ``data_dir`` (``state="existing"``) keeps its data. ``cluster`` defaults to this member
    alone; ``extra_urls`` are more client listeners (``https://...``).
    """
    binary = require_binary("etcd", _DEBIAN_PACKAGES["etcd"])
    data_dir.mkdir(parents=True, exist_ok=True)
    client_url = f"http://127.0.0.1:{client_port}"
    peer_url = f"http://127.0.0.1:{peer_port}"
    argv = [
        binary,
        "--name", name,
        "--data-dir", str(data_dir / "data"),
        "--listen-client-urls", ",".join([client_url, *extra_urls]),
        "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url,
        "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", cluster or f"{name}={peer_url}",
        "--initial-cluster-state", state,
        # Unique token: a stray member from another test can't join us.
        "--initial-cluster-token", token or f"rallypoint-test-{data_dir}",
        "--logger", "zap",
        "--log-outputs", "stderr",
        "--log-level", "warn",
        *extra_args,
    ]  # fmt: skip
    # ETCD_* variables from the environment would be merged with our flags
    # (and etcd refuses to start when both name the same setting).
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    ports = {"client": client_port, "peer": peer_port}
    return _spawn(EtcdServer, "etcd", binary, argv, data_dir, ports, env=env)


def wait_etcd_ready(server: EtcdServer, timeout: float = DEFAULT_READY_TIMEOUT) -> None:
    """Until ``server``'s ``/health`` is true (its cluster has a leader); else stop it, raise."""
    _wait_ready(server, lambda: _http_ok(f"{server.url}/health", _etcd_healthy), timeout)


def _etcd_healthy(body: bytes) -> bool:
    health: object = json.loads(body).get("health")
    return health == "true"


# -------------------------------------------------------------------- redis


def start_redis(
    tmp_dir: Path | str,
    *,
    extra_args: Sequence[str] = (),
    timeout: float = DEFAULT_READY_TIMEOUT,
) -> RedisServer:
    """Start redis-server without persistence and wait until it answers PING.

    ``extra_args`` come last, so they override the defaults, e.g.
    ``("--appendonly", "yes")`` or ``("--requirepass", "secret")``.
    """
    binary = require_binary("redis-server", _DEBIAN_PACKAGES["redis-server"])

    def attempt() -> RedisServer:
        data_dir = _fresh_dir(tmp_dir, "redis-")
        port = free_port()
        argv = [
            binary,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(data_dir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            *extra_args,
        ]  # fmt: skip
        server = spawn_redis(argv, data_dir, port)
        wait_redis_ready(server, timeout)
        return server

    return _start_with_retries(attempt)


def spawn_redis(argv: list[str], data_dir: Path, port: int, name: str = "redis") -> RedisServer:
    """Start a redis-server (or a sentinel: ``redis-server FILE --sentinel``) from ``argv``,
    listening on ``port``, without waiting for it (see wait_redis_ready)."""
    return _spawn(RedisServer, name, argv[0], argv, data_dir, {"redis": port})


def wait_redis_ready(server: RedisServer, timeout: float = DEFAULT_READY_TIMEOUT) -> None:
    """Until ``server`` answers PING; else stop it and raise."""
    _wait_ready(server, lambda: _redis_answers(server.host, server.port), timeout)


def restart_redis(server: RedisServer, timeout: float = DEFAULT_READY_TIMEOUT) -> RedisServer:
    """Stop ``server`` and start it again on its port and directory (with its data)."""
    server.stop()
    again = spawn_redis(server.argv, server.data_dir, server.port, server.name)
    wait_redis_ready(again, timeout)
    return again


def _redis_answers(host: str, port: int) -> bool:
    """Send a RESP PING on a raw socket; true once Redis serves commands.

    ``-NOAUTH`` also counts: with ``--requirepass`` Redis refuses PING from
    unauthenticated clients, but it is up.  ``-LOADING`` (replaying a dump
    or AOF at startup) does not.
    """
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = sock.recv(256)
    except OSError:
        return False
    return reply.startswith((b"+PONG", b"-NOAUTH"))


# --------------------------------------------------------------- prometheus


def start_prometheus(
    tmp_dir: Path | str,
    *,
    scrape_targets: Sequence[str] = (),
    extra_args: Sequence[str] = (),
    timeout: float = DEFAULT_READY_TIMEOUT,
) -> PrometheusServer:
    """Start Prometheus scraping ``scrape_targets`` and wait for ``/-/ready``.

    Targets (``"127.0.0.1:PORT"``) are scraped every second under job
    ``rallypoint``; Prometheus also scrapes itself under job ``prometheus`` so
    there is always some data to query.  ``--web.enable-lifecycle`` lets a
    test reload a rewritten config with ``POST /-/reload``.
    """
    binary = require_binary("prometheus", _DEBIAN_PACKAGES["prometheus"])

    def attempt() -> PrometheusServer:
        data_dir = _fresh_dir(tmp_dir, "prometheus-")
        port = free_port()
        config_path = data_dir / "prometheus.yml"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": "prometheus",
                    "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
                },
                {
                    "job_name": "rallypoint",
                    "static_configs": [{"targets": list(scrape_targets)}],
                },
            ],
        }
        # JSON is valid YAML, and needs no YAML library.
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        argv = [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={data_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
            *extra_args,
        ]
        server = _spawn(
            PrometheusServer, "prometheus", binary, argv, data_dir,
            {"web": port}, config_path=config_path,
        )  # fmt: skip
        _wait_ready(server, lambda: _http_ok(f"http://127.0.0.1:{port}/-/ready"), timeout)
        return server

    return _start_with_retries(attempt)


# ----------------------------------------------------------------- fixtures


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd for one test (empty keyspace)."""
    server = start_etcd(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def etcd_server_session(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EtcdServer]:
    """One etcd shared by the session; tests must use unique key prefixes."""
    server = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh Redis for one test (empty database)."""
    server = start_redis(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server_session(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisServer]:
    """One Redis shared by the session; tests must use unique key prefixes."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[PrometheusServer]:
    """A fresh Prometheus for one test, scraping only itself."""
    server = start_prometheus(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def prometheus_server_session(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PrometheusServer]:
    """One Prometheus shared by the session, scraping only itself."""
    server = start_prometheus(tmp_path_factory.mktemp("prometheus"))
    yield server
    server.stop()

"""One rendezvous backend for a fault test: its store, the agents that use it, and what it
keeps. Liveness settings are short (3 s) so that every fault plays out in seconds."""

from __future__ import annotations

import atexit
import contextlib
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import launch
from launch import wait_for_port
from servers import (
    EtcdServer,
    RedisServer,
    ServerProcess,
    free_port,
    spawn_etcd,
    spawn_redis,
    start_etcd,
    start_redis,
    wait_etcd_ready,
    wait_redis_ready,
)

#: ``--rdzv-conf`` of every backend: liveness lapses 3 s after a node's last sign of life.
COMMON_CONF = "heartbeat_timeout=3,last_call_timeout=1,join_timeout=60"
CONF = {
    "c10d": COMMON_CONF,
    "etcd": COMMON_CONF + ",lease_ttl=3,connect_timeout=5",
    "redis": COMMON_CONF + ",key_ttl=3,retry_timeout=30",
}


def _token_file() -> Path:
    """A job token for every job of the fault suite: its jobs run as a job on a shared
    network should, their rendezvous records sealed (``rendezvous.signing``)."""
    folder = Path(tempfile.mkdtemp(prefix="rallypoint-faults-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "job.token"
    path.write_text(secrets.token_hex(16))
    path.chmod(0o600)
    return path


TOKEN_FILE = _token_file()

#: Every backend, in the order of docs/reliability.md's columns.
BACKENDS = ("c10d", "etcd", "redis")


def on_backends(*quick: str) -> pytest.MarkDecorator:
    """Run a fault test on every backend: ``make test`` on the ``quick`` ones, ``make
    soak`` (and the reliability page) on the others too. The suite runs on two CPU cores,
    mostly starting torch: a fault whose handling does not depend on the backend runs on
    one of them by default."""
    cases = [
        pytest.param(name, marks=() if name in quick else (pytest.mark.soak,), id=name)
        for name in BACKENDS
    ]
    return pytest.mark.parametrize("backend", cases, indirect=True)


@dataclass
class Backend:
    """``name`` at ``endpoint``; ``server`` is the store's process (None for c10d, whose
    store the first agent hosts)."""

    name: str
    endpoint: str
    server: ServerProcess | None

    @property
    def conf(self) -> str:
        return f"{CONF[self.name]},token_file={TOKEN_FILE}"

    @property
    def store_port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def start_agent(
        self,
        run_id: str,
        nnodes: str,
        *args: str,
        log: Path,
        nproc: int = 2,
        endpoint: str | None = None,
        max_restarts: int | None = 3,
        conf: str = "",
    ) -> subprocess.Popen[str]:
        """``rallypoint run`` of one node, writing its events to ``log`` with ``.jsonl``;
        ``args`` are more options, then the script. ``endpoint`` overrides the store's (a
        proxy in front of it); ``max_restarts=None`` leaves the flag at its default; ``conf``:
        more ``--rdzv-conf`` keys. A c10d
        job's first agent hosts the store: this returns once it listens."""
        hosting = self.name == "c10d" and not _listening(self.store_port)
        restarts = () if max_restarts is None else ("--max-restarts", str(max_restarts))
        agent = launch.start_rallypoint(
            "run", "--nnodes", nnodes, "--nproc-per-node", str(nproc), *restarts,
            "--rdzv-backend", self.name, "--rdzv-endpoint", endpoint or self.endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", ",".join(filter(None, (self.conf, conf))),
            "--event-log", str(log.with_suffix(".jsonl")), *args, log=log,
        )  # fmt: skip
        if hosting:
            wait_for_port(self.store_port)
        return agent

    def keys(self, run_id: str) -> list[str]:
        """The keys of ``run_id`` still in the store (c10d's store went with its host), under
        each backend's default prefix (etcd ``/rallypoint``, Redis ``rallypoint``), of every
        generation of the run (``<run id>/...``, ``<run id>~...``)."""
        if isinstance(self.server, EtcdServer):
            import pyetcd

            prefix = f"/rallypoint/{run_id}"
            client = pyetcd.client("127.0.0.1", self.server.client_port, timeout=10)
            try:
                found = [meta.key.decode() for _, meta in client.get_prefix(prefix)]
            finally:
                client.close()
        elif isinstance(self.server, RedisServer):
            import redis

            prefix = f"rallypoint/{run_id}"
            with redis.Redis(port=self.server.port, socket_timeout=10) as client:
                found = [key.decode() for key in client.keys(prefix + "*")]
        else:
            return []
        return [key for key in found if key[len(prefix) : len(prefix) + 1] in ("/", "~")]

    def freeze(self) -> None:
        """SIGSTOP the store's server: connections stay open, nothing answers."""
        assert self.server is not None
        self.server.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.server is not None
        self.server.process.send_signal(signal.SIGCONT)

    def kill_store(self) -> None:
        """SIGKILL the store's server (what it persisted stays: etcd's data dir, Redis's
        append-only file)."""
        assert self.server is not None
        self.server.process.kill()
        self.server.process.wait(timeout=10)
        self.server.stop()  # already dead: only forgets it

    def start_store(self) -> None:
        """Start the killed server again on its port and data, and wait until it answers."""
        old = self.server
        if isinstance(old, EtcdServer):
            self.server = spawn_etcd(
                old.data_dir,
                client_port=old.client_port,
                peer_port=old.peer_port,
                state="existing",
            )
            wait_etcd_ready(self.server)
        elif isinstance(old, RedisServer):
            self.server = spawn_redis(old.argv, old.data_dir, old.port, old.name)
            wait_redis_ready(self.server)
        else:
            raise AssertionError(f"{self.name}: no server of its own to start")


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def c10d_backend(tmp_path: Path) -> Iterator[Backend]:
    yield Backend("c10d", f"127.0.0.1:{free_port()}", None)


@contextlib.contextmanager
def etcd_backend(tmp_path: Path) -> Iterator[Backend]:
    server = start_etcd(tmp_path / "etcd")
    backend = Backend("etcd", server.endpoint, server)
    try:
        yield backend
    finally:
        _stop(backend)


@contextlib.contextmanager
def redis_backend(tmp_path: Path) -> Iterator[Backend]:
    server = start_redis(tmp_path / "redis", extra_args=("--appendonly", "yes"))
    backend = Backend("redis", f"127.0.0.1:{server.port}", server)
    try:
        yield backend
    finally:
        _stop(backend)


def _stop(backend: Backend) -> None:
    """Stop the backend's server (the one running now, if a test started it again)."""
    server = backend.server
    assert server is not None
    with contextlib.suppress(Exception):
        server.process.send_signal(signal.SIGCONT)
    server.stop()


@dataclass
class Recovery:
    """What a fault test measured: ``seconds`` from the fault to the job working again
    (training, or the right error), and anything worth a note in the table."""

    seconds: float | None = None
    notes: list[str] = field(default_factory=list)

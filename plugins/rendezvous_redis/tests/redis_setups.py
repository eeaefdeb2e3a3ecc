"""Redis deployments for the redis backend's tests, built on tests/servers.py (which also
restarts a server on its port with its data): TLS with certificates made by the openssl CLI,
and a Sentinel group on loopback. Real binaries, free loopback ports, temporary directories."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from launch import rallypoint
from servers import (
    RedisServer,
    free_port,
    require_binary,
    spawn_redis,
    start_redis,
    wait_redis_ready,
    wait_until,
)


@dataclass
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    other_ca: Path  # a CA that did not sign the server's certificate


def make_certificates(directory: Path) -> Certificates:
    """A CA, a server certificate for 127.0.0.1 signed by it, and an unrelated CA."""
    openssl = require_binary("openssl", "openssl")
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True, timeout=60)

    for name in ("ca", "other-ca"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", f"{name}.key", "-out", f"{name}.crt", "-subj", f"/CN=rallypoint {name}")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")  # fmt: skip
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.cnf")  # fmt: skip
    return Certificates(
        directory / "ca.crt", directory / "server.crt", directory / "server.key",
        directory / "other-ca.crt",
    )  # fmt: skip


def start_tls_redis(tmp_path: Path, certificates: Certificates) -> tuple[RedisServer, int]:
    """A Redis serving TLS on a second port (its plain port is for the readiness check)."""
    tls_port = free_port()
    server = start_redis(
        tmp_path,
        extra_args=(
            "--tls-port", str(tls_port),
            "--tls-cert-file", str(certificates.server_cert),
            "--tls-key-file", str(certificates.server_key),
            "--tls-ca-cert-file", str(certificates.ca),
            "--tls-auth-clients", "no",
        ),
    )  # fmt: skip
    return server, tls_port


@dataclass
class SentinelGroup:
    master: RedisServer
    replica: RedisServer
    sentinels: list[RedisServer]
    name: str = "rdzv"

    @property
    def endpoint(self) -> str:
        return "sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    def master_port(self) -> int | None:
        """The master port the first live sentinel reports."""
        import redis

        for sentinel in self.sentinels:
            if not sentinel.is_running():
                continue
            client = redis.Redis(port=sentinel.port, socket_timeout=2)
            try:
                reply = client.execute_command(  # type: ignore[no-untyped-call]
                    "SENTINEL", "get-master-addr-by-name", self.name
                )
                return int(reply[1])
            except (redis.RedisError, IndexError, TypeError):
                continue
            finally:
                client.close()
        return None


@contextlib.contextmanager
def sentinel_group(tmp_path: Path, sentinels: int = 3) -> Iterator[SentinelGroup]:
    """A master, one replica and ``sentinels`` sentinels (quorum 2) on loopback, with
    failover after one second of silence."""
    binary = require_binary("redis-server", "redis-server")
    master = start_redis(tmp_path)
    replica = start_redis(tmp_path, extra_args=("--replicaof", "127.0.0.1", str(master.port)))
    started: list[RedisServer] = [master, replica]
    try:
        import redis

        client = redis.Redis(port=replica.port, socket_timeout=2)
        try:
            synced = wait_until(
                lambda: client.info("replication").get("master_link_status") == "up", 30
            )
        finally:
            client.close()
        assert synced, "the replica never synced with the master"
        group = SentinelGroup(master, replica, [])
        for index in range(sentinels):
            directory = tmp_path / f"sentinel{index}"
            directory.mkdir()
            port = free_port()
            config = directory / "sentinel.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
                f"sentinel monitor {group.name} 127.0.0.1 {master.port} 2\n"
                f"sentinel down-after-milliseconds {group.name} 1000\n"
                f"sentinel failover-timeout {group.name} 10000\n"
                f"sentinel parallel-syncs {group.name} 1\n"
            )
            sentinel = spawn_redis([binary, str(config), "--sentinel"], directory, port, "sentinel")
            started.append(sentinel)
            wait_redis_ready(sentinel)
            group.sentinels.append(sentinel)
        # Every sentinel knows the master before a test relies on failover.
        assert wait_until(lambda: group.master_port() == master.port, 30)
        yield group
    finally:
        for server in reversed(started):
            server.stop()


def status(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``rallypoint rendezvous status --rdzv-backend redis ...``."""
    return rallypoint(
        "rendezvous", "status", "--rdzv-backend", "redis", *args, env=env, timeout=timeout
    )

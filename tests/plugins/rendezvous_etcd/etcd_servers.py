"""etcd servers the shared fixtures (tests/servers.py) do not start: one serving TLS, one
with authentication, a three-member cluster, and one that is restarted on its data dir.

Every server runs its own binary on free loopback ports in the test's directory; readiness
is etcd's ``/health`` on a plain-HTTP client listener each of them also has.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from servers import EtcdServer, free_port, require_binary, wait_until

READY_TIMEOUT = 30.0


def launch(
    directory: Path,
    name: str,
    *,
    client_port: int,
    peer_port: int,
    cluster: str,
    extra_urls: Sequence[str] = (),
    extra_args: Sequence[str] = (),
    state: str = "new",
    token: str | None = None,
) -> EtcdServer:
    """Start one etcd member on ``directory`` (its data survives a restart there)."""
    binary = require_binary("etcd", "etcd-server")
    directory.mkdir(parents=True, exist_ok=True)
    client_url = f"http://127.0.0.1:{client_port}"
    argv = [
        binary,
        "--name", name,
        "--data-dir", str(directory / "data"),
        "--listen-client-urls", ",".join([client_url, *extra_urls]),
        "--advertise-client-urls", client_url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
        "--initial-cluster", cluster,
        "--initial-cluster-state", state,
        "--initial-cluster-token", token or f"rallypoint-test-{directory}",
        "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
        *extra_args,
    ]  # fmt: skip
    log_path = directory / f"{name}.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=directory,
            env={k: v for k, v in os.environ.items() if not k.startswith("ETCD_")},
            start_new_session=True,
        )
    return EtcdServer(
        name=name,
        binary=binary,
        argv=argv,
        data_dir=directory,
        ports={"client": client_port, "peer": peer_port},
        log_path=log_path,
        process=process,
    )


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def healthy(server: EtcdServer) -> bool:
    """etcd's ``/health`` says true: the member is up and the cluster has a leader."""
    try:
        with _DIRECT.open(f"{server.url}/health", timeout=1.0) as reply:
            return bool(json.loads(reply.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


def wait_healthy(server: EtcdServer, timeout: float = READY_TIMEOUT) -> None:
    if not wait_until(lambda: server.is_running() and healthy(server), timeout):
        server.stop()
        raise AssertionError(f"etcd not healthy after {timeout} s:\n{server.log_tail()}")


@dataclass
class Restartable:
    """A one-member etcd that a test can kill and start again on the same data and ports."""

    directory: Path
    server: EtcdServer

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def kill(self) -> None:
        self.server.process.send_signal(signal.SIGKILL)
        self.server.process.wait(timeout=10)

    def start(self) -> None:
        self.server = launch(
            self.directory,
            "default",
            client_port=self.server.client_port,
            peer_port=self.server.peer_port,
            cluster=f"default=http://127.0.0.1:{self.server.peer_port}",
            state="existing",
        )
        wait_healthy(self.server)


@pytest.fixture
def restartable_etcd(tmp_path: Path) -> Iterator[Restartable]:
    client, peer = free_port(), free_port()
    server = launch(
        tmp_path / "etcd",
        "default",
        client_port=client,
        peer_port=peer,
        cluster=f"default=http://127.0.0.1:{peer}",
    )
    wait_healthy(server)
    etcd = Restartable(tmp_path / "etcd", server)
    yield etcd
    etcd.server.stop()


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[list[EtcdServer]]:
    """Three members on loopback, healthy (a leader elected) when the test starts."""
    names = ["m0", "m1", "m2"]
    clients = {name: free_port() for name in names}
    peers = {name: free_port() for name in names}
    cluster = ",".join(f"{n}=http://127.0.0.1:{peers[n]}" for n in names)
    members = [
        launch(
            tmp_path / name,
            name,
            client_port=clients[name],
            peer_port=peers[name],
            cluster=cluster,
            token=f"rallypoint-test-{tmp_path}",
        )
        for name in names
    ]
    try:
        for member in members:
            wait_healthy(member)
        yield members
    finally:
        for member in members:
            member.stop()


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing of this server's


@pytest.fixture(scope="session")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    """A CA, a server certificate for 127.0.0.1, a client certificate, made with openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        require_binary("openssl", "openssl")  # skips locally, fails in CI
    where = tmp_path_factory.mktemp("tls")

    def run(*args: str) -> None:
        subprocess.run(
            [str(openssl), *args], cwd=where, check=True, capture_output=True, timeout=60
        )

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        run("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
            "-subj", f"/CN={ca}")  # fmt: skip
    (where / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    (where / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, common_name in (("server", "127.0.0.1"), ("client", "rallypoint")):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
            f"/CN={common_name}")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")  # fmt: skip
    return Certificates(
        ca=where / "ca.pem",
        server_cert=where / "server.pem",
        server_key=where / "server.key",
        client_cert=where / "client.pem",
        client_key=where / "client.key",
        other_ca=where / "other-ca.pem",
    )


@dataclass
class TlsEtcd:
    server: EtcdServer
    tls_endpoint: str  # https, client certificates required


@pytest.fixture
def tls_etcd(tmp_path: Path, certificates: Certificates) -> Iterator[TlsEtcd]:
    client, peer, secure = free_port(), free_port(), free_port()
    server = launch(
        tmp_path / "etcd-tls",
        "default",
        client_port=client,
        peer_port=peer,
        cluster=f"default=http://127.0.0.1:{peer}",
        extra_urls=[f"https://127.0.0.1:{secure}"],
        extra_args=[
            "--cert-file", str(certificates.server_cert),
            "--key-file", str(certificates.server_key),
            "--trusted-ca-file", str(certificates.ca),
            "--client-cert-auth",
        ],
    )  # fmt: skip
    try:
        wait_healthy(server)
        yield TlsEtcd(server, f"127.0.0.1:{secure}")
    finally:
        server.stop()


USER, PASSWORD = "root", "s3cret"


@pytest.fixture
def auth_etcd(etcd_server: EtcdServer) -> EtcdServer:
    """A fresh etcd with authentication on: user root, password s3cret."""
    import grpc  # type: ignore[import-untyped]
    from pyetcd import etcdrpc

    with grpc.insecure_channel(etcd_server.endpoint) as channel:
        auth = etcdrpc.AuthStub(channel)
        auth.UserAdd(etcdrpc.AuthUserAddRequest(name=USER, password=PASSWORD), timeout=10)
        auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=USER, role="root"), timeout=10)
        auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=10)
    return etcd_server

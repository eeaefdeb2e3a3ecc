"""etcd servers the shared fixtures (tests/servers.py) do not start: one serving TLS, one
with authentication, a three-member cluster, and one that is restarted on its data dir.

Every server runs its own binary on free loopback ports in the test's directory (started by
``servers.spawn_etcd``); readiness is etcd's ``/health`` on a plain-HTTP client listener each
of them also has.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from servers import EtcdServer, free_ports, require_binary, spawn_etcd, wait_etcd_ready


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
        self.server.stop()  # already dead: only forgets it, so nothing stops it at exit

    def start(self) -> None:
        self.server = spawn_etcd(
            self.directory,
            client_port=self.server.client_port,
            peer_port=self.server.peer_port,
            state="existing",
        )
        wait_etcd_ready(self.server)


@pytest.fixture
def restartable_etcd(tmp_path: Path) -> Iterator[Restartable]:
    client, peer = free_ports(2)
    server = spawn_etcd(tmp_path / "etcd", client_port=client, peer_port=peer)
    wait_etcd_ready(server)
    etcd = Restartable(tmp_path / "etcd", server)
    yield etcd
    etcd.server.stop()


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[list[EtcdServer]]:
    """Three members on loopback, healthy (a leader elected) when the test starts."""
    names = ["m0", "m1", "m2"]
    ports = free_ports(2 * len(names))
    clients = dict(zip(names, ports[: len(names)], strict=True))
    peers = dict(zip(names, ports[len(names) :], strict=True))
    cluster = ",".join(f"{n}=http://127.0.0.1:{peers[n]}" for n in names)
    members = [
        spawn_etcd(
            tmp_path / name,
            name=name,
            client_port=clients[name],
            peer_port=peers[name],
            cluster=cluster,
            token=f"rallypoint-test-{tmp_path}",
        )
        for name in names
    ]
    try:
        for member in members:
            wait_etcd_ready(member)
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
    secure, client, peer = free_ports(3)
    server = spawn_etcd(
        tmp_path / "etcd-tls",
        client_port=client,
        peer_port=peer,
        extra_urls=[f"https://127.0.0.1:{secure}"],
        extra_args=[
            "--cert-file", str(certificates.server_cert),
            "--key-file", str(certificates.server_key),
            "--trusted-ca-file", str(certificates.ca),
            "--client-cert-auth",
        ],
    )  # fmt: skip
    try:
        wait_etcd_ready(server)
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

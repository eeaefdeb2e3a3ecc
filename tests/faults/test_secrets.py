"""Secrets never reach what rallypoint prints or writes: the etcd user's password
(``--rdzv-conf password=...``), a Redis ACL password (in ``--rdzv-conf``, in
``$REDIS_PASSWORD`` or in a ``redis://user:password@host`` URL) and TLS private keys
(their paths and their contents). Real servers with authentication on; the places looked
at are the agent's output, its event log (``--event-log``), its failure report
(``failure.json`` and the summary), ``rallypoint rendezvous status`` (text and ``--json``)
and every error line, including those of a wrong password.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_py
from fault_setups import Recovery

from launch import rallypoint
from rallypoint_cli.main import main
from servers import EtcdServer, RedisServer, start_etcd, start_redis

COMMON = "heartbeat_timeout=3,last_call_timeout=0.5,join_timeout=30"


def secret() -> str:
    """A password no other text could contain by chance."""
    return f"pw-{uuid.uuid4().hex}"


def looked_at(*texts: str, files: Path | None = None) -> str:
    """Everything a user or a log collector would see: ``texts`` and the files under
    ``files``."""
    seen = list(texts)
    if files is not None:
        seen += [p.read_text(errors="replace") for p in sorted(files.rglob("*")) if p.is_file()]
    return "\n".join(seen)


def status(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``rallypoint rendezvous status ARGS`` in this process: exit code, stdout + stderr."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["rendezvous", "status", *args])
    return code, out.getvalue() + err.getvalue()


def failing_job(
    tmp_path: Path,
    backend: str,
    endpoint: str,
    conf: str,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One agent of ``--nnodes 1:2`` (so the real store is used) whose worker fails: the
    agent's output, and the directory with its event log and failure report."""
    script = tmp_path / "fail.py"
    script.write_text("import sys\nprint('working', flush=True)\nsys.exit(3)\n")
    out = tmp_path / "out"
    result = rallypoint(
        "run", "--nnodes", "1:2", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
        "--rdzv-id", "job", "--rdzv-conf", conf, "--event-log", str(out / "events.jsonl"),
        "--log-dir", str(out / "logs"), "--metrics", "log,jsonl",
        "--metrics-conf", f"path={out / 'metrics.jsonl'}", str(script),
        env=env, timeout=90,
    )  # fmt: skip
    return result, out


def assert_failed_with_a_report(result: subprocess.CompletedProcess[str], out: Path) -> None:
    """The job ran as far as its worker's failure: the places to look at exist."""
    assert result.returncode == 1, result.stderr
    assert (out / "events.jsonl").read_text()
    assert list((out / "logs").rglob("failure.json")), result.stderr
    assert "exit code 3" in result.stderr, result.stderr


# --- etcd with authentication -----------------------------------------------------------


@pytest.fixture
def etcd_with_auth(tmp_path: Path) -> Iterator[tuple[EtcdServer, str]]:
    import grpc
    from pyetcd import etcdrpc

    server = start_etcd(tmp_path / "etcd")
    password = secret()
    try:
        with grpc.insecure_channel(server.endpoint) as channel:
            auth = etcdrpc.AuthStub(channel)
            auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=password), timeout=10)
            auth.UserGrantRole(
                etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=10
            )
            auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=10)
        yield server, password
    finally:
        server.stop()


@pytest.mark.fault(
    "etcd password in `--rdzv-conf`, right and wrong",
    expected="the job runs; the password is in no output, event log, failure report, "
    "status or error line",
)
def test_etcd_password_is_never_shown(
    etcd_with_auth: tuple[EtcdServer, str], tmp_path: Path, recovery: Recovery
) -> None:
    server, password = etcd_with_auth
    conf = f"{COMMON},lease_ttl=3,user=root,password={password}"
    result, out = failing_job(tmp_path, "etcd", server.endpoint, conf)
    assert_failed_with_a_report(result, out)
    where = ["--rdzv-backend", "etcd", "--rdzv-endpoint", server.endpoint, "--rdzv-id", "job"]
    shown, shown_json = (
        status(*where, "--rdzv-conf", f"user=root,password={password}"),
        status(*where, "--rdzv-conf", f"user=root,password={password}", "--json"),
    )
    assert shown[0] == 0 and shown[1].startswith("run job: "), shown
    assert json.loads(shown_json[1])["run_id"] == "job"
    wrong = secret()
    refused = status(*where, "--rdzv-conf", f"user=root,password={wrong}")
    assert refused[0] == 1 and "refused user 'root'" in refused[1], refused
    in_url = status(
        "--rdzv-backend", "etcd", "--rdzv-endpoint", f"http://root:{password}@{server.endpoint}",
        "--rdzv-id", "job",
    )  # fmt: skip
    assert in_url[0] == 2 and "root:***@" in in_url[1], in_url
    everything = looked_at(
        result.stdout, result.stderr, shown[1], shown_json[1], refused[1], in_url[1], files=out
    )
    assert password not in everything
    assert wrong not in everything


# --- Redis with an ACL user ---------------------------------------------------------------


@pytest.fixture
def redis_with_acl(tmp_path: Path) -> Iterator[tuple[RedisServer, str]]:
    server = start_redis(tmp_path / "redis")
    password = secret()
    admin = redis_py.Redis(port=server.port)
    try:
        admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", "rdzv", "on", f">{password}", "~rallypoint/*", "&rallypoint/*",
            "+@all",
        )  # fmt: skip
        admin.execute_command("ACL", "SETUSER", "default", "off")  # type: ignore[no-untyped-call]
        yield server, password
    finally:
        admin.close()
        server.stop()


@pytest.mark.fault(
    "Redis ACL password in a `redis://` URL, `--rdzv-conf` or `$REDIS_PASSWORD`, right and wrong",
    expected="the job runs; the password is in no output, event log, failure report, "
    "status or error line",
)
def test_redis_password_is_never_shown(
    redis_with_acl: tuple[RedisServer, str], tmp_path: Path, recovery: Recovery
) -> None:
    server, password = redis_with_acl
    address = f"127.0.0.1:{server.port}"
    url = f"redis://rdzv:{password}@{address}/0"
    conf = f"{COMMON},key_ttl=3"
    result, out = failing_job(tmp_path, "redis", url, conf)
    assert_failed_with_a_report(result, out)
    where = ["--rdzv-backend", "redis", "--rdzv-id", "job"]
    texts = [result.stdout, result.stderr]
    for args, env in (
        (["--rdzv-endpoint", url], None),
        (["--rdzv-endpoint", url, "--json"], None),
        (["--rdzv-endpoint", address, "--rdzv-conf", f"username=rdzv,password={password}"], None),
        (["--rdzv-endpoint", address, "--rdzv-conf", "username=rdzv"], {"REDIS_PASSWORD": password}),
    ):  # fmt: skip
        code, text = status(*where, *args, env=env)
        assert code == 0 and ("run job: " in text or '"run_id": "job"' in text), text
        texts.append(text)
    wrong = secret()
    for args, env in (
        (["--rdzv-endpoint", f"redis://rdzv:{wrong}@{address}"], None),
        (["--rdzv-endpoint", address, "--rdzv-conf", f"username=rdzv,password={wrong}"], None),
        (["--rdzv-endpoint", address, "--rdzv-conf", "username=rdzv"], {"REDIS_PASSWORD": wrong}),
        # Malformed URLs: the usage error shows the URL with its password masked.
        (["--rdzv-endpoint", f"redis://rdzv:{wrong}@{address}/zero"], None),
        (["--rdzv-endpoint", f"redis://rdzv:{wrong}@[::1"], None),
        (["--rdzv-endpoint", f"rdzv:{wrong}@{address}"], None),
    ):  # fmt: skip
        code, text = status(*where, *args, env=env)
        assert code in (1, 2) and "rallypoint: error: " in text, text
        assert len(text.strip().splitlines()) == 1, text
        texts.append(text)
    everything = looked_at(*texts, files=out)
    assert password not in everything
    assert wrong not in everything


# --- TLS private keys ---------------------------------------------------------------------


@pytest.mark.fault(
    "TLS private key file given, missing or not a key",
    expected="one error line that names neither the key's path nor its contents",
)
def test_tls_key_paths_and_contents_are_never_shown(
    tmp_path: Path, recovery: Recovery, redis_server: RedisServer, etcd_server: EtcdServer
) -> None:
    hidden = tmp_path / f"secret-dir-{uuid.uuid4().hex}"
    hidden.mkdir()
    key = hidden / "client.key"
    content = f"-----BEGIN PRIVATE KEY-----\n{uuid.uuid4().hex}\n-----END PRIVATE KEY-----\n"
    key.write_text(content)
    cert = tmp_path / "client.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")
    missing = hidden / "gone.key"
    redis_at = f"127.0.0.1:{redis_server.port}"
    texts: list[str] = []
    for endpoint, conf in (
        (redis_at, f"ssl_keyfile={missing},ssl_certfile={cert}"),
        (f"rediss://{redis_at}", f"ssl_keyfile={key},ssl_certfile={cert},connect_timeout=2"),
    ):
        code, text = status("--rdzv-backend", "redis", "--rdzv-endpoint", endpoint,
                            "--rdzv-id", "job", "--rdzv-conf", conf)  # fmt: skip
        assert code in (1, 2) and text.startswith("rallypoint: error: "), text
        texts.append(text)
    for conf in (f"cert={cert},key={missing}", f"cert={cert},key={key},connect_timeout=2"):
        code, text = status("--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.endpoint,
                            "--rdzv-id", "job", "--rdzv-conf", conf)  # fmt: skip
        assert code in (1, 2) and text.startswith("rallypoint: error: "), text
        texts.append(text)
    everything = looked_at(*texts)
    assert hidden.name not in everything, everything
    assert content.splitlines()[1] not in everything

"""torch's ``--rdzv-conf`` keys: every key torch 2.13's rendezvous backends read is
accepted, on every backend, with torch's meaning where rallypoint has it, else reported
once as having no effect; a key torch does not know is still refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch import rallypoint, worker
from rallypoint.config import LaunchConfig
from rallypoint.errors import UsageError
from rallypoint.plugins import get_plugin_manager
from rallypoint.rendezvous.torch_keys import TORCH_KEYS

BACKENDS = ("c10d", "static", "etcd", "redis")


def config(backend: str, conf: str, script: Path) -> LaunchConfig:
    nnodes = "2" if backend == "static" else "1:2"
    return LaunchConfig.from_flags(
        get_plugin_manager().registry,
        training_script=str(script),
        nnodes=nnodes,
        rdzv_backend=backend,
        rdzv_endpoint="127.0.0.1:2379",
        rdzv_conf=conf,
    )


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.touch()
    return path


def value_for(key: str) -> str:
    if key in ("is_host",):
        return "false"
    if key == "store_type":
        return "tcp"
    if key == "protocol":
        return "http"
    if key.endswith("timeout") or key.startswith("keep_alive") or key == "rank":
        return "7"
    return "/some/file" if "cert" in key or key == "key" else "/some/prefix"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", sorted(TORCH_KEYS))
def test_every_torch_key_is_accepted(backend: str, key: str, script: Path) -> None:
    cfg = config(backend, f"{key}={value_for(key)}", script)
    used = key in cfg.rdzv_conf or any(key in note for note in cfg.notes)
    renamed = cfg.rdzv_conf != config(backend, "", script).rdzv_conf
    assert used or renamed, (cfg.rdzv_conf, cfg.notes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_keys_take_rallypoints_settings(backend: str, script: Path) -> None:
    cfg = config(backend, "timeout=90,keep_alive_interval=2,keep_alive_max_attempt=4", script)
    # torch: a node is dead after keep_alive_max_attempt missed beats of keep_alive_interval s.
    assert (cfg.rdzv_conf["join_timeout"], cfg.rdzv_conf["heartbeat_timeout"]) == (90, 8)
    assert config(backend, "keep_alive_interval=4", script).rdzv_conf["heartbeat_timeout"] == 12
    assert not cfg.notes


def test_etcd_keys_are_renamed(script: Path) -> None:
    cfg = config(
        "etcd", "etcd_prefix=/jobs,cacert=ca.pem,ssl_cert=c.pem,ssl_cert_key=k.pem", script
    )
    assert (cfg.rdzv_conf["prefix"], cfg.rdzv_conf["ca_cert"]) == ("/jobs", "ca.pem")
    assert (cfg.rdzv_conf["cert"], cfg.rdzv_conf["key"]) == ("c.pem", "k.pem")


def test_keys_without_effect_say_why(script: Path) -> None:
    (note,) = config("redis", "read_timeout=5", script).notes
    assert note == (
        "--rdzv-conf read_timeout: torch's key for seconds a store read may take; it has no "
        "effect with --rdzv-backend redis (this backend bounds its requests with its own "
        "timeouts)."
    )
    (note,) = config("c10d", "rank=2", script).notes
    assert "the node rank comes from --node-rank" in note


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ("timeout=5,join_timeout=6", "--rdzv-conf: give join_timeout or timeout, not both."),
        ("store_type=file", "--rdzv-conf store_type='file': expected one of tcp."),
        ("keep_alive_interval=soon", "--rdzv-conf keep_alive_interval='soon': expected a number."),
        ("keep_alive_max_attempt=0", "--rdzv-conf keep_alive_max_attempt='0': must be above 0."),
        ("timeout=nan", "--rdzv-conf join_timeout='nan': expected a finite number."),
    ],
)
def test_bad_torch_values_are_one_sentence(conf: str, message: str, script: Path) -> None:
    with pytest.raises(UsageError) as raised:
        config("c10d", conf, script)
    assert str(raised.value) == message


def test_an_unknown_key_is_still_refused(script: Path) -> None:
    with pytest.raises(UsageError, match=r"--rdzv-conf 'keepalive': unknown key for the c10d"):
        config("c10d", "keepalive=3", script)


def test_etcd_protocol_https_means_tls(script: Path) -> None:
    from rallypoint_etcd.config import parse_endpoints

    assert parse_endpoints("10.0.0.1:2379", "https")[1] is True
    assert parse_endpoints("10.0.0.1:2379", "http")[1] is False
    with pytest.raises(ValueError, match="not --rdzv-conf protocol=http"):
        parse_endpoints("https://10.0.0.1:2379", "http")


def test_the_note_is_printed_once_by_the_agent(tmp_path: Path) -> None:
    result = rallypoint(
        "run", "--rdzv-conf", "rank=1", worker("dump_env.py"), str(tmp_path / "env")
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("--rdzv-conf rank: torch's key") == 1, result.stderr

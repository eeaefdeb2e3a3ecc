"""Parsing and checking ``rallypoint run``'s flags into a ``LaunchConfig``."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint.config import LaunchConfig, count_workers, parse_options
from rallypoint.errors import UsageError
from rallypoint.extensions import ConfigOption
from rallypoint.flags import (
    parse_labels,
    parse_local_ranks,
    parse_nnodes,
    parse_nproc_per_node,
    parse_signals,
    parse_std_spec,
)
from rallypoint.plugins import get_plugin_manager
from rallypoint.preflight import preflight


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def config(**flags: object) -> LaunchConfig:
    """The configuration of these flags, checked against this machine as `rallypoint run`
    checks it."""
    launch = LaunchConfig.from_flags(get_plugin_manager().registry, **flags)
    preflight(launch)
    return launch


@pytest.mark.parametrize(
    ("text", "expected"), [("1", (1, 1)), ("4", (4, 4)), ("1:4", (1, 4)), (" 2 : 2 ", (2, 2))]
)
def test_parse_nnodes(text: str, expected: tuple[int, int]) -> None:
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize("text", ["", "a", "1:", ":2", "1:2:3", "-1", "0", "0:2", "3:2"])
def test_parse_nnodes_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="--nnodes"):
        parse_nnodes(text)


def test_parse_nproc_per_node() -> None:
    assert parse_nproc_per_node("8") == 8
    assert count_workers(parse_nproc_per_node("cpu")) >= 1
    # The CPU count where no accelerator is present.
    assert count_workers(parse_nproc_per_node("auto")) >= 1
    with pytest.raises(UsageError):
        parse_nproc_per_node("-1")


def test_parse_options_converts_and_fills_defaults() -> None:
    options = (
        ConfigOption("timeout", float, 30.0),
        ConfigOption("retries", int, 3),
        ConfigOption("tls", bool, False),
        ConfigOption("prefix", str, "/rp"),
    )
    values = parse_options("timeout=1.5, tls=yes,retries=7", options, "--x", "it")
    assert values == {"timeout": 1.5, "retries": 7, "tls": True, "prefix": "/rp"}
    with pytest.raises(UsageError, match=r"--x retries='many': expected a whole number\."):
        parse_options("retries=many", options, "--x", "it")
    with pytest.raises(UsageError, match="expected true or false"):
        parse_options("tls=maybe", options, "--x", "it")


def test_secret_values_are_never_echoed() -> None:
    options = (ConfigOption("port", int, 0, secret=True),)
    with pytest.raises(UsageError) as caught:
        parse_options("port=hunter2", options, "--rdzv-conf", "it")
    assert "hunter2" not in str(caught.value)


def test_small_parsers() -> None:
    assert parse_std_spec("3", "--tee") == {-1: 3}
    assert parse_std_spec("0:1,1:2", "--tee") == {0: 1, 1: 2}
    assert parse_local_ranks("") is None
    assert parse_local_ranks("0, 2") == frozenset({0, 2})
    assert parse_signals("sigterm,SIGUSR1") == ("SIGTERM", "SIGUSR1")
    assert parse_labels(["rack=a,zone=1", "row=3"]) == {"rack": "a", "zone": "1", "row": "3"}
    with pytest.raises(UsageError):
        parse_signals("SIG_DFL")


def test_defaults_match_torchrun(script: str) -> None:
    cfg = config(training_script=script)
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (1, 1, 1)
    # One node with no endpoint or master port: a local c10d rendezvous with a fresh id.
    assert cfg.rdzv_backend == "c10d"
    assert cfg.rdzv_id != "none"
    assert cfg.max_restarts == 0
    static = config(training_script=script, master_port="29511")
    assert (static.rdzv_backend, static.rdzv_id, static.master_port) == ("static", "none", 29511)
    assert cfg.monitor_interval == 0.1
    assert cfg.master_addr == "127.0.0.1"
    assert cfg.signals_to_handle == ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    assert cfg.shutdown_timeout == 30.0
    assert cfg.exit_barrier_timeout == 300.0
    assert cfg.restart_policy == "max-restarts"
    assert cfg.rank_assigner == "ordered"
    assert not cfg.elastic


def test_standalone_is_c10d_on_a_free_local_port_with_a_fresh_id(script: str) -> None:
    first = config(training_script=script, standalone=True, rdzv_backend="etcd", rdzv_id="x")
    second = config(training_script=script, standalone=True)
    assert (first.rdzv_backend, first.rdzv_endpoint) == ("c10d", "localhost:0")
    assert first.rdzv_id not in ("x", second.rdzv_id)


def test_backend_options_are_typed_with_defaults(script: str) -> None:
    cfg = config(
        training_script=script,
        nnodes="1:4",
        rdzv_backend="C10D",
        rdzv_conf="join_timeout=5,is_host=false",
        restart_policy="backoff",
        restart_conf="max_delay=10",
        metrics="jsonl,log,jsonl",
        metrics_conf="path=/tmp/m.jsonl",
        node_labels=("rack=r1",),
    )
    assert cfg.elastic
    assert cfg.rdzv_backend == "c10d"
    assert cfg.rdzv_conf["join_timeout"] == 5.0
    assert cfg.rdzv_conf["is_host"] is False
    assert cfg.rdzv_conf["last_call_timeout"] == 30.0
    assert cfg.restart_conf == {
        "initial_delay": 1.0,
        "factor": 2.0,
        "max_delay": 10.0,
        "jitter": 0.1,
        "reset_after": 300.0,
    }
    assert cfg.metrics == ("jsonl", "log")
    assert cfg.metrics_conf["path"] == "/tmp/m.jsonl"
    assert cfg.node_labels == {"rack": "r1"}


def test_shutdown_timeout_from_torch_environment_variable(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")
    assert config(training_script=script).shutdown_timeout == 12.0
    assert config(training_script=script, shutdown_timeout="3").shutdown_timeout == 3.0


def test_script_checks(script: str, tmp_path: Path) -> None:
    assert config(training_script="pkg.train", module=True).module
    assert config(training_script="true", no_python=True).no_python
    with pytest.raises(UsageError, match="not on PATH"):
        config(training_script="no-such-program-here", no_python=True)
    with pytest.raises(UsageError, match="absolute"):
        config(training_script="train.py", run_path=True)
    assert config(training_script=script, run_path=True).run_path


def test_module_and_no_python_exclude_each_other() -> None:
    with pytest.raises(UsageError, match="cannot be used together"):
        config(training_script="pkg.train", module=True, no_python=True)


def test_metrics_port_is_the_endpoint_sinks_port(script: str) -> None:
    cfg = config(training_script=script, metrics="prometheus", metrics_port="0")
    assert cfg.metrics_conf["port"] == 0
    cfg = config(
        training_script=script, metrics="jsonl,prometheus", metrics_conf="port=1", metrics_port="9"
    )
    assert cfg.metrics_conf["port"] == 9  # the flag wins over the same key in --metrics-conf
    with pytest.raises(UsageError, match="none of the chosen --metrics sinks serves an endpoint"):
        config(training_script=script, metrics="log", metrics_port="9400")
    with pytest.raises(UsageError, match="--metrics-port 70000: must be between 0 and 65535"):
        config(training_script=script, metrics="prometheus", metrics_port="70000")

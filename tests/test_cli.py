"""The ``rallypoint`` console script, run as a user runs it: as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import InstallPlugin, rallypoint
from rallypoint import __version__

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('training')\n")
    return str(path)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("rallypoint: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_version() -> None:
    result = rallypoint("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"rallypoint {__version__}"


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--nnodes", "3:2"], ["--nnodes '3:2'", "MIN must not exceed MAX"]),
        (["--nnodes", "a"], ["--nnodes 'a'", "MIN:MAX"]),
        (["--nnodes", "0"], ["at least 1 node"]),
        (["--nproc-per-node", "0"], ["--nproc-per-node '0'", "at least 1"]),
        (["--nproc-per-node", "many"], ["auto, cpu, gpu, xpu"]),
        (
            ["--rdzv-backend", "zookeeper"],
            ["unknown rendezvous backend", "Choose one of: c10d, etcd, redis, static"],
        ),
        (
            ["--rdzv-backend", "c10d", "--rdzv-conf", "lease_ttl=5"],
            ["--rdzv-conf 'lease_ttl'", "unknown key for the c10d backend", "join_timeout"],
        ),
        (
            [
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                "h:2379",
                "--rdzv-conf",
                "lease_ttl=soon",
            ],
            ["--rdzv-conf lease_ttl='soon'", "expected a number"],
        ),
        (["--rdzv-conf", "join_timeout"], ["expected KEY=VALUE"]),
        (["--rdzv-backend", "etcd"], ["--rdzv-endpoint is required", "etcd"]),
        (["--max-restarts", "-1"], ["--max-restarts '-1'", "at least 0"]),
        (["--max-restarts", "three"], ["expected a whole number"]),
        (["--monitor-interval", "0"], ["--monitor-interval '0'", "above 0"]),
        (["--restart-policy", "sometimes"], ["Choose one of: backoff, max-restarts, never"]),
        (["--rank-assigner", "random"], ["Choose one of: ordered, sticky, topology"]),
        (["--metrics", "log,statsd"], ["--metrics 'statsd'", "jsonl, log, prometheus"]),
        (["--metrics", "jsonl", "--metrics-conf", "port=1"], ["--metrics-conf 'port'", "path"]),
        (["--checkpoint-dir", "nosuch://bucket/run"], ["no checkpoint backend serves nosuch://"]),
        (  # a URL with one slash, or none, after its scheme: never a relative path
            ["--checkpoint-dir", "acme:/data/x"],
            ["no checkpoint backend serves acme://", "a relative path that has a colon: ./acme"],
        ),
        (["--checkpoint-dir", "acme:x"], ["no checkpoint backend serves acme://"]),
        (["--redirects", "7"], ["--redirects '7'"]),
        (["--local-ranks-filter", "0,x"], ["--local-ranks-filter"]),
        (["--signals-to-handle", "SIGTERM,SIGNOPE"], ["'SIGNOPE' is not a signal name"]),
        (["--node-label", "rack"], ["--node-label 'rack'", "KEY=VALUE"]),
        (["--nnodes", "2", "--node-rank", "2"], ["--node-rank 2"]),
        (["--nnodes", "1:2"], ["static needs a fixed --nnodes N"]),
        (["--bogus-flag"], ["no such option: --bogus-flag"]),
    ],
)
def test_bad_input_gets_one_line_and_exit_code_2(
    script: str, args: list[str], fragments: list[str]
) -> None:
    assert_one_line_error(rallypoint("run", *args, script), *fragments)


def test_missing_script(tmp_path: Path) -> None:
    assert_one_line_error(
        rallypoint("run", str(tmp_path / "nope.py")), "training script", "does not exist"
    )
    assert_one_line_error(rallypoint("run"), "missing the training script")


def test_option_without_value_is_a_one_line_usage_error() -> None:
    assert_one_line_error(rallypoint("run", "--nnodes"), "'--nnodes' requires an argument")


def test_a_valid_command_line_runs_the_script(script: str) -> None:
    result = rallypoint("run", "--standalone", "--nproc-per-node", "2", script, "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[default0]:training", "[default1]:training"]


def test_underscore_spellings_are_accepted(script: str) -> None:
    result = rallypoint(
        "run", "--nproc_per_node=2", "--rdzv_backend=c10d", "--max_restarts=3", script
    )
    assert result.returncode == 0, result.stderr


def test_environment_defaults_and_their_precedence(script: str) -> None:
    # PET_* (Kubeflow) is read ...
    assert_one_line_error(rallypoint("run", script, env={"PET_NNODES": "3:2"}), "'3:2'")
    # ... RALLYPOINT_* wins over PET_* ...
    env = {"PET_NNODES": "3:2", "RALLYPOINT_NNODES": "5:4"}
    assert_one_line_error(rallypoint("run", script, env=env), "'5:4'")
    # ... and the command line wins over both.
    assert_one_line_error(rallypoint("run", "--nnodes", "7:6", script, env=env), "'7:6'")
    assert_one_line_error(
        rallypoint("run", script, env={"PET_RDZV_BACKEND": "nope"}), "--rdzv-backend 'nope'"
    )


def test_help_lists_the_installed_names() -> None:
    result = rallypoint("run", "--help", env={"COLUMNS": "300"})
    assert result.returncode == 0
    assert "c10d, etcd, redis, static" in result.stdout
    assert "backoff, max-restarts, never" in result.stdout
    assert "jsonl, log, prometheus" in result.stdout


def test_plugins_json_lists_core_and_the_three_plugins() -> None:
    result = rallypoint("plugins", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    plugins = {p["name"]: p for p in payload["plugins"]}
    assert plugins["etcd"]["registered"] == {"rendezvous backend": ["etcd"]}
    assert plugins["redis"]["distribution"] == "rallypoint-redis"
    assert plugins["prometheus"]["registered"] == {"metrics sink": ["prometheus"]}
    assert plugins["rallypoint.builtins.rendezvous_backends"]["builtin"] is True
    assert all(p["status"] == "active" for p in plugins.values())
    assert payload["available"]["rendezvous backend"] == ["c10d", "etcd", "redis", "static"]
    assert payload["conflicts"] == []


def test_plugins_table() -> None:
    result = rallypoint("plugins")
    assert result.returncode == 0
    assert "rallypoint-etcd 0.1.0" in result.stdout
    assert "--rdzv-backend choices: c10d, etcd, redis, static" in result.stdout


def test_a_broken_installed_plugin_is_listed_and_the_cli_still_works(
    install_plugin: InstallPlugin, script: str
) -> None:
    site = install_plugin("exploding", "raise RuntimeError('this plugin is broken')")
    env = {"PYTHONPATH": str(site)}
    listing = rallypoint("plugins", "--json", env=env)
    assert listing.returncode == 0
    exploding = next(p for p in json.loads(listing.stdout)["plugins"] if p["name"] == "exploding")
    assert exploding["status"] == "broken"
    assert "this plugin is broken" in exploding["error"]
    assert_one_line_error(rallypoint("run", "--nnodes", "3:2", script, env=env), "MIN")
    assert rallypoint("--version", env=env).returncode == 0


RACKS = """
    from rallypoint.sdk import ConfigOption, RankAssigner, hookimpl

    def by_label(nodes, options):
        order = sorted(range(len(nodes)), key=lambda i: nodes[i].labels.get(options["key"], ""))
        return [order.index(i) for i in range(len(nodes))]

    @hookimpl
    def register_rank_assigners():
        key = ConfigOption("key", str, "rack", "the label that orders the nodes")
        return [RankAssigner("racks", "by a label", by_label, options=(key,))]
"""


def test_a_rank_assigner_s_rank_conf_keys_are_listed(install_plugin: InstallPlugin) -> None:
    """Issue 49: the keys of --rank-conf, as those of the other kinds' flags."""
    env = {"PYTHONPATH": str(install_plugin("racks", RACKS))}
    listing = rallypoint("plugins", env=env)
    assert "--rank-conf keys of rank assigner racks: key" in listing.stdout, listing.stdout
    options = json.loads(rallypoint("plugins", "--json", env=env).stdout)["options"]
    assert [o["name"] for o in options["rank assigner"]["racks"]] == ["key"]


def test_plugins_check_fails_where_a_plugin_is_broken(install_plugin: InstallPlugin) -> None:
    """For CI: ``rallypoint plugins --check`` lists, then exits 1 naming the broken ones."""
    assert rallypoint("plugins", "--check").returncode == 0
    env = {"PYTHONPATH": str(install_plugin("exploding", "raise RuntimeError('broken')"))}
    result = rallypoint("plugins", "--check", env=env)
    assert result.returncode == 1 and "exploding  [broken]" in result.stdout
    assert result.stderr.strip().splitlines() == [
        "error: broken plugin: exploding (see the error line under each)"
    ]


ACME = """
    from rallypoint.sdk import CheckpointBackend, hookimpl

    def check(url):
        raise ValueError(f"acme saw {url}")

    @hookimpl
    def register_checkpoint_backends():
        return [CheckpointBackend("acme", "a test's", schemes=("acme",), open=None, check=check)]
"""


@pytest.mark.parametrize("url", ["acme:/data/x", "acme:x", "ACME://data/x"])
def test_a_url_of_an_installed_scheme_reaches_its_backend_with_any_slashes(
    install_plugin: InstallPlugin, script: str, url: str
) -> None:
    """Issue 49: ``acme:/data/x`` went to the file store as ``./acme:/data/x``, rc 0,
    the plugin's ``check`` never called."""
    env = {"PYTHONPATH": str(install_plugin("acme", ACME))}
    result = rallypoint("run", "--checkpoint-dir", url, script, env=env)
    assert_one_line_error(result, f"--checkpoint-dir {url!r}: acme saw {url}")


def test_a_relative_path_with_a_colon_is_written_as_one(tmp_path: Path, script: str) -> None:
    """``./acme:x`` is a plain path, served by the built-in file store."""
    result = rallypoint("run", "--checkpoint-dir", "./acme:x", script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_disable_switch_from_the_command_line(script: str) -> None:
    result = rallypoint(
        "run", "--rdzv-backend", "redis", script, env={"RALLYPOINT_DISABLE_PLUGINS": "redis"}
    )
    assert_one_line_error(result, "unknown rendezvous backend", "c10d, etcd, static")


@pytest.mark.serial  # uninstalls a plugin from the environment every other test uses
@pytest.mark.skipif(
    not (REPO / "plugins" / "rendezvous_redis").is_dir(), reason="needs the repository checkout"
)
def test_uninstalling_a_plugin_removes_only_its_names(script: str) -> None:
    """`pip uninstall rallypoint-redis` drops `redis` from the choices and nothing else."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    before = json.loads(rallypoint("plugins", "--json").stdout)
    subprocess.run([*pip, "uninstall", "-y", "rallypoint-redis"], check=True, timeout=120)
    try:
        after = json.loads(rallypoint("plugins", "--json").stdout)
        result = rallypoint("run", "--rdzv-backend", "redis", script)
    finally:
        subprocess.run(
            [
                *pip,
                "install",
                "--no-deps",
                "--no-build-isolation",
                "-e",
                str(REPO / "plugins" / "rendezvous_redis"),
            ],
            check=True,
            timeout=300,
        )
    assert after["available"]["rendezvous backend"] == ["c10d", "etcd", "static"]
    assert [p["name"] for p in after["plugins"]] == [
        p["name"] for p in before["plugins"] if p["name"] != "redis"
    ]
    for kind in ("restart policy", "rank assigner", "checkpoint backend", "metrics sink"):
        assert after["available"][kind] == before["available"][kind]
    assert_one_line_error(result, "Choose one of: c10d, etcd, static.")

"""Plugin code that fails at run time, in real agents: a restart policy's ``decide``, a rank
assigner's ``assign``, a metrics sink's ``create``, ``emit`` and ``close``. Each failure is
one sentence naming the registration, its plugin and distribution, and the hook; a sink is
dropped and the job goes on, a policy or an assigner ends the job cleanly on every node.

Also the plugin manager's side: a misspelt hook name, and a registry that collects without
knowing the plugin manager."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from launch import (
    RALLYPOINT,
    InstallPlugin,
    clean_environment,
    declared,
    exit_codes,
    kill,
    rallypoint,
    wait_for_port,
    worker,
)
from rallypoint import registry
from rallypoint.extensions import RestartDecision, RestartPolicy
from rallypoint.plugins import BROKEN, build_plugin_manager
from rallypoint.registry import RESTART_POLICIES, Registry
from servers import free_port

pytestmark = pytest.mark.usefixtures("agent_tmpdir")

FLAKY = """
import os

from rallypoint import hookimpl
from rallypoint.extensions import (
    CheckpointBackend, MetricsSink, RankAssigner, RestartDecision, RestartPolicy,
)


def _note(line):
    with open(os.environ["FLAKY_NOTES"], "a") as notes:
        notes.write(line + "\\n")


def _raise(request):
    raise RuntimeError("policy boom")


def _patient(request):
    return RestartDecision(True, 0.0, "the error looks transient")


def _assign(nodes):
    raise ValueError("no topology for these nodes")


class Sink:
    def __init__(self, name):
        self.name = name

    def emit(self, event):
        _note(f"{self.name} emit {event.name}")
        if self.name == "bad-emit":
            raise OSError("disk full")

    def close(self):
        _note(f"{self.name} close")
        if self.name == "bad-close":
            raise ConnectionError("pushgateway gone")


def _create(name):
    def create(context):
        if name == "bad-create":
            raise PermissionError("port 80 needs root")
        return Sink(name)

    return create


@hookimpl
def register_restart_policies():
    return [
        RestartPolicy("flaky", "raises", _raise),
        RestartPolicy("patient", "restarts, saying why", _patient),
    ]


@hookimpl
def register_rank_assigners():
    return [RankAssigner("flaky", "raises", _assign)]


@hookimpl
def register_metrics_sinks():
    return [MetricsSink(n, n, _create(n)) for n in ("bad-create", "bad-emit", "bad-close")]


def _open(url):
    raise ConnectionRefusedError("bucket unreachable")


@hookimpl
def register_checkpoint_backends():
    return [CheckpointBackend("flaky", "raises", schemes=("flaky",), open=_open)]
"""

WHO = "of plugin 'flaky' (distribution rallypoint-test-flaky 1.0.0)"
#: What the agents must never show for a plugin's failure.
TRACES = ("Traceback", "frame #", "Exception raised from", "terminate called")


@pytest.fixture
def flaky(install_plugin: InstallPlugin, tmp_path: Path) -> dict[str, str]:
    """The environment of an agent that has the ``flaky`` plugin installed."""
    site = install_plugin("flaky", FLAKY, distribution="rallypoint-test-flaky")
    paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths), "FLAKY_NOTES": str(tmp_path / "notes")}


def script(tmp_path: Path, source: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(source)
    return str(path)


def events(path: Path, name: str) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        declared(record)
    return [record for record in records if record["event"] == name]


def assert_no_trace(output: str) -> None:
    for trace in TRACES:
        assert trace not in output, output


def test_a_policy_that_raises_ends_the_job_in_one_sentence(
    flaky: dict[str, str], tmp_path: Path
) -> None:
    log = tmp_path / "events.jsonl"
    result = rallypoint(
        "run", "--restart-policy", "flaky", "--max-restarts", "3", "--event-log", str(log),
        script(tmp_path, "import sys\nsys.exit(3)\n"),
        env=flaky,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    sentence = (
        f"the 'flaky' restart policy {WHO} raised in decide: RuntimeError: policy boom; "
        "the job stops"
    )
    assert f"not restarted: {sentence}\n" in result.stderr
    assert_no_trace(result.stderr)
    (stopping,) = events(log, "agent_stopping")
    assert stopping["exit_code"] == 1
    assert stopping["reason"] == f"rank 0 exit code 3; {sentence}"
    assert events(log, "workers_started")[-1]["pids"]  # its workers ran, and were stopped
    assert not events(log, "workers_restarted")


def test_a_restart_names_the_policy_and_its_reason(flaky: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    source = (
        "import os, sys\nsys.exit(3 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0)\n"
    )
    result = rallypoint(
        "run", "--restart-policy", "patient", "--max-restarts", "1", "--event-log", str(log),
        script(tmp_path, source),
        env=flaky,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    reason = "restart policy 'patient': the error looks transient"
    assert f"rank 0 exit code 3; restart 1 of 1 ({reason})\n" in result.stderr
    (restarted,) = events(log, "workers_restarted")
    assert (restarted["cause"], restarted["reason"]) == ("failure", reason)


def test_a_failing_sink_is_dropped_and_the_job_goes_on(
    flaky: dict[str, str], tmp_path: Path
) -> None:
    result = rallypoint(
        "run", "--metrics", "bad-create,bad-emit,bad-close", script(tmp_path, "print('ok')\n"),
        env=flaky,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout
    expected = [
        f"the 'bad-create' metrics sink {WHO} raised in create: PermissionError: port 80 needs "
        "root; the job goes on without it",
        f"the 'bad-emit' metrics sink {WHO} raised in emit: OSError: disk full; it is disabled "
        "(no later event reaches it) and the job goes on",
        f"the 'bad-close' metrics sink {WHO} raised in close: ConnectionError: pushgateway "
        "gone; ignored: the job's exit code is unchanged",
    ]
    for sentence in expected:
        assert result.stderr.count(f"{sentence}\n") == 1, result.stderr
    assert_no_trace(result.stderr)
    notes = Path(flaky["FLAKY_NOTES"]).read_text().splitlines()
    assert not [line for line in notes if line.startswith("bad-create")]
    # The failing sink got the first event only; the other sink got them all, then close.
    assert [line for line in notes if line.startswith("bad-emit")] == [
        "bad-emit emit agent_started"
    ]
    closing = [line for line in notes if line.startswith("bad-close")]
    assert closing[0] == "bad-close emit agent_started"
    assert closing[-2:] == ["bad-close emit agent_stopping", "bad-close close"]


def start_node(port: int, log: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """One node of a two-node c10d job on 127.0.0.1:``port``, one worker, its output in
    ``log`` and its events beside (``.jsonl``)."""
    with log.open("w") as output:
        return subprocess.Popen(
            [
                RALLYPOINT, "run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "flaky-job", "--rdzv-conf", "heartbeat_timeout=3,join_timeout=30",
                "--event-log", str(log.with_suffix(".jsonl")), *args,
            ],
            env=clean_environment(env),
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip


def run_two_nodes(
    tmp_path: Path, envs: list[dict[str, str]], *args: str
) -> tuple[list[int], list[Path]]:
    """The two nodes' exit codes and logs; the first hosts the store."""
    port = free_port()
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    agents = [start_node(port, logs[0], envs[0], *args)]
    try:
        wait_for_port(port, timeout=30)
        agents.append(start_node(port, logs[1], envs[1], *args))
    except BaseException:
        kill(*agents)  # the first node never waits for a second that did not start
        raise
    return exit_codes(agents, timeout=60), logs


def test_an_assigner_that_raises_ends_the_job_on_every_node(
    flaky: dict[str, str], tmp_path: Path
) -> None:
    train = script(tmp_path, "print('never started')\n")
    codes, logs = run_two_nodes(tmp_path, [flaky, flaky], "--rank-assigner", "flaky", train)
    outputs = [log.read_text() for log in logs]
    assert codes == [1, 1], outputs
    sentence = (
        f"rendezvous round 0: the 'flaky' rank assigner {WHO} raised in assign: ValueError: "
        "no topology for these nodes; the round cannot form, and the job stops on every node"
    )
    for log, output in zip(logs, outputs, strict=True):
        assert f"{sentence}\n" in output, output
        assert "never started" not in output
        assert_no_trace(output)
        (stopping,) = events(log.with_suffix(".jsonl"), "agent_stopping")
        assert (stopping["exit_code"], stopping["reason"]) == (1, sentence)


def test_a_checkpoint_backend_whose_open_raises_is_one_sentence(
    flaky: dict[str, str], tmp_path: Path
) -> None:
    """Issue 49: its own error from ``open`` in a worker becomes a CheckpointError whose
    message names the plugin, which the script catches as any checkpoint error (and which
    is the failure report's error line when it does not)."""
    train = script(
        tmp_path,
        "from rallypoint import checkpoint\n"
        "try:\n"
        "    checkpoint.default()\n"
        "except checkpoint.CheckpointError as error:\n"
        "    print(f'caught: {error}')\n",
    )
    result = rallypoint(
        "run", "--checkpoint-dir", "flaky://bucket/run", train, env=flaky, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        f"[default0]:caught: the 'flaky' checkpoint backend {WHO} raised in open: "
        "ConnectionRefusedError: bucket unreachable; no checkpoint can be saved to or loaded "
        "from 'flaky://bucket/run'\n"
    ) in result.stdout, result.stdout


def test_an_assigner_is_asked_on_one_node_too(flaky: dict[str, str], tmp_path: Path) -> None:
    """Issue 49: a job of one node runs the protocol in the agent's memory, and its leader
    asks the assigner for the one node's rank, as any round's leader does: an assigner
    that raises shows on the first one-node run, in the same sentence."""
    train = script(tmp_path, "print('never started')\n")
    result = rallypoint("run", "--rank-assigner", "flaky", train, env=flaky, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip() == (
        f"rallypoint: error: rendezvous round 0: the 'flaky' rank assigner {WHO} raised in "
        "assign: ValueError: no topology for these nodes; the round cannot form, and the "
        "job stops on every node"
    )
    assert "never started" not in result.stdout


def test_a_policy_that_raises_on_one_node_stops_the_others(
    flaky: dict[str, str], tmp_path: Path
) -> None:
    # The second node's worker fails and its policy raises; the first node's worker was
    # stopped for the round that followed, restarted, and is stopped again when it learns.
    train = script(
        tmp_path,
        "import os, sys, time\nsys.exit(3) if 'FLAKY_FAIL' in os.environ else time.sleep(30)\n",
    )
    envs = [flaky, {**flaky, "FLAKY_FAIL": "1"}]
    codes, logs = run_two_nodes(tmp_path, envs, "--restart-policy", "flaky", train)
    outputs = [log.read_text() for log in logs]
    assert codes == [1, 1], outputs
    sentence = (
        f"the 'flaky' restart policy {WHO} raised in decide: RuntimeError: policy boom; "
        "the job stops"
    )
    assert f"not restarted: {sentence}\n" in outputs[1]
    (failed,) = events(logs[1].with_suffix(".jsonl"), "agent_stopping")
    told = f"the job failed on node {failed['node']}: rank 1 exit code 3; {sentence}"
    assert f"{told}\n" in outputs[0], outputs[0]
    (stopping,) = events(logs[0].with_suffix(".jsonl"), "agent_stopping")
    assert (stopping["exit_code"], stopping["reason"]) == (1, told)
    for output in outputs:
        assert_no_trace(output)


# --- the plugin manager -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hook", "error"),
    [
        (
            "register_restart_policy",
            "unknown hook 'register_restart_policy': did you mean 'register_restart_policies'?",
        ),
        (
            "on_agent_start",
            "unknown hook 'on_agent_start': did you mean 'on_agent_started' or "
            "'on_agent_stopping'?",
        ),
        ("frobnicate", "unknown hook 'frobnicate': rallypoint has no hook like it"),
    ],
)
def test_a_misspelt_hook_is_broken_with_the_closest_names(
    install_plugin: InstallPlugin, hook: str, error: str
) -> None:
    install_plugin("typo", f"from rallypoint import hookimpl\n@hookimpl\ndef {hook}():\n    pass\n")
    info = build_plugin_manager().infos["typo"]
    assert (info.status, info.error) == (BROKEN, error)


WRONG_ARGUMENT = """
from rallypoint import hookimpl

@hookimpl
def register_rank_assigners(config):
    return []

@hookimpl
def register_restart_polcies():
    return []

@hookimpl
def on_agent_started(run, verbose=False):
    pass
"""


def test_an_argument_no_hook_passes_is_one_sentence_beside_a_misspelt_hook(
    install_plugin: InstallPlugin,
) -> None:
    """Issue 49: pluggy's raw PluginValidationError for the first problem, the misspelt
    hook hidden behind it, was all a plugin author saw; now one sentence names both."""
    install_plugin("wrong", WRONG_ARGUMENT)
    info = build_plugin_manager().infos["wrong"]
    assert info.status == BROKEN
    assert info.error == (
        "register_rank_assigners(config) asks for 'config', which rallypoint does not pass "
        "(it passes no argument); unknown hook 'register_restart_polcies': did you mean "
        "'register_restart_policies'?"
    )


def test_an_optional_hook_this_rallypoint_lacks_is_allowed(install_plugin: InstallPlugin) -> None:
    install_plugin(
        "future",
        "from rallypoint import hookimpl\n@hookimpl(optionalhook=True)\ndef on_future(run):\n    pass\n",
    )
    assert build_plugin_manager().infos["future"].status == "active"


def test_the_registry_collects_without_the_plugin_manager() -> None:
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(inspect.getsource(registry)))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert "rallypoint.plugins" not in imported
    good = RestartPolicy("good", "", lambda request: RestartDecision(True))

    def implementations(hook: str) -> list[tuple[str, Any]]:
        if hook == RESTART_POLICIES.hook:
            return [("good", lambda: [[good]]), ("bad", lambda: [["not a policy"]])]
        if hook == "register_metrics_sinks":
            return [("bad", lambda: [[]]), ("worse", lambda: 1 / 0)]
        return []

    class Provider:
        distribution, version = "acme", "1.0"

    found = Registry.collect(
        implementations, {name: Provider() for name in ("good", "bad", "worse")}
    )
    assert found.registry.names(RESTART_POLICIES) == ["good"]
    assert found.registered == {"good": {"restart policy": ["good"]}}
    assert found.broken == {
        "bad": "register_restart_policies: expected RestartPolicy, got str",
        "worse": "register_metrics_sinks failed: ZeroDivisionError: division by zero",
    }


def test_a_name_of_a_broken_plugin_says_the_plugin_is_broken(
    install_plugin: InstallPlugin, tmp_path: Path
) -> None:
    """A plugin whose hook name is misspelt registers nothing: choosing the policy it meant
    to register names it, and why it is broken, rather than only "unknown"."""
    site = install_plugin(
        "typo",
        "from rallypoint import hookimpl\n@hookimpl\ndef register_restart_policy():\n    pass\n",
    )
    paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    result = rallypoint(
        "run", "--restart-policy", "mine", worker("light.py"), str(tmp_path),
        env={"PYTHONPATH": os.pathsep.join(paths)},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == (
        "rallypoint: error: --restart-policy 'mine': unknown restart policy. Choose one of: "
        "backoff, max-restarts, never. Installed but broken, so none of their names can "
        "be chosen: typo (unknown hook 'register_restart_policy': did you mean "
        "'register_restart_policies'?); see rallypoint plugins."
    )


def test_a_checkpoint_backend_refuses_a_malformed_url_before_any_worker_starts(
    install_plugin: InstallPlugin, tmp_path: Path
) -> None:
    """``CheckpointBackend.check`` runs when the flags are parsed: its sentence, exit 2,
    and no worker ever runs (which would each have printed a traceback from ``open``)."""
    site = install_plugin(
        "fussy",
        """
        from rallypoint.sdk import CheckpointBackend, hookimpl

        def check(url):
            if not url.removeprefix("fussy://").split("/")[0]:
                raise ValueError("a fussy:// URL names its bucket: fussy://BUCKET/PATH")

        def open_storage(url):
            raise AssertionError("never opened")

        @hookimpl
        def register_checkpoint_backends():
            return [CheckpointBackend("fussy", "", ("fussy",), open_storage, check)]
        """,
    )
    paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    marker = tmp_path / "ran"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    result = rallypoint(
        "run", "--checkpoint-dir", "fussy:///no-bucket", str(script),
        env={"PYTHONPATH": os.pathsep.join(paths)},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "rallypoint: error: --checkpoint-dir 'fussy:///no-bucket': a fussy:// URL names its "
        "bucket: fussy://BUCKET/PATH"
    )
    assert not marker.exists()


@pytest.mark.parametrize("key", ["", "two words", "a=b", "a,b", "1st", "dash-ed"])
def test_an_option_key_the_command_line_cannot_carry_is_refused(key: str) -> None:
    from rallypoint.extensions import ConfigOption

    with pytest.raises(ValueError, match="a key is a letter or _ followed by"):
        ConfigOption(key)

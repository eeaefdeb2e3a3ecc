"""The agent on one node, with real torch workers (gloo on CPU) and real signals."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from launch import RALLYPOINT, InstallPlugin, clean_environment, rallypoint, torchrun, worker
from rallypoint.agent.monitoring.failures import exception_line
from servers import process_alive as alive
from servers import wait_until

#: Variables that differ between any two launches (ports, ids, temporary paths), and the
#: one rallypoint sets differently on purpose (docs/user-guide.md, "Worker environment").
VARYING = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
DIFFERENT_BY_DESIGN = {"TORCHELASTIC_USE_AGENT_STORE"}
#: rallypoint gives torchrun 2.13's environment; an older torchrun (make test-lowest) gave
#: MASTER_ADDR 127.0.0.1 where 2.13 gives localhost.
TORCH = tuple(int(part) for part in torch.__version__.split(".")[:2])
OLDER_TORCHRUN = set() if TORCH >= (2, 13) else {"MASTER_ADDR"}


pytestmark = pytest.mark.usefixtures("agent_tmpdir")


def envs(output: str) -> dict[int, dict[str, str]]:
    rows = [json.loads(line.split(":", 1)[1]) for line in output.splitlines() if ":{" in line]
    rows += [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return {int(row["RANK"]): row for row in rows}


def read_pids(directory: Path, count: int, timeout: float = 60) -> list[int]:
    assert wait_until(lambda: len(list(directory.glob("*.pid"))) == count, timeout)
    return [int(path.read_text()) for path in sorted(directory.glob("*.pid"))]


@pytest.mark.parametrize("standalone", [["--standalone"], []], ids=["standalone", "default"])
def test_worker_environment_equals_torchrun(standalone: list[str]) -> None:
    ours = rallypoint("run", *standalone, "--nproc-per-node", "2", worker("dump_env.py"))
    theirs = torchrun(*standalone, "--nproc-per-node", "2", worker("dump_env.py"))
    assert ours.returncode == 0, ours.stderr
    assert theirs.returncode == 0, theirs.stderr
    ours_by_rank, theirs_by_rank = envs(ours.stdout), envs(theirs.stdout)
    assert sorted(ours_by_rank) == sorted(theirs_by_rank) == [0, 1]
    for rank, expected in theirs_by_rank.items():
        got = ours_by_rank[rank]
        for name, value in expected.items():
            assert name in got, f"rank {rank}: {name} missing"
            if name not in VARYING | DIFFERENT_BY_DESIGN | OLDER_TORCHRUN:
                assert got[name] == value, f"rank {rank}: {name}={got[name]!r}, torchrun {value!r}"
        assert got["MASTER_PORT"] == ours_by_rank[0]["MASTER_PORT"]
        assert got["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert got["RALLYPOINT_RUN_ID"] == got["TORCHELASTIC_RUN_ID"]
        assert got["RALLYPOINT_RENDEZVOUS_ROUND"] == "0"


def test_allreduce_across_two_workers() -> None:
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", worker("allreduce.py"), "20"
    )
    assert result.returncode == 0, result.stderr
    assert "[default0]:done rank=0 world=2 attempt=0" in result.stdout
    assert "[default1]:done rank=1 world=2 attempt=0" in result.stdout


@pytest.mark.parametrize("repetition", range(3))
def test_a_worker_crash_is_recovered(repetition: int, tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        "--event-log", str(events), worker("allreduce.py"), "10", "--crash-at", "5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "done rank=0 world=2 attempt=1" in result.stdout
    assert "done rank=1 world=2 attempt=1" in result.stdout
    # gloo's threads sometimes abort the interpreter's exit after the exception (SIGABRT,
    # "terminate called without an active exception"): the error is named either way.
    assert re.search(
        r"rank 1 (exit code 1|killed by SIGABRT) \(ValueError: boom at step 5\); restart 1 of 1",
        result.stderr,
    ), result.stderr
    records = [json.loads(line) for line in events.read_text().splitlines()]
    failed = [r for r in records if r["event"] == "worker_failed"]
    # Rank 1 failed first; rank 0 may fail too when it notices its peer is gone.
    assert failed[0]["rank"] == 1
    assert {r["rank"] for r in failed[1:]} <= {0}
    names = [r["event"] for r in records if r not in failed[1:]]
    assert names == [
        "agent_started",
        "rendezvous_started", "rendezvous_completed", "workers_started",
        "worker_failed",
        # After a failure, the next round tells whether a node was lost (the restart's cause).
        "rendezvous_started", "rendezvous_completed", "workers_restarted", "workers_started",
        "agent_stopping",
    ]  # fmt: skip


@pytest.mark.soak
@pytest.mark.parametrize("repetition", range(20))
def test_a_worker_crash_is_recovered_20_times_of_20(repetition: int, tmp_path: Path) -> None:
    """The scenario torchrun recovered from in 3 runs of 10, repeated (``make soak``)."""
    test_a_worker_crash_is_recovered(repetition, tmp_path)


def test_no_restarts_left_fails_with_the_root_cause(tmp_path: Path) -> None:
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
        "--log-dir", str(tmp_path), worker("allreduce.py"), "10", "--crash-at", "3",
    )  # fmt: skip
    assert result.returncode == 1
    assert "root cause: rank 1 (local rank 1)" in result.stderr
    # gloo's threads may abort the exit that follows the exception (see above).
    assert re.search(r"root cause: .*: (exit code 1|killed by SIGABRT)", result.stderr)
    assert "ValueError: boom at step 3" in result.stderr
    assert "not restarted: all 0 restarts (--max-restarts) used up" in result.stderr
    (report_path,) = tmp_path.glob("*/failure.json")
    report = json.loads(report_path.read_text())
    assert report["root_cause"]["rank"] == 1
    assert report["root_cause"]["exit_code"] == 1 or report["root_cause"]["signal"] == "SIGABRT"
    assert "ValueError: boom at step 3" in report["root_cause"]["traceback"]


@pytest.mark.parametrize("decorator", ["rallypoint", "torch"])
def test_record_puts_the_exception_in_the_report(tmp_path: Path, decorator: str) -> None:
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path),
        worker("allreduce.py"), "10", "--crash-at", "2", "--record", decorator,
    )  # fmt: skip
    assert result.returncode == 1
    assert "error: ValueError: boom at step 2" in result.stderr
    (report_path,) = tmp_path.glob("*/failure.json")
    report = json.loads(report_path.read_text())
    assert report["root_cause"]["message"] == "ValueError: boom at step 2"
    assert report["root_cause"]["traceback"].startswith("Traceback (most recent call last)")


def test_a_signal_is_named_in_the_report() -> None:
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "2",
        worker("allreduce.py"), "10", "--crash-at", "2", "--crash-with", "kill",
    )  # fmt: skip
    assert result.returncode == 1
    assert "root cause: rank 1 (local rank 1)" in result.stderr
    assert "killed by SIGKILL" in result.stderr


def test_sigkill_of_the_agent_leaves_no_worker(tmp_path: Path) -> None:
    agent = subprocess.Popen(
        [RALLYPOINT, "run", "--standalone", "--nproc-per-node", "2", worker("sleeper.py"),
         str(tmp_path)],
        env=clean_environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        pids = read_pids(tmp_path, 2)
        agent.kill()
        agent.wait(timeout=30)
        assert wait_until(lambda: not any(alive(pid) for pid in pids), 10), "orphan workers"
    finally:
        agent.kill()
        agent.wait(timeout=30)


@pytest.mark.parametrize("ignore_term", [False, True], ids=["graceful", "stubborn"])
def test_sigterm_stops_the_workers_within_the_shutdown_timeout(
    tmp_path: Path, ignore_term: bool
) -> None:
    args = [str(tmp_path), "ignore-term"] if ignore_term else [str(tmp_path)]
    agent = subprocess.Popen(
        [RALLYPOINT, "run", "--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "2",
         worker("sleeper.py"), *args],
        env=clean_environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        pids = read_pids(tmp_path, 2)
        began = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        _, stderr = agent.communicate(timeout=30)
        took = time.monotonic() - began
        assert agent.returncode == 128 + signal.SIGTERM
        assert "received SIGTERM" in stderr
        assert not any(alive(pid) for pid in pids)
        # Stubborn workers are killed once the 2 s shutdown timeout has passed, not before.
        assert (took >= 2) == ignore_term
    finally:
        agent.kill()
        agent.wait(timeout=30)


def test_eight_jobs_at_once_on_one_host() -> None:
    def job(_: int) -> subprocess.CompletedProcess[str]:
        return rallypoint(
            "run", "--standalone", "--nproc-per-node", "2", worker("allreduce.py"), "5",
            timeout=240,
        )  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(job, range(8)))
    for result in results:
        assert result.returncode == 0, result.stderr
        assert "done rank=1 world=2" in result.stdout


def test_output_routing(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(logs),
        "--tee", "0:1", "--redirects", "0:1,1:3", "--local-ranks-filter", "0,1",
        worker("allreduce.py"), "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    tmp_path = logs
    # Rank 0 stays on the console (tee wins over redirect) and is copied to a file ...
    assert "[default0]:done rank=0" in result.stdout
    (run_dir,) = tmp_path.iterdir()
    assert "done rank=0" in (run_dir / "attempt_0" / "0" / "stdout.log").read_text()
    # ... rank 1 is only in its files.
    assert "[default1]" not in result.stdout + result.stderr
    assert "done rank=1" in (run_dir / "attempt_0" / "1" / "stdout.log").read_text()


def test_local_ranks_filter_hides_other_ranks() -> None:
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", "--local-ranks-filter", "1",
        worker("allreduce.py"), "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "[default1]:done rank=1" in result.stdout
    assert "[default0]" not in result.stdout


def test_module_no_python_and_run_path(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "hello.py").write_text(
        "import os, sys\nprint('hello', os.environ['RANK'], sys.argv[1:])\n"
    )
    module = rallypoint("run", "--nproc-per-node", "2", "-m", "pkg.hello", "x", cwd=tmp_path)
    assert module.returncode == 0, module.stderr
    assert "[default1]:hello 1 ['x']" in module.stdout
    program = rallypoint("run", "--no-python", "sh", "-c", "echo rank $RANK of $WORLD_SIZE")
    assert program.returncode == 0, program.stderr
    assert "[default0]:rank 0 of 1" in program.stdout
    path = rallypoint("run", "--run-path", str(package / "hello.py"), "y")
    assert path.returncode == 0, path.stderr
    assert "[default0]:hello 0 ['y']" in path.stdout


def test_role_names_the_workers() -> None:
    result = rallypoint("run", "--role", "trainer", worker("dump_env.py"))
    assert result.returncode == 0, result.stderr
    assert envs(result.stdout)[0]["ROLE_NAME"] == "trainer"
    assert result.stdout.startswith("[trainer0]:")


def test_all_output_arrives_before_the_agent_exits(tmp_path: Path) -> None:
    script = tmp_path / "chatty.py"
    script.write_text("for i in range(20000):\n    print('line', i)\n")
    result = rallypoint("run", "--nproc-per-node", "2", str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 40000
    assert "[default1]:line 19999" in result.stdout


def test_processes_left_by_workers_are_stopped(tmp_path: Path) -> None:
    script = tmp_path / "leaves_a_child.py"
    script.write_text(
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
    )
    result = rallypoint("run", str(script))
    assert result.returncode == 0, result.stderr
    child = int((tmp_path / "child.pid").read_text())
    assert wait_until(lambda: not alive(child), 10)


def test_a_master_port_in_use_is_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = rallypoint("run", "--master-port", port, worker("dump_env.py"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"rallypoint: error: --master-port {port}: cannot use it on this host (Address already "
        "in use); choose another port or leave --master-port out to get a free one."
    ]


def test_lifecycle_hooks_are_called_and_one_failing_hook_does_not_silence_others(
    install_plugin: InstallPlugin, tmp_path: Path
) -> None:
    calls = tmp_path / "calls.txt"
    recorder = f"""
        from rallypoint import hookimpl

        def _note(text):
            with open({str(calls)!r}, "a") as handle:
                handle.write(text + "\\n")

        @hookimpl
        def on_agent_started(run):
            _note("started " + run.run_id)

        @hookimpl
        def on_rendezvous_completed(run, round_info):
            _note(f"round {{round_info.round}} world {{round_info.world_size}}")

        @hookimpl
        def on_workers_started(run, round_info, pids):
            _note(f"workers {{len(pids)}}")

        @hookimpl
        def on_worker_failed(run, failure):
            _note(f"failed rank {{failure.rank}} code {{failure.exit_code}}")

        @hookimpl
        def on_workers_restarted(run, restart_count, cause):
            _note(f"restarted {{restart_count}} {{cause}}")

        @hookimpl
        def on_agent_stopping(run, exit_code, reason):
            _note(f"stopping {{exit_code}}")
    """
    install_plugin("recorder", recorder)
    site = install_plugin(
        "faulty",
        """
        from rallypoint import hookimpl

        @hookimpl
        def on_agent_started(run):
            raise RuntimeError("faulty hook")
        """,
    )
    result = rallypoint(
        "run", "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
        "--rdzv-id", "job9",
        worker("allreduce.py"), "6", "--crash-at", "2",
        env={"PYTHONPATH": str(site)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "plugin 'faulty': on_agent_started failed: RuntimeError: faulty hook" in result.stderr
    # Rank 0 may also fail when it notices its peer is gone: it comes after the root cause.
    lines = [line for line in calls.read_text().splitlines() if line != "failed rank 0 code 1"]
    # gloo's threads may abort rank 1's exit after its exception: SIGABRT, no exit code.
    lines = [line.replace("code None", "code 1") for line in lines]
    assert lines == [
        "started job9",
        "round 0 world 2",
        "workers 2",
        "failed rank 1 code 1",
        "round 1 world 2",  # the restart is counted once the next round shows no node lost
        "restarted 1 failure",
        "workers 2",
        "stopping 0",
    ]


def test_the_agent_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from rallypoint_cli.main import build_app\n"
        "from rallypoint.plugins import get_plugin_manager\n"
        "import rallypoint.agent.statemachine.elastic\n"
        "build_app(get_plugin_manager())\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_every_attempt_gets_a_new_store_port(tmp_path: Path) -> None:
    script = tmp_path / "port.py"
    script.write_text(
        "import os, sys\n"
        "print('port', os.environ['MASTER_PORT'], flush=True)\n"
        "sys.exit(1 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0)\n"
    )
    result = rallypoint("run", "--max-restarts", "1", str(script))
    assert result.returncode == 0, result.stderr
    ports = [line.split()[-1] for line in result.stdout.splitlines()]
    assert len(ports) == 2
    assert ports[0] != ports[1]


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ([], ""),
        (["warning: slow disk\n"], ""),
        (
            ["[rank1]: Traceback (most recent call last):\n", '[rank1]:   File "t.py"\n',
             "[rank1]:     raise ValueError('x')\n", "[rank1]: ValueError: x\n"],
            "ValueError: x",
        ),
        (  # a chained exception: the last traceback is the one that ended the worker
            ["Traceback (most recent call last):\n", "  File 'a.py'\n", "KeyError: 'k'\n",
             "\n", "During handling of the above exception, another exception occurred:\n",
             "\n", "Traceback (most recent call last):\n", "  File 'b.py'\n",
             "RuntimeError: no shard\n", "terminate called without an active exception\n"],
            "RuntimeError: no shard",
        ),
    ],
)  # fmt: skip
def test_exception_line_is_the_end_of_the_last_traceback(lines: list[str], expected: str) -> None:
    assert exception_line(lines) == expected

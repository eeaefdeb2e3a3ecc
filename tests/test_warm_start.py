"""Warm start: workers forked from the preloaded interpreter keep torchrun's worker contract.

Each contract test runs the same job warm (the default) and cold (``--warm-start off``) and
compares what the workers saw; ``probe.py`` reports whether torch was already imported
when its first line ran, so that every test also checks which way it started.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from launch import RALLYPOINT, clean_environment, rallypoint, wait_gone, worker
from rallypoint.agent.processes import zygote
from rallypoint.agent.processes.environment import PER_WORKER, job_environment, worker_environment
from rallypoint.agent.processes.keeper import Keeper
from rallypoint.agent.processes.preload import imported
from rallypoint.agent.processes.warm import WarmStart
from rallypoint.agent.processes.worker_logs import WorkerLogs
from rallypoint.agent.processes.workers import WorkerSpec
from rallypoint.config import LaunchConfig
from rallypoint.events import RoundInfo
from rallypoint.interfaces import Assignment
from rallypoint.plugins import build_plugin_manager
from servers import wait_until

pytestmark = pytest.mark.usefixtures("agent_tmpdir")

WORKERS = Path(worker("probe.py")).parent
COLD = ("--warm-start", "off")
# Every piece of process state that a fresh interpreter draws or makes for itself, and a
# fork would copy from the preloaded interpreter, is one of the probe's keys. The contract
# test checks each key: a warm worker's equals a cold one's, but for these two kinds.
#: Drawn anew by every interpreter, and by every warm worker: differs between any two
#: workers. Python's random reseeds itself after a fork; the rest is zygote._fresh_process_state.
#: (CUDA's generators: tests/test_warm_random.py, on a GPU.)
DRAWN = {"random", "numpy", "torch_seed", "torch_rand", "authkey"}
#: What a warm worker keeps of the preloaded interpreter, by design (docs/user-guide.md,
#: "Warm start"): str hashing's secret, drawn when an interpreter starts and fixed for its
#: life (every warm worker of a node has the same one, a cold one its own, unless
#: PYTHONHASHSEED is set); the preloaded objects, frozen out of the collector's sight.
SHARED = {"hash", "gc_frozen"}


def probes(output: str) -> dict[str, dict[str, Any]]:
    rows = [json.loads(line.split(":", 1)[1]) for line in output.splitlines() if ':{"' in line]
    return {row["rank"]: row for row in rows}


def run_probe(
    *args: str, tmp_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", *args,
        env={"PROBE_DIR": str(tmp_path), **(env or {})}, cwd=cwd, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    "how",
    [
        ("script", [worker("probe.py"), "a", "--b"], WORKERS),
        ("module", ["-m", "workers.probe", "a", "--b"], WORKERS.parent),
        ("run_path", ["--run-path", worker("probe.py"), "a", "--b"], WORKERS),
    ],
    ids=lambda how: how[0],
)
def test_a_warm_worker_sees_what_a_cold_one_sees(
    how: tuple[str, list[str], Path], tmp_path: Path
) -> None:
    _, args, cwd = how
    warm = run_probe(*args, tmp_path=tmp_path, cwd=cwd)
    cold = run_probe(*COLD, *args, tmp_path=tmp_path, cwd=cwd)
    assert warm.returncode == 0, warm.stderr
    assert cold.returncode == 0, cold.stderr
    ours, fresh = probes(warm.stdout), probes(cold.stdout)
    assert sorted(ours) == sorted(fresh) == ["0", "1"]
    assert "warm start is off (--warm-start off): workers start cold" in cold.stderr
    for rank in ours:
        assert ours[rank]["preloaded"] and not fresh[rank]["preloaded"]
        for key in set(fresh[rank]) - DRAWN - SHARED - {"preloaded"}:
            assert ours[rank][key] == fresh[rank][key], f"rank {rank} {key}"
        assert ours[rank]["own_session"] and not ours[rank]["cuda_initialised"]
        assert ours[rank]["gc_frozen"] and not fresh[rank]["gc_frozen"]
    # A fresh interpreter draws its own random state: so does each warm worker.
    for key in DRAWN:
        assert ours["0"][key] != ours["1"][key], key
        assert fresh["0"][key] != fresh["1"][key], key
    assert ours["0"]["hash"] == ours["1"]["hash"]
    assert fresh["0"]["hash"] != fresh["1"]["hash"]
    assert warm.stdout.count("atexit ran") == 2
    assert (tmp_path / "left-open-0.txt").read_text() == "written before the end\n"


def test_a_preload_modules_helpers_and_process_bound_state_stay_its_own(tmp_path: Path) -> None:
    """A ``--preload`` module that starts multiprocessing's resource tracker and fork server
    and registers an object to renew after a fork: each warm worker starts helpers of its
    own, as a cold one does, and the object is renewed (tests/workers/preload_state.py)."""
    args = ("--preload", "preload_state", worker("probe.py"))
    env = {"PROBE_IMPORT": "preload_state", "TMPDIR": "/tmp"}  # the fork server's socket
    warm = run_probe(*args, tmp_path=tmp_path, env=env, cwd=WORKERS)
    cold = run_probe(*COLD, *args, tmp_path=tmp_path, env=env, cwd=WORKERS)
    assert warm.returncode == 0, warm.stderr
    assert cold.returncode == 0, cold.stderr
    for rows, preloaded in ((probes(warm.stdout), True), (probes(cold.stdout), False)):
        assert sorted(rows) == ["0", "1"]
        for row in rows.values():
            assert row["preloaded"] == preloaded
            assert row["own_helpers"] and row["renewed"], row


def test_import_time_settings_are_the_jobs(tmp_path: Path) -> None:
    """OMP_NUM_THREADS as the job sets it: torchrun's 1 for several workers, or the user's."""
    for env, threads in (({}, 1), ({"OMP_NUM_THREADS": "2"}, 2)):
        result = run_probe(worker("probe.py"), tmp_path=tmp_path, env=env)
        assert result.returncode == 0, result.stderr
        for row in probes(result.stdout).values():
            assert row["preloaded"] and row["threads"] == threads


@pytest.mark.parametrize(
    ("end", "line"),
    [
        ("exit3", "exit code 3"),
        ("message", "exit code 1"),
        ("raise", "ValueError: probe raised"),
        ("interrupt", "killed by SIGINT"),
        ("sigkill", "killed by SIGKILL"),
    ],
)
def test_exit_statuses_are_a_fresh_interpreters(end: str, line: str, tmp_path: Path) -> None:
    results = [
        run_probe(*mode, worker("probe.py"), "--end", end, tmp_path=tmp_path) for mode in ((), COLD)
    ]
    for result in results:
        assert result.returncode == 1, result.stderr
        assert line in result.stderr, result.stderr
    warm, cold = results
    if end == "message":
        assert "the script said goodbye" in warm.stderr
    if end == "raise":  # the traceback starts at the script, as a fresh interpreter's
        frames = [ln for ln in warm.stderr.splitlines() if 'File "' in ln]
        assert frames and all("zygote" not in ln and "<string>" not in ln for ln in frames)
        assert 'probe.py", line' in frames[0]
    if end in ("exit3", "message", "raise"):
        # The worker that failed first ran its atexit handler before it exited; the other
        # may be stopped (SIGTERM) before it gets there.
        assert warm.stdout.count("atexit ran") >= 1 and cold.stdout.count("atexit ran") >= 1


def test_multiprocessing_children_with_every_start_method() -> None:
    # forkserver's socket goes to TMPDIR: this test's own is longer than a socket's path.
    args = ("run", "--standalone", "--nproc-per-node", "2", worker("mp_children.py"))
    result = rallypoint(*args, env={"TMPDIR": "/tmp"})
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        for method in ("spawn", "forkserver", "fork"):
            assert f"rank={rank} {method} ok" in result.stdout


def test_a_fabric_style_environment_check_passes() -> None:
    result = rallypoint("run", "--standalone", "--nproc-per-node", "2", worker("fabric_env.py"))
    assert result.returncode == 0, result.stderr
    assert "fabric rank=0 local_rank=0 node_rank=0 world=2" in result.stdout
    assert "fabric rank=1 local_rank=1 node_rank=0 world=2" in result.stdout


def test_twenty_crashes_in_a_row_each_restart_warm() -> None:
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "20",
        worker("crash_loop.py"), "20", timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "done rank=0 attempt=20 sum=2" in result.stdout
    assert "done rank=1 attempt=20 sum=2" in result.stdout
    assert "workers start cold" not in result.stderr


def _zygotes(marker: str) -> list[int]:
    """Preloaded interpreters whose command line names ``marker`` (the script's folder)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker.encode() in cmdline and zygote.BOOT.encode() in cmdline:
                found.append(int(entry))
    return found


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in (
            os.listdir(f"/proc/{parent}/task") if os.path.isdir(f"/proc/{parent}/task") else []
        ):
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            found += [int(child) for child in children]
            todo += [int(child) for child in children]
    return found


#: A line for a script: it says it is up (a file per rank beside it).
UP = "open(os.path.join(os.path.dirname(__file__), f'{os.environ[\"RANK\"]}.up'), 'w').close()\n"


def start_until_up(script: Path, **output: Any) -> subprocess.Popen[str]:
    """A two-worker job of ``script`` (which runs ``UP``), once both workers are up."""
    agent = subprocess.Popen(
        [RALLYPOINT, "run", "--standalone", "--nproc-per-node", "2", str(script)],
        env=clean_environment(), text=True, **output,
    )  # fmt: skip
    if not wait_until(lambda: len(list(script.parent.glob("*.up"))) == 2, 60):
        agent.kill()
        raise AssertionError("the workers did not start")
    return agent


def test_the_agents_sigkill_leaves_nothing_of_the_job(tmp_path: Path) -> None:
    script = tmp_path / "sleepy.py"
    script.write_text(
        "import os, subprocess, sys, time, torch\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"{UP}time.sleep(300)\n"
    )
    agent = start_until_up(script, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        job = _descendants(agent.pid)
        preloaded = _zygotes(str(tmp_path))
        assert len(preloaded) == 1 and preloaded[0] in job
        assert len(job) == 6  # the keeper, the zygote, 2 workers and their children
        # ps shows a worker's command line as a cold one's, what pgrep -f finds: one line
        # (as setproctitle writes it), no empty arguments after it (zygote.show_command_line).
        shown = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in job]
        assert shown.count(f"{sys.executable} -u {script}\0".encode()) == 2
    finally:
        agent.kill()
        agent.wait(10)
    wait_gone(job, timeout=30)
    assert _zygotes(str(tmp_path)) == []


def test_sigterm_reaches_a_warm_workers_handler(tmp_path: Path) -> None:
    script = tmp_path / "handles.py"
    script.write_text(
        "import os, signal, sys, time, torch\n"
        "def stop(signum, frame):\n"
        "    print(f'rank {os.environ[\"RANK\"]} got SIGTERM', flush=True)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"{UP}time.sleep(120)\n"
    )
    agent = start_until_up(script, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=60)
    finally:
        agent.kill()
    assert agent.returncode == 128 + signal.SIGTERM, err
    assert "rank 0 got SIGTERM" in out and "rank 1 got SIGTERM" in out


# --- what starts cold, and says why ------------------------------------------------------


def test_a_failing_preload_starts_cold_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('broken at import')\n")
    script = tmp_path / "job.py"
    script.write_text("import sys; print('preloaded' if 'torch' in sys.modules else 'fresh')\n")
    for name, expected in (
        (
            "no_such_module_xyz",
            "--preload no_such_module_xyz: ModuleNotFoundError: No module named 'no_such_module_xyz': workers start cold",
        ),
        (
            "broken_mod",
            "--preload broken_mod: importing it raised RuntimeError: broken at import: workers start cold",
        ),
    ):
        result = rallypoint("run", "--standalone", "--preload", name, str(script), cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert expected in result.stderr
        assert result.stderr.count("workers start cold") == 1
        assert "Traceback" not in result.stderr
        assert "[default0]:fresh" in result.stdout


def test_no_python_and_warm_start_off_say_why() -> None:
    result = rallypoint("run", "--standalone", "--no-python", sys.executable, "-c", "print('ran')")
    assert result.returncode == 0, result.stderr
    assert (
        "--no-python runs a program, which cannot be preloaded: workers start cold" in result.stderr
    )
    bad = rallypoint("run", "--standalone", "--warm-start", "maybe", worker("probe.py"))
    assert bad.returncode == 2 and "--warm-start 'maybe': choose on or off." in bad.stderr
    bad = rallypoint("run", "--standalone", "--preload", "not a module", worker("probe.py"))
    assert bad.returncode == 2 and "--preload 'not a module': expected a module name" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_preload_that_starts_a_thread_is_refused(tmp_path: Path) -> None:
    (tmp_path / "threaded_mod.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), name='busy', daemon=True).start()\n"
    )
    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    result = rallypoint(
        "run", "--standalone", "--preload", "threaded_mod", str(script), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "a --preload module started Python threads (busy): workers start cold" in result.stderr
    assert "[default0]:ran" in result.stdout


# --- the agent's side, in this process ------------------------------------------------------


def _config(script: Path, **flags: Any) -> LaunchConfig:
    return LaunchConfig.from_flags(
        build_plugin_manager({}).registry, training_script=str(script), standalone=True, **flags
    )


def _spec(config: LaunchConfig, tmp_path: Path, extra: dict[str, str] | None = None) -> WorkerSpec:
    info = RoundInfo(0, 0, 1, 1, "127.0.0.1", 29500, ("node",))
    error_file = str(tmp_path / "error.json")
    env = worker_environment(
        config, Assignment(info, (1,)), 0, error_file, node_id="node", restart_count=0
    )
    return WorkerSpec(0, 0, {**env, **(extra or {})}, WorkerLogs(3, None, None, error_file))


def test_a_preload_that_hangs_is_given_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "hangs_mod.py").write_text("import time; time.sleep(600)\n")
    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    config = _config(script, preload="hangs_mod")
    keeper = Keeper()
    try:
        warm = WarmStart(config, ready_timeout=1.0)
        warm.prepare(keeper)
        read, write = os.pipe()
        began = time.monotonic()
        pid = warm.spawn(keeper, _spec(config, tmp_path), write, write)
        os.close(write)
        assert time.monotonic() - began < 10
        assert keeper.warm == "failed"
        assert "importing torch, hangs_mod" not in keeper.warm_reason  # the job has no torch
        assert "importing hangs_mod took more than 1 s" in keeper.warm_reason
        assert "workers start cold" in caplog.text
        assert wait_until(lambda: pid in keeper.exits or keeper.pump(0.1) is not None, 30)
        assert keeper.exits[pid][0] == 0
        os.close(read)
    finally:
        keeper.close()


def test_a_worker_whose_environment_differs_starts_cold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    config = _config(script)
    warm = WarmStart(config)
    keeper = Keeper()
    try:
        warm.prepare(keeper)
        assert warm._warm_request(keeper, _spec(config, tmp_path)) is not None
        assert (
            warm._warm_request(keeper, _spec(config, tmp_path, {"MALLOC_ARENA_MAX": "2"})) is None
        )
        assert (
            "differs from the one the preloaded modules were imported with (MALLOC_ARENA_MAX)"
            in caplog.text
        )
    finally:
        keeper.close()


def test_per_worker_names_are_every_name_set_per_worker(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("")
    config = _config(
        tmp_path / "job.py",
        checkpoint_dir=str(tmp_path),
        watchdog_timeout="5",
        virtual_local_rank=True,
    )
    spec = _spec(config, tmp_path)
    job = job_environment(config)
    added = {k for k, v in spec.env.items() if job.get(k) != v}
    assert added and added <= PER_WORKER


def test_cuda_is_not_initialised_before_a_fork() -> None:
    assert zygote.unfit_to_fork() is None or "threads" in str(zygote.unfit_to_fork())


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_a_preload_that_initialises_cuda_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cuda_mod.py").write_text("import torch; torch.zeros(1, device='cuda')\n")
    script = tmp_path / "job.py"
    script.write_text("import torch; print(torch.zeros(1, device='cuda').item())\n")
    result = rallypoint("run", "--standalone", "--preload", "cuda_mod", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "CUDA was initialised in the preloaded interpreter" in result.stderr


def test_torch_and_rallypoint_are_preloaded_when_the_program_imports_them(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text("def build():\n    from torch import nn\n    return nn\n")
    (package / "__main__.py").write_text("from . import model\n")
    (tmp_path / "train.py").write_text("import pkg.model\n")
    (tmp_path / "plain.py").write_text("import json, os\nimport pkg\n")
    (tmp_path / "uses_both.py").write_text("from rallypoint import record\nimport torch.nn\n")
    assert imported(str(tmp_path / "train.py"), str(tmp_path)) == ("torch",)
    assert imported("pkg", str(tmp_path), module=True) == ("torch",)
    assert imported(str(tmp_path / "uses_both.py"), str(tmp_path)) == ("torch", "rallypoint")
    assert imported(str(tmp_path / "plain.py"), str(tmp_path)) == ()
    assert imported(str(tmp_path / "missing.py"), str(tmp_path)) == ()
    # An optimizer imports torch._dynamo when it is created: preloaded too.
    (tmp_path / "adam.py").write_text("import torch\nopt = torch.optim.Adam(params)\n")
    (tmp_path / "sgd.py").write_text("from torch.optim import SGD\n")
    for script in ("adam.py", "sgd.py"):
        assert imported(str(tmp_path / script), str(tmp_path)) == ("torch", "torch._dynamo")


def test_a_preloaded_interpreter_that_dies_is_prepared_again(tmp_path: Path) -> None:
    """Attempt 0 kills it (a warm worker's parent): attempt 1 starts cold, and attempt 2
    warm again, from the one prepared while attempt 1 ran."""
    script = tmp_path / "kills_its_parent.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "preloaded = 'torch' in sys.modules\n"
        "attempt = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "print(f'attempt={attempt} rank={os.environ[\"RANK\"]} preloaded={preloaded}', flush=True)\n"
        "import torch\n"
        "if attempt == 0 and os.environ['RANK'] == '0':\n"
        "    time.sleep(1)  # both are up by then\n"
        "    os.kill(os.getppid(), signal.SIGKILL)\n"
        "if attempt == 0:\n"
        "    time.sleep(30)  # killed with it\n"
        "if attempt < 2:\n"
        "    time.sleep(0.5)\n"
        "    sys.exit(1)\n"
    )
    result = rallypoint(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", str(script)
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"attempt=0 rank={rank} preloaded=True" in result.stdout
        assert f"attempt=1 rank={rank} preloaded=False" in result.stdout
        assert f"attempt=2 rank={rank} preloaded=True" in result.stdout
    # "(killed by SIGKILL)" when the keeper had reaped it before the restart began
    assert re.search(
        r"the preloaded interpreter died( \(killed by SIGKILL\))?: workers start cold",
        result.stderr,
    )

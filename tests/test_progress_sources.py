"""A worker's progress, counted from torch with no change to the script
(``rallypoint.worker.progress_sources``) and reported to its agent
(``rallypoint.worker.progress_reporter``): real torch on CPU, in worker processes of the
test's own (``install`` patches torch for good), reporting to a real ``Receiver``."""

from __future__ import annotations

import itertools
import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import rallypoint
from launch import clean_environment
from rallypoint.agent.processes.environment import worker_environment
from rallypoint.agent.processes.keeper import Keeper
from rallypoint.agent.processes.warm import WarmStart
from rallypoint.agent.processes.worker_logs import WorkerLogs
from rallypoint.agent.processes.workers import WorkerSpec
from rallypoint.config import LaunchConfig
from rallypoint.events import RoundInfo
from rallypoint.interfaces import Assignment
from rallypoint.plugins import build_plugin_manager
from rallypoint.worker import channel, progress, progress_sources, variables
from rallypoint.worker.progress_sources import STARTUP, cold_start_environment
from servers import free_port, wait_until

#: Every field of a report: the worker's, and the channel's (rank, local_rank).
FIELDS = {
    "sent", "signals", "progressed", "armed", "step", "step_at", "collective", "phase",
    "thread", "rank", "local_rank",
}  # fmt: skip
#: How a worker script of these tests begins: the progress sources installed before torch
#: is imported (as a cold worker's sitecustomize does) or after (a warm worker's fork).
PRELUDE = """\
import json, os, sys, time
{first}
from rallypoint.worker import progress, progress_reporter, progress_sources
progress_sources.install()
import torch
state = progress.state

def show(**values):
    print(json.dumps(values), flush=True)

"""


class Agent:
    """A worker channel's receiving end, as an agent's, keeping its progress reports."""

    def __init__(self) -> None:
        self.reports: queue.Queue[dict[str, Any]] = queue.Queue()
        self.receiver = channel.Receiver(lambda name, data: None, progress=self.reports.put)
        self.seen: list[dict[str, Any]] = []

    def environment(self, rank: int = 0, interval: str | None = "0.05") -> dict[str, str]:
        """A worker's environment: this agent's socket, and reports every ``interval``."""
        extra = {
            variables.EVENTS_SOCKET: self.receiver.address,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        }
        if interval is not None:
            extra[variables.PROGRESS_REPORTS] = interval
        return clean_environment(extra)

    def until(
        self, wanted: Callable[[dict[str, Any]], bool], timeout: float = 60
    ) -> dict[str, Any]:
        """The first report from now on that is ``wanted``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                report = self.reports.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(report)
            if wanted(report):
                return report
        raise AssertionError(f"no such report within {timeout} s; the last: {self.seen[-3:]}")


@pytest.fixture
def agent() -> Iterator[Agent]:
    made = Agent()
    yield made
    made.receiver.close()


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def script(tmp_path: Path, body: str, name: str = "rank.py", *, cold: bool = True) -> Path:
    path = tmp_path / name
    first = "" if cold else "import torch"
    path.write_text(PRELUDE.format(first=first) + textwrap.dedent(body))
    return path


def run(path: Path, env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    """Run the worker script to its end; what it showed."""
    done = subprocess.run(
        [sys.executable, "-u", str(path), *args],
        env=env, cwd=path.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def line_of(path: Path, marker: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if marker in line)


# --- the sources ------------------------------------------------------------------------------


@pytest.mark.parametrize("cold", [True, False], ids=["cold", "warm"])
def test_what_a_training_loop_does_is_counted(tmp_path: Path, cold: bool) -> None:
    """Cold: patched by the import hook, once ``import torch`` completes (and
    ``torch.distributed.checkpoint`` once imported); warm: at once."""
    body = """
    def seen(at):
        hook = [f for f in sys.meta_path if type(f).__name__ == "_AfterImport"]
        show(at=at, signals=state.signals, armed=state.armed, hook=bool(hook))

    seen("imported")
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = next(iter(torch.utils.data.DataLoader(torch.ones(8, 4), batch_size=4)))
    seen("batch")
    progress_sources._sample_forward()  # as before every report
    model(batch)
    seen("forward")
    loss = model(batch).sum()  # the sampler took one forward: not this one
    seen("forward again")
    loss.backward()
    optimizer.step()
    seen("optimizer step")
    import torch.distributed.checkpoint as dcp
    show(wrapped=[hasattr(f, "__wrapped__") for f in (dcp.save, dcp.async_save, dcp.load)])
    seen("dcp imported")
    """
    shown = run(script(tmp_path, body, cold=cold), clean_environment())
    counts = {row["at"]: (row["signals"], row["armed"]) for row in shown if "at" in row}
    assert counts == {
        "imported": (0, False),
        "batch": (1, False),
        "forward": (2, False),
        "forward again": (2, False),
        "optimizer step": (3, True),
        "dcp imported": (3, True),
    }
    hooks = {row["at"]: row["hook"] for row in shown if "at" in row}
    assert hooks["imported"] and not hooks["dcp imported"]  # gone once nothing is left
    assert [row["wrapped"] for row in shown if "wrapped" in row] == [[True, True, True]]


def test_a_report_during_a_save_or_load_names_the_phase(tmp_path: Path, agent: Agent) -> None:
    """The object pickled reports from inside ``torch.save`` and ``torch.load``."""
    body = """
    import io

    def rebuilt():
        progress_reporter.send()  # inside torch.load
        return "rebuilt"

    class Probe:
        def __reduce__(self):
            progress_reporter.send()  # inside torch.save
            return (rebuilt, ())

    buffer = io.BytesIO()
    torch.save(Probe(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False) == "rebuilt"
    progress_reporter.send()
    """
    run(script(tmp_path, body), agent.environment(interval="60"))
    saving = agent.until(lambda r: r["phase"] is not None)
    assert saving["phase"]["name"] == "checkpoint_save"
    assert saving["phase"]["since"] <= saving["sent"]
    loading = agent.until(lambda r: True)
    assert loading["phase"]["name"] == "checkpoint_load"
    after = agent.until(lambda r: True)
    assert after["phase"] is None and after["signals"] == 2  # each phase's end


def test_compiled_code_keeps_one_graph(tmp_path: Path) -> None:
    """Inside torch.compile the sources do nothing: a wrapped collective is still the one
    Dynamo makes traceable (one graph, fullgraph), and the forward sampler's hook, on and
    off between calls, never makes Dynamo compile again."""
    body = """
    import torch._dynamo.testing
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    counter = torch._dynamo.testing.CompileCounter()
    model = torch.nn.Linear(4, 4)

    @torch.compile(backend=counter, fullgraph=True)
    def step(x):
        y = model(x)
        dist.all_reduce(y)
        return y

    for _ in range(3):
        progress_sources._sample_forward()
        step(torch.ones(2, 4))
    show(frames=counter.frame_count)
    dist.destroy_process_group()
    """
    shown = run(script(tmp_path, body, cold=False), clean_environment(), str(free_port()))
    assert shown == [{"frames": 1}]


# --- the reports ------------------------------------------------------------------------------


def test_reports_come_every_interval_with_every_field(
    tmp_path: Path, agent: Agent, processes: list[subprocess.Popen[str]]
) -> None:
    body = """
    show(main=__import__("threading").main_thread().ident)
    model = torch.nn.Linear(4, 4)
    model(torch.ones(1, 4)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    progress.progress(step=7)
    sys.stdin.readline()  # until the test is done
    """
    worker = subprocess.Popen(
        [sys.executable, "-u", str(script(tmp_path, body))], env=agent.environment(rank=3),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    processes.append(worker)
    assert worker.stdout is not None
    main = json.loads(worker.stdout.readline())["main"]
    step = agent.until(lambda r: r["step"] == 7)
    assert step["step_at"] == step["sent"]  # a new step goes at once
    reports = [agent.until(lambda r: r["sent"] > step["sent"]) for _ in range(3)]
    for report in reports:
        assert set(report) == FIELDS
        assert report["rank"] == report["local_rank"] == 3
        assert report["thread"] == main
        assert report["armed"] is True and report["step"] == 7
        assert report["collective"] is None and report["phase"] is None
        assert report["progressed"] is not None and report["progressed"] <= report["sent"]
    signals = {r["signals"] for r in reports}  # idle: the count stays
    assert len(signals) == 1 and signals.pop() >= 2  # the optimizer step, progress()
    gaps = [later["sent"] - earlier["sent"] for earlier, later in itertools.pairwise(reports)]
    assert min(gaps) >= 0.05  # one every interval
    worker.communicate("\n", timeout=30)
    assert worker.returncode == 0


def test_a_rank_in_a_collective_says_which_and_where_and_shows_its_stack(
    tmp_path: Path, agent: Agent, processes: list[subprocess.Popen[str]]
) -> None:
    """Two gloo ranks: rank 0 waits in an all-reduce until rank 1, held by the test,
    joins it. Rank 0's reports name the op and the script's line, and its stacks, taken
    with STACKS_SIGNAL, show that line; the all-reduce's end is progress."""
    body = """
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        sys.stdin.readline()  # held by the test
    tensor = torch.ones(1)
    dist.all_reduce(tensor)  # the line that waits
    show(total=tensor.item())
    sys.stdin.readline()
    dist.destroy_process_group()
    """
    path = script(tmp_path, body)
    line, port = line_of(path, "the line that waits"), free_port()
    stacks = tmp_path / "stacks-0.txt"
    for rank in (0, 1):
        env = {
            **agent.environment(rank=rank),
            "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            variables.STACKS_FILE: str(tmp_path / f"stacks-{rank}.txt"),
        }  # fmt: skip
        process = subprocess.Popen(
            [sys.executable, "-u", str(path)], env=env, cwd=tmp_path,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        processes.append(process)
    waiting = agent.until(lambda r: r["rank"] == 0 and r["collective"] is not None)
    collective = waiting["collective"]
    assert collective == {
        "op": "all_reduce",
        "site": f"rank.py:{line}",
        "since": collective["since"],
    }
    assert collective["since"] <= waiting["sent"]
    os.kill(processes[0].pid, variables.STACKS_SIGNAL)
    assert wait_until(lambda: f'rank.py", line {line} in <module>' in stacks.read_text(), 30)
    assert f"{waiting['thread']:#018x}" in stacks.read_text()  # the main thread, as reported
    assert processes[0].poll() is None  # the stacks never stop a rank
    held = processes[1].stdin
    assert held is not None
    held.write("\n")  # rank 1 joins the all-reduce
    held.flush()
    done = agent.until(lambda r: r["rank"] == 0 and r["collective"] is None)
    assert done["signals"] > waiting["signals"] and done["progressed"] > waiting["sent"]
    for process in processes:
        out, _ = process.communicate("\n", timeout=60)
        assert process.returncode == 0 and '{"total": 2.0}' in out


def test_a_forked_child_sends_nothing_and_ignores_the_stacks_signal(
    tmp_path: Path, agent: Agent
) -> None:
    """A child of ``os.fork`` and a DataLoader worker both say a step and send: nothing
    arrives. The parent's next step does."""
    body = """
    pid = os.fork()
    if pid == 0:
        progress.progress(step=99)
        progress_reporter.send()
        os.kill(os.getpid(), int(sys.argv[1]))  # ignored: no stack, no end
        time.sleep(0.2)  # a reporter's few intervals, were there one in the child
        os._exit(0)
    show(status=os.waitpid(pid, 0)[1])

    class Steps(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            progress.progress(step=1000 + index)
            progress_reporter.send()
            return index

    loader = torch.utils.data.DataLoader(Steps(), batch_size=None, num_workers=1)
    show(batches=[int(b) for b in loader])
    progress.progress(step=100)
    """
    env = {**agent.environment(), variables.STACKS_FILE: str(tmp_path / "stacks.txt")}
    shown = run(script(tmp_path, body), env, str(int(variables.STACKS_SIGNAL)))
    assert shown == [{"status": 0}, {"batches": [0, 1]}]
    agent.until(lambda r: r["step"] == 100)
    assert not [r for r in agent.seen if r["step"] != 100 and r["step"] is not None]
    assert (tmp_path / "stacks.txt").read_text() == ""


# --- cold and warm workers --------------------------------------------------------------------

LOOK = """\
import json, os, sys
seen = {
    "PYTHONPATH": os.environ.get("PYTHONPATH"),
    "saved": "RALLYPOINT_PYTHONPATH" in os.environ,
    "path": sys.path,
    "user_sitecustomize": getattr(sys, "user_sitecustomize", False),
}
print(json.dumps(seen), flush=True)
if sys.argv[1:] == ["train"]:
    import torch
    model = torch.nn.Linear(4, 4)
    model(torch.ones(1, 4)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    sys.stdin.readline()
"""


@pytest.mark.parametrize("pythonpath", [None, "", "user"])
def test_a_cold_worker_reports_and_sees_what_torchrun_gives_it(
    tmp_path: Path, agent: Agent, processes: list[subprocess.Popen[str]], pythonpath: str | None
) -> None:
    """``python -u SCRIPT`` as torchrun runs it, with and without the startup folder: the
    same PYTHONPATH (unset, empty, the user's), sys.path, and the user's sitecustomize."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import sys\nsys.user_sitecustomize = True\n")
    path = tmp_path / "look.py"
    path.write_text(LOOK)
    env = agent.environment()
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(user) if pythonpath == "user" else pythonpath
    (plain,) = run(path, env)
    worker = subprocess.Popen(
        [sys.executable, "-u", str(path), "train"], env=cold_start_environment(env),
        cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    processes.append(worker)
    assert worker.stdout is not None
    assert json.loads(worker.stdout.readline()) == plain
    assert plain["PYTHONPATH"] == env.get("PYTHONPATH") and not plain["saved"]
    assert plain["user_sitecustomize"] == (pythonpath == "user")
    assert agent.until(lambda r: r["armed"])["signals"] >= 1
    _, errors = worker.communicate("\n", timeout=30)
    assert worker.returncode == 0 and errors == ""


def test_the_startup_folder_holds_only_the_shim() -> None:
    assert sorted(p.name for p in Path(STARTUP).iterdir() if p.suffix == ".py") == [
        "sitecustomize.py"
    ]
    from rallypoint.worker.startup import sitecustomize  # imported, not run: it does nothing

    assert sitecustomize.SAVED_PYTHONPATH == variables.SAVED_PYTHONPATH


@pytest.mark.parametrize(
    ("before", "pythonpath", "saved"),
    [
        (None, STARTUP, None),
        ("", STARTUP, ""),
        ("/a:/b", f"{STARTUP}:/a:/b", "/a:/b"),
    ],
)
def test_the_cold_environment_keeps_the_workers_pythonpath(
    before: str | None, pythonpath: str, saved: str | None
) -> None:
    environ = {"HOME": "/home/x", variables.SAVED_PYTHONPATH: "stale"}
    if before is not None:
        environ["PYTHONPATH"] = before
    cold = cold_start_environment(environ)
    assert cold["PYTHONPATH"] == pythonpath and cold["HOME"] == "/home/x"
    assert cold.get(variables.SAVED_PYTHONPATH) == saved
    assert cold_start_environment(cold) == cold  # twice is once


@pytest.mark.usefixtures("agent_tmpdir")
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_workers_the_agent_starts_report(tmp_path: Path, agent: Agent, warm: bool) -> None:
    """Through the agent's own way to start workers (``WarmStart``): forked from the
    preloaded interpreter, the fork installs the sources; started cold, the shim does."""
    train = tmp_path / "train.py"
    train.write_text(
        "import os, sys, time\n"
        "print('preloaded' if 'torch' in sys.modules else 'fresh', flush=True)\n"
        "import torch\n"
        "model = torch.nn.Linear(4, 4)\n"
        "model(torch.ones(1, 4)).sum().backward()\n"
        "torch.optim.SGD(model.parameters(), lr=0.1).step()\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
    )
    stop = tmp_path / "stop"
    registry = build_plugin_manager({}).registry
    flags: dict[str, Any] = {} if warm else {"warm_start": "off"}
    config = LaunchConfig.from_flags(
        registry, training_script=str(train), training_script_args=[str(stop)],
        standalone=True, **flags,
    )  # fmt: skip
    error_file = str(tmp_path / "error.json")
    info = RoundInfo(0, 0, 1, 1, "127.0.0.1", free_port(), ("node",))
    env = worker_environment(
        config, Assignment(info, (1,)), 0, error_file, node_id="node", restart_count=0
    )
    env.update(agent.environment(interval="0.05"))
    spec = WorkerSpec(0, 0, env, WorkerLogs(3, None, None, error_file))
    starter, keeper = WarmStart(config), Keeper()
    read, write = os.pipe()
    try:
        starter.prepare(keeper)
        pid = starter.spawn(keeper, spec, write, write)
        os.close(write)
        assert agent.until(lambda r: r["armed"])["rank"] == 0
        stop.touch()
        assert wait_until(lambda: pid in keeper.exits or keeper.pump(0.1) is not None, 60)
        output = os.read(read, 65536).decode()
        assert keeper.exits[pid][0] == 0, output
        assert output.split() == ["preloaded" if warm else "fresh"]
    finally:
        os.close(read)
        keeper.close()


# --- the state, in this process -----------------------------------------------------------------


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> progress.ProgressState:
    fresh = progress.ProgressState()
    monkeypatch.setattr(progress, "state", fresh)
    return fresh


@pytest.fixture
def received(
    monkeypatch: pytest.MonkeyPatch, state: progress.ProgressState
) -> Iterator[queue.Queue[dict[str, Any]]]:
    """What an agent's receiver gets from this process, acting as a worker."""
    made = Agent()
    monkeypatch.setenv(channel.ENV, made.receiver.address)
    monkeypatch.setenv("LOCAL_RANK", "1")
    yield made.reports
    made.receiver.close()


def test_a_new_step_reaches_the_agent_at_once_with_the_workers_clock(
    received: queue.Queue[dict[str, Any]],
) -> None:
    before = time.monotonic()
    rallypoint.progress(step=3)
    report = received.get(timeout=10)
    assert report["local_rank"] == 1
    assert report["step"] == 3 and report["armed"] is True
    assert before <= report["step_at"] == report["sent"] <= time.monotonic()


def test_progress_without_a_step_only_counts(
    received: queue.Queue[dict[str, Any]], state: progress.ProgressState
) -> None:
    """The reporter's thread sends the count (``rallypoint.worker.progress_reporter``)."""
    for _ in range(1000):
        rallypoint.progress()
    assert state.signals == 1000 and state.armed
    rallypoint.progress(step=1)
    assert received.get(timeout=10)["signals"] == 1001  # the first datagram is the step's
    assert received.empty()


def test_new_steps_are_rate_limited(
    received: queue.Queue[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SimpleNamespace(monotonic=lambda: 1000.0)
    monkeypatch.setattr(progress, "time", clock)
    rallypoint.progress(step=1)
    rallypoint.progress(step=1)  # the same step: nothing new
    clock.monotonic = lambda: 1000.005  # a new step within STEP_GAP: the next report's
    rallypoint.progress(step=2)
    clock.monotonic = lambda: 1000.02
    rallypoint.progress(step=3)
    steps = [received.get(timeout=10) for _ in range(2)]
    assert [(r["step"], r["step_at"]) for r in steps] == [(1, 1000.0), (3, 1000.02)]
    assert received.empty()


def test_heartbeat_is_progress() -> None:
    """The earlier name, kept for scripts that call it."""
    assert rallypoint.heartbeat is rallypoint.progress is progress.progress
    assert {"heartbeat", "progress"} <= set(rallypoint.__all__)


def test_progress_without_an_agent_is_harmless(
    monkeypatch: pytest.MonkeyPatch, state: progress.ProgressState
) -> None:
    monkeypatch.setenv(channel.ENV, "rallypoint-nobody-listens-here")
    rallypoint.progress(step=1)  # no receiver: dropped, no error
    monkeypatch.delenv(channel.ENV)
    rallypoint.progress(step=2)  # outside rallypoint run
    assert state.reached is not None and state.reached[0] == 2


def test_the_outermost_phase_of_the_main_thread_counts(state: progress.ProgressState) -> None:
    def from_a_helper_thread() -> list[bool]:
        entered: list[bool] = []
        helper = threading.Thread(target=lambda: entered.append(progress.enter_phase("x")))
        helper.start()
        helper.join(10)
        return entered

    with progress.phase(progress.CHECKPOINT_SAVE):
        outer = state.phase
        with progress.phase(progress.CHECKPOINT_LOAD):
            assert state.phase == outer  # a load inside the save: still the save
        assert state.phase == outer and state.signals == 0
    assert outer is not None and outer[0] == progress.CHECKPOINT_SAVE
    assert state.phase is None and state.signals == 1
    assert from_a_helper_thread() == [False]  # a helper's save does not hold up the loop
    assert state.phase is None


def test_reports_count_only_forward(state: progress.ProgressState) -> None:
    """``signals`` in reports never goes back, even were a racy increment lost; and
    ``progressed`` moves only with it."""
    assert state.report(10.0)["progressed"] is None
    state.signals = 5
    assert (state.report(11.0)["signals"], state.report(12.0)["progressed"]) == (5, 11.0)
    state.signals = 4  # two threads' increments, one lost
    assert (state.report(13.0)["signals"], state.report(13.0)["progressed"]) == (6, 13.0)


def test_a_site_is_the_first_frame_outside_torch_and_rallypoint() -> None:
    """A collective called from torch (here ``tree_map``), through rallypoint's wrapper:
    the site is the line of this file that called torch."""
    import torch.utils._pytree as pytree

    def original(leaf: object) -> str | None:
        waiting = progress_sources._state.collective
        assert waiting is not None and waiting[0] == "all_reduce"
        return progress.site(waiting[1])

    wrapped = progress_sources._in_collective("all_reduce", original)
    line = sys._getframe().f_lineno + 1
    assert pytree.tree_map(wrapped, [0]) == [f"test_progress_sources.py:{line}"]
    assert progress_sources._state.collective is None
    assert progress.site(sys._getframe()) == f"test_progress_sources.py:{line + 2}"


def test_a_site_is_past_an_installed_framework_s_frames_to_the_script() -> None:
    """A framework (Lightning's loop, Accelerate's ``backward``) is installed: the site is
    the script's line that called into it."""
    framework = os.path.join(progress._INSTALLED[0], "a_framework_of_the_test.py")
    namespace: dict[str, object] = {"progress": progress, "sys": sys}
    source = "def fit(callback):\n    return callback(sys._getframe())\n"
    exec(compile(source, framework, "exec"), namespace)  # code "installed" in site-packages
    fit = namespace["fit"]
    line = sys._getframe().f_lineno + 1
    assert fit(progress.site) == f"test_progress_sources.py:{line}"  # type: ignore[operator]


def test_a_collective_a_gpu_has_yet_to_finish_is_reported_until_it_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On NCCL the call returns before the collective completes: the CUDA events recorded
    after each call say which one a rank still waits for (the GPU check runs it on CUDA).
    Each query is made with the event's device current in the reporter's thread."""
    import torch

    devices: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)

    class Event:
        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

    first, second = Event(), Event()
    state = progress.ProgressState()
    state.pending.extend(
        [("all_reduce", "train.py:88", 1.0, first, 1), ("broadcast", "train.py:90", 2.0, second, 1)]
    )
    report = state.report(5.0)
    assert report["collective"] == {"op": "all_reduce", "site": "train.py:88", "since": 1.0}
    first.done = True
    assert state.report(6.0)["collective"]["op"] == "broadcast"
    assert len(state.pending) == 1  # the finished one is dropped
    second.done = True
    assert state.report(7.0)["collective"] is None and not state.pending
    assert set(devices) == {1}
    state.collective = ("barrier", sys._getframe(), 8.0)  # blocked on the CPU: said first
    state.pending.append(("all_reduce", "train.py:88", 7.5, Event(), 0))
    assert state.report(9.0)["collective"]["op"] == "barrier"

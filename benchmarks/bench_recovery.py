"""Recovery after a node is killed or preempted: rallypoint against torchrun, side by side.

    .venv/bin/python benchmarks/bench_recovery.py [--repeat 3] [--cap 120] [--kill agent]
    .venv/bin/python benchmarks/bench_recovery.py --kill preempt
    .venv/bin/python benchmarks/bench_recovery.py [--kill preempt] --render-only

Two agents on this machine form one c10d job over loopback (``--nnodes 1:2
--nproc-per-node 2 --max-restarts 3``), running ``tests/workers/steps.py`` (gloo, an
all-reduce every 0.2 s, each step printed with its world size and a wall-clock time). The
first agent hosts the store; once its workers train with ``world=4`` the second agent's
process is SIGKILLed (``--kill agent``; ``--kill node`` kills its workers with it), or
sent SIGTERM (``--kill preempt``: a spot instance or a scheduler preempting the node), and
the time runs from the signal to the first step the surviving agent's workers complete
with ``world=2``. A run that gets there within ``--cap`` seconds
recovered; one that does not is recorded as "did not recover". Runs alternate between the
launchers (A B, then B A), so machine noise hits both alike.

After each run the benchmark records whether a worker of the killed node was still running
(an orphan), then kills both agents' process groups and every process carrying the run's
tag, and checks that none is left.

Results go to ``benchmarks/results/recovery.json`` and ``docs/benchmarks-recovery.md``
with a chart in ``docs/img/bench_node_kill_recovery.png``; the preemption's to
``recovery-preempt.json``, ``benchmarks-recovery-preempt.md`` and
``bench_preempt_recovery.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import common
from common import IMAGES, ROOT

BIN = Path(sys.executable).parent
WORKER = ROOT / "tests" / "workers" / "steps.py"


@dataclass(frozen=True)
class Scenario:
    """Where one kind of failure's results go, and how its page names the failure."""

    results: Path
    report: Path
    chart: Path
    title: str  # "a node is killed"
    signal: str  # what happens to the second node, as the page's sentences say it
    lost: str  # the second node, as the page's table calls it


KILLED = Scenario(
    ROOT / "benchmarks" / "results" / "recovery.json",
    ROOT / "docs" / "benchmarks-recovery.md",
    IMAGES / "bench_node_kill_recovery.png",
    "a node is killed",
    "SIGKILL",
    "killed node",
)
PREEMPTED = Scenario(
    ROOT / "benchmarks" / "results" / "recovery-preempt.json",
    ROOT / "docs" / "benchmarks-recovery-preempt.md",
    IMAGES / "bench_preempt_recovery.png",
    "a node is preempted",
    "SIGTERM",
    "preempted node",
)
SCENARIOS = {"agent": KILLED, "node": KILLED, "preempt": PREEMPTED}
#: Seconds a preempted agent has to stop its workers and leave before it is SIGKILLed.
LEAVE_WAIT = 30.0
HOST = "127.0.0.1"
LAUNCHERS = ("rallypoint", "torchrun")
COMMANDS = {
    "rallypoint": [str(BIN / "rallypoint"), "run"],
    "torchrun": [str(BIN / "torchrun")],
}
# Both declare a node dead 3 s after its last heartbeat. rallypoint beats every
# heartbeat_timeout / 3. torch's c10d rendezvous has no key for the dead-node timeout: it
# is keep_alive_interval * keep_alive_max_attempt (defaults 5 s * 3); its own
# `heartbeat_timeout` key is the deadline of one keep-alive store write, not the same thing.
RDZV_CONF = {
    "rallypoint": "heartbeat_timeout=3,last_call_timeout=1",
    "torchrun": "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
}
# torch shares one TCPStore server per agent with the workers (the default since 2.4), and
# computes the workers' MASTER_ADDR/MASTER_PORT only in the agent's first round: when a node
# joins and the old rank 0 stays rank 0, it never publishes them for the new round, and the
# new node waits for them forever (RendezvousStoreInfo.build), so the job never scales up
# from 2 to 4 workers. torch's switch back to a store per round lets the scenario run at all.
TORCHRUN_WORKAROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
STEP = re.compile(r"step rank=(\d+) world=(\d+) sum=\d+ at=([\d.]+)")
STORE_WAIT = 60.0  # seconds for the first agent to open the store's port
CLEANUP_WAIT = 30.0  # seconds for killed processes to disappear


@dataclass
class Sample:
    """One kill-and-recover run of one launcher."""

    launcher: str
    status: str  # "recovered", "did not recover" or "failed to start"
    recovery_seconds: float | None  # kill -> first world=2 step of the survivor's workers
    seconds_to_world4: float | None  # first agent started -> its workers at world=4
    orphans: int  # workers of the killed node still running when the measurement ended
    orphans_after_grace: int  # ... and after a further grace period
    survivor_returncode: int | None  # set if the surviving agent exited during the run
    leftovers_after_cleanup: int  # processes carrying the run's tag after the cleanup
    commands: list[list[str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set on top of this process's
    # Steps the survivor's workers completed still with world=4 after the kill (with the
    # killed node's orphaned workers), and the last one's time after the kill.
    world4_steps_after_kill: int = 0
    world4_until: float | None = None
    load_at_kill: float | None = None  # 1-minute load average of the machine
    error: str | None = None
    survivor_log_tail: str = ""  # kept when the run did not recover
    victim_returncode: int | None = None  # how the signalled agent exited


# --- the harness --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def clean_environment() -> dict[str, str]:
    """This process's environment without launcher settings (as tests/launch.py does)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RALLYPOINT_", "PET_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }


def agent_command(launcher: str, port: int, run_id: str, seconds: int, tag: str) -> list[str]:
    return [
        *COMMANDS[launcher],
        "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{HOST}:{port}", "--rdzv-id", run_id,
        "--rdzv-conf", RDZV_CONF[launcher],
        str(WORKER), str(seconds), tag,
    ]  # fmt: skip


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as handle:
        # A session of its own, so that the agent and whatever shares its group can be
        # killed together; torchrun's workers sit in sessions of their own and are found
        # by their tag instead.
        return subprocess.Popen(
            command,
            env={**clean_environment(), **env},
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((HOST, port)) == 0


class Log:
    """Reads an agent's output as it grows, a line at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def new_lines(self) -> list[str]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        return [line.decode(errors="replace") for line in lines]

    def tail(self, lines: int = 40) -> str:
        text = self.path.read_bytes().decode(errors="replace") if self.path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def tagged(tag: str, exclude: set[int]) -> list[int]:
    """Processes whose command line contains ``tag`` (``pgrep -f``), but not ``exclude``."""
    found = subprocess.run(
        ["pgrep", "-f", "--", tag], capture_output=True, text=True, timeout=10
    ).stdout.split()
    return [pid for pid in map(int, found) if pid not in exclude and pid != os.getpid()]


def kill_everything(agents: list[subprocess.Popen[bytes]], tag: str) -> int:
    """SIGKILL both agents' process groups and every process with the run's tag; return how
    many tagged processes are still there after CLEANUP_WAIT (0 unless something is stuck)."""
    for agent in agents:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, signal.SIGKILL)
    deadline = time.monotonic() + CLEANUP_WAIT
    left: list[int] = []
    while time.monotonic() < deadline:
        for agent in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=0.05)
        left = tagged(tag, exclude=set())
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                group = os.getpgid(pid)
                if group != os.getpgrp():
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    for agent in agents:
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=5)
    return len(left)


def remove_agent_tempdirs(run_id: str) -> None:
    """SIGKILLed agents cannot clean up their log folders: rallypoint's
    ``rallypoint-<run id>-*``, torchrun's ``torchelastic_*/<run id>_*``."""
    base = Path(tempfile.gettempdir())
    for path in base.glob(f"rallypoint-{run_id}-*"):
        shutil.rmtree(path, ignore_errors=True)
    for path in base.glob(f"torchelastic_*/{run_id}_*"):
        shutil.rmtree(path.parent, ignore_errors=True)


def wait_until(condition: Callable[[], object], deadline: float, interval: float = 0.1) -> bool:
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())


def worker_seconds(cap: float, start_cap: float) -> int:
    return int(start_cap + cap + 60)


def measure_once(
    launcher: str, cap: float, start_cap: float, orphan_grace: float, env: dict[str, str], kill: str
) -> Sample:
    """One run: two agents, world=4, SIGKILL (or, ``preempt``, SIGTERM) the second, wait
    for world=2 (at most ``cap``)."""
    port = free_port()
    unique = uuid.uuid4().hex[:10]
    run_id = f"bench-recovery-{unique}"
    tag = f"rpbench-{unique}"  # on every worker's and agent's command line
    survivor_tag, victim_tag = f"{tag}-survivor", f"{tag}-victim"
    # Workers must outlast the measurement: the startup, the kill and the full cap.
    seconds = worker_seconds(cap, start_cap)
    commands = [
        agent_command(launcher, port, run_id, seconds, survivor_tag),
        agent_command(launcher, port, run_id, seconds, victim_tag),
    ]
    workdir = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    survivor_log = Log(workdir / "survivor.log")
    agents: list[subprocess.Popen[bytes]] = []
    sample = Sample(launcher, "failed to start", None, None, 0, 0, None, 0, commands, env)
    try:
        began = time.time()
        survivor = start(commands[0], env, survivor_log.path)
        agents.append(survivor)
        # The first agent hosts the c10d store; losing the host would end the job.
        if (
            not wait_until(
                lambda: port_open(port) or survivor.poll() is not None,
                time.monotonic() + STORE_WAIT,
                0.05,
            )
            or survivor.poll() is not None
        ):
            sample.error = f"the first agent did not open the store on port {port}"
            sample.survivor_log_tail = survivor_log.tail()
            return sample
        victim = start(commands[1], env, workdir / "victim.log")
        agents.append(victim)

        world4: list[float] = []

        def at_world4() -> bool:
            for line in survivor_log.new_lines():
                match = STEP.search(line)
                if match and match.group(2) == "4":
                    world4.append(float(match.group(3)))
            return bool(world4) or survivor.poll() is not None or victim.poll() is not None

        if not wait_until(at_world4, time.monotonic() + start_cap) or not world4:
            sample.error = f"the two agents did not reach world=4 within {start_cap:.0f} s"
            sample.survivor_log_tail = survivor_log.tail()
            return sample
        sample.seconds_to_world4 = world4[0] - began

        # "node": the agent and its workers at once, as when a machine is lost. "agent": the
        # agent process only, as the brief's scenario; its workers are then on their own.
        victim_workers = tagged(victim_tag, {victim.pid}) if kill == "node" else []
        sample.load_at_kill = os.getloadavg()[0]
        killed_at = time.time()
        if kill == "preempt":  # the agent alone: it is to stop its workers and leave
            victim.send_signal(signal.SIGTERM)
        else:
            victim.kill()
        for pid in victim_workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            sample.victim_returncode = victim.wait(timeout=LEAVE_WAIT)
        except subprocess.TimeoutExpired:
            sample.error = f"the preempted agent was still running {LEAVE_WAIT:.0f} s later"
            victim.kill()
            victim.wait(timeout=CLEANUP_WAIT)
        resumed: list[float] = []
        old_world: list[float] = []

        def at_world2() -> bool:
            for line in survivor_log.new_lines():
                match = STEP.search(line)
                if not match or float(match.group(3)) < killed_at:
                    continue
                if match.group(2) == "2":
                    resumed.append(float(match.group(3)))
                elif match.group(2) == "4":
                    old_world.append(float(match.group(3)))
            return bool(resumed) or survivor.poll() is not None

        wait_until(at_world2, time.monotonic() + cap)
        sample.survivor_returncode = survivor.poll()
        sample.world4_steps_after_kill = len(old_world)
        sample.world4_until = max(old_world) - killed_at if old_world else None
        agent_pids = {survivor.pid, victim.pid}
        sample.orphans = len(tagged(victim_tag, agent_pids))
        if sample.orphans:
            wait_until(
                lambda: not tagged(victim_tag, agent_pids), time.monotonic() + orphan_grace, 0.5
            )
            sample.orphans_after_grace = len(tagged(victim_tag, agent_pids))
        if resumed and resumed[0] - killed_at <= cap:
            sample.status = "recovered"
            sample.recovery_seconds = resumed[0] - killed_at
        else:
            sample.status = "did not recover"
            if sample.survivor_returncode is not None:
                sample.error = f"the surviving agent exited with {sample.survivor_returncode}"
            sample.survivor_log_tail = survivor_log.tail()
        return sample
    finally:
        sample.leftovers_after_cleanup = kill_everything(agents, tag)
        shutil.rmtree(workdir, ignore_errors=True)
        remove_agent_tempdirs(run_id)


# --- the run ------------------------------------------------------------------------------


def measure(
    repeat: int,
    cap: float,
    start_cap: float,
    orphan_grace: float,
    envs: dict[str, dict[str, str]],
    kill: str,
) -> dict[str, list[Sample]]:
    samples: dict[str, list[Sample]] = {name: [] for name in LAUNCHERS}
    for index in range(repeat):
        # A B, then B A: neither launcher always runs first after the other's cleanup.
        order = LAUNCHERS if index % 2 == 0 else tuple(reversed(LAUNCHERS))
        for name in order:
            sample = measure_once(name, cap, start_cap, orphan_grace, envs[name], kill)
            samples[name].append(sample)
            shown = (
                f"{sample.recovery_seconds:.2f} s"
                if sample.recovery_seconds is not None
                else sample.status
            )
            extra = f"; {sample.orphans} orphan(s)" if sample.orphans else ""
            extra += f"; {sample.error}" if sample.error else ""
            print(f"{name:10} run {index + 1}/{repeat}: {shown}{extra}", flush=True)
    return samples


def summarise(samples: list[Sample]) -> dict[str, Any]:
    times = [s.recovery_seconds for s in samples if s.recovery_seconds is not None]
    return {
        "runs": len(samples),
        "recovered": len(times),
        "did_not_recover": sum(s.status == "did not recover" for s in samples),
        "failed_to_start": sum(s.status == "failed to start" for s in samples),
        "median_recovery_seconds": statistics.median(times) if times else None,
        "min_recovery_seconds": min(times) if times else None,
        "max_recovery_seconds": max(times) if times else None,
        "runs_with_orphans": sum(s.orphans > 0 for s in samples),
        "runs_with_orphans_after_grace": sum(s.orphans_after_grace > 0 for s in samples),
        # A step in flight at the kill may still complete; more than a second later, the
        # survivors are training on with the killed node's orphaned workers.
        "runs_still_at_world4_after_kill": sum(
            s.world4_until is not None and s.world4_until > 1.0 for s in samples
        ),
        "max_world4_seconds_after_kill": max(
            (s.world4_until for s in samples if s.world4_until is not None), default=None
        ),
        "runs_with_leftovers_after_cleanup": sum(s.leftovers_after_cleanup > 0 for s in samples),
    }


def ratio(summary: dict[str, dict[str, Any]], cap: float) -> dict[str, Any]:
    """rallypoint / torchrun of the median recovery time. If torchrun never recovered, its
    time is over the cap and the ratio is at most rallypoint's median / cap."""
    ours = summary["rallypoint"]["median_recovery_seconds"]
    theirs = summary["torchrun"]["median_recovery_seconds"]
    if ours is not None and theirs:
        return {"value": ours / theirs, "bound": "exact"}
    if ours is not None and summary["torchrun"]["did_not_recover"]:
        return {"value": ours / cap, "bound": "at most"}
    return {"value": None, "bound": "n/a"}


# --- the report ---------------------------------------------------------------------------


def chart(results: dict[str, Any]) -> str:
    scenario = SCENARIOS[results["kill"]]
    plt = common.pyplot()
    cap = float(results["cap_seconds"])
    colors = {"rallypoint": "#2b7bba", "torchrun": "#999999"}
    figure, axis = plt.subplots(figsize=(6.4, 3.0))
    for row, name in enumerate(LAUNCHERS):
        summary = results["summary"][name]
        median = summary["median_recovery_seconds"]
        if median is not None:
            axis.barh(row, median, color=colors[name], alpha=0.8, height=0.6)
            axis.annotate(
                f"median {median:.2f} s",
                (median, row),
                textcoords="offset points",
                xytext=(6, 10),
                fontsize=8,
            )
        samples = results["samples"][name]
        ok = [s["recovery_seconds"] for s in samples if s["recovery_seconds"] is not None]
        axis.plot(ok, [row] * len(ok), "o", color="black", markersize=4, zorder=3)
        failed = sum(s["status"] != "recovered" for s in samples)
        if failed:
            axis.plot([cap], [row], "x", color="#d62728", markersize=10, zorder=3)
            axis.annotate(
                f"{failed} of {len(samples)} did not recover within {cap:.0f} s",
                (cap, row),
                textcoords="offset points",
                xytext=(-8, -14),
                ha="right",
                fontsize=8,
                color="#d62728",
            )
    axis.set_yticks(range(len(LAUNCHERS)))
    axis.set_yticklabels(list(LAUNCHERS))
    axis.invert_yaxis()
    axis.margins(x=0.1, y=0.3)
    axis.set_xlim(left=0)
    axis.set_xlabel(
        f"seconds from the {scenario.signal} of one node to the survivors training again"
    )
    axis.set_title(f"Recovery after {scenario.title} (bars: median; dots: runs)")
    axis.grid(True, axis="x", alpha=0.3)
    return common.save_chart(figure, scenario.chart)


def findings(results: dict[str, Any]) -> list[str]:
    """What the numbers say, in words, for the cases this benchmark has met."""
    summary, cap = results["summary"], float(results["cap_seconds"])
    lines: list[str] = []
    torch = summary["torchrun"]
    if results["kill"] == "agent" and torch["runs_still_at_world4_after_kill"]:
        lines += [
            f"In {torch['runs_still_at_world4_after_kill']} of {torch['runs']} torchrun runs the",
            "killed agent's workers lived on: torchrun starts each worker in a session of its",
            "own and nothing ties it to the agent, so they kept all-reducing with the",
            "survivors at `world=4` (the latest such step came "
            f"{torch['max_world4_seconds_after_kill']:.0f} s after the kill). The surviving",
            "agent saw healthy workers and never began a new round, so the job went on with",
            "a node that no agent supervises; it would only notice once such a worker",
            "failed. rallypoint starts workers with `PR_SET_PDEATHSIG` = SIGKILL: they die",
            "with their agent, the survivors' next all-reduce fails, and they re-form at",
            "`world=2`.",
            "",
        ]
    exits = [s for s in results["samples"]["torchrun"] if s["survivor_returncode"] is not None]
    if results["kill"] == "preempt":
        codes_of = {
            name: sorted({s.get("victim_returncode") for s in results["samples"][name]}, key=str)
            for name in LAUNCHERS
        }
        if codes_of["rallypoint"] != codes_of["torchrun"]:
            lines += [
                "The preempted agent exited with "
                + " and ".join(
                    f"{', '.join(map(str, codes_of[name]))} ({name})" for name in LAUNCHERS
                )
                + ": 143 is 128 + 15, the shell's convention for a process stopped by",
                "SIGTERM, so that a script or a scheduler's record tells a stopped node from a",
                "failed job.",
                "",
            ]
    if results["kill"] == "preempt" and exits:
        closed = sum("closed" in s["survivor_log_tail"].lower() for s in exits)
        codes = sorted({s["survivor_returncode"] for s in exits})
        lines += [
            f"In {len(exits)} of {torch['runs']} torchrun runs the surviving agent exited (exit",
            f"code {', '.join(map(str, codes))}) instead of re-forming the job at `world=2`"
            + (
                f"; in {closed} its log says the rendezvous was closed: torch's agent, stopped "
                "by SIGTERM, shuts its rendezvous handler down, which closes the rendezvous "
                "for every node of the job (`DynamicRendezvousHandler.shutdown`)."
                if closed
                else "."
            ),
            "rallypoint's agent, stopped by SIGTERM, stops its workers and leaves the",
            "rendezvous (its liveness ends at once); the survivors re-form without it.",
            "",
        ]
    if torch["recovered"] == 0 and torch["did_not_recover"] and summary["rallypoint"]["recovered"]:
        lines += [
            f"torchrun did not recover in any run within {cap:.0f} s, so the ratio is an",
            "upper bound (rallypoint's median over the cap).",
            "",
        ]
    if lines:
        lines = ["## Findings", "", *lines, "## What is measured", ""]
    else:
        lines = ["## What is measured", ""]
    return lines


def lingered(results: dict[str, Any]) -> int:
    """Runs whose signalled agent had not exited after LEAVE_WAIT seconds."""
    return sum(
        "still running" in (s["error"] or "") for n in LAUNCHERS for s in results["samples"][n]
    )


def render(results: dict[str, Any]) -> str:
    scenario = SCENARIOS[results["kill"]]
    summary = results["summary"]
    cap = float(results["cap_seconds"])

    def seconds(value: Any) -> str:
        return f"{value:.2f} s" if isinstance(value, (int, float)) else "n/a"

    def median_cell(name: str) -> str:
        data = summary[name]
        if data["median_recovery_seconds"] is None:
            return f"did not recover (> {cap:.0f} s)"
        return seconds(data["median_recovery_seconds"])

    r = results["ratio"]
    ratio_cell = {
        "exact": f"{r['value']:.2f}x" if r["value"] is not None else "n/a",
        "at most": f"≤ {r['value']:.2f}x" if r["value"] is not None else "n/a",
        "n/a": "n/a",
    }[r["bound"]]

    def runs(name: str) -> str:
        return ", ".join(
            f"{s['recovery_seconds']:.2f}" if s["recovery_seconds"] is not None else s["status"]
            for s in results["samples"][name]
        )

    def exits(name: str) -> str:
        return ", ".join(str(s.get("victim_returncode")) for s in results["samples"][name])

    def loads(name: str) -> str:
        return ", ".join(
            f"{s['load_at_kill']:.0f}" if s.get("load_at_kill") is not None else "-"
            for s in results["samples"][name]
        )

    rows = [
        ("Median recovery time", median_cell("rallypoint"), median_cell("torchrun"), ratio_cell),
        (
            "Fastest / slowest recovery",
            f"{seconds(summary['rallypoint']['min_recovery_seconds'])} / "
            f"{seconds(summary['rallypoint']['max_recovery_seconds'])}",
            f"{seconds(summary['torchrun']['min_recovery_seconds'])} / "
            f"{seconds(summary['torchrun']['max_recovery_seconds'])}",
            "",
        ),
        (
            f"Runs that recovered within {cap:.0f} s",
            f"{summary['rallypoint']['recovered']} of {summary['rallypoint']['runs']}",
            f"{summary['torchrun']['recovered']} of {summary['torchrun']['runs']}",
            "",
        ),
        (
            f"Runs leaving a worker of the {scenario.lost} running",
            f"{summary['rallypoint']['runs_with_orphans']} of {summary['rallypoint']['runs']}",
            f"{summary['torchrun']['runs_with_orphans']} of {summary['torchrun']['runs']}",
            "",
        ),
        (
            "Runs where the survivors trained on at `world=4` (with the orphans) > 1 s "
            f"after the {scenario.signal}; latest such step",
            f"{summary['rallypoint']['runs_still_at_world4_after_kill']} of "
            f"{summary['rallypoint']['runs']}; "
            f"{seconds(summary['rallypoint']['max_world4_seconds_after_kill'])}",
            f"{summary['torchrun']['runs_still_at_world4_after_kill']} of "
            f"{summary['torchrun']['runs']}; "
            f"{seconds(summary['torchrun']['max_world4_seconds_after_kill'])}",
            "",
        ),
        ("Every run, seconds", runs("rallypoint"), runs("torchrun"), ""),
        *(
            [("Exit code of the preempted agent", exits("rallypoint"), exits("torchrun"), "")]
            if results["kill"] == "preempt"
            else []
        ),
        ("1-minute load average at each kill", loads("rallypoint"), loads("torchrun"), ""),
    ]
    if results["env"]["torchrun"]:
        torchrun_env = [
            "torchrun also runs with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`. Without it, torch",
            f"{results['torch']} does not get the job from one node to two: the agent shares one",
            "TCPStore server with its workers and publishes their `MASTER_ADDR`/`MASTER_PORT`",
            "only in its first round, so when the second node joins and the first stays rank 0,",
            "the newcomer waits for them (in `RendezvousStoreInfo.build`) while the first agent",
            "waits for the newcomer; in trials no worker reached `world=4` within the cap.",
            "The variable is torch's own switch back to a fresh store per round; it changes",
            "nothing else. `--torchrun-shared-store` measures torch's default instead.",
            "",
        ]
    else:
        torchrun_env = [
            "torchrun runs with torch's default shared TCPStore (`--torchrun-shared-store`).",
            "",
        ]
    started = [
        s["status"] != "failed to start" for name in LAUNCHERS for s in results["samples"][name]
    ]
    lines = [
        f"# Recovery benchmark: {scenario.title}",
        "",
        "Generated by `benchmarks/bench_recovery.py`; do not edit by hand.",
        "rallypoint and torchrun run alternately in one session on the same machine, so both",
        "see the same noise. The ratio is rallypoint / torchrun (below 1: rallypoint is faster).",
        "",
        f"- Measured: {results['date']} on {results['machine']}",
        f"- Python {results['python']}, torch {results['torch']}; rallypoint {results['git']}",
        f"- Command: `{results['command']}`",
        f"- Load average before / after: {results['load_before']} / {results['load_after']}",
        "",
        f"Time from the {scenario.signal} of one of two nodes to the survivors' first training "
        f"step in the smaller world; {results['repeat']} runs per launcher.",
        "",
        "| measurement | rallypoint | torchrun | ratio |",
        "|---|---|---|---|",
    ]
    lines += [f"| {label} | {a} | {b} | {c} |" for label, a, b, c in rows]
    if not all(started):
        lines += [
            "",
            f"Some runs failed to start (no `world=4` within {results['start_cap_seconds']:.0f} s"
            "); they count in no row but the last. See the JSON for the agents' output.",
        ]
    lines += [
        "",
        f"![Recovery after {scenario.title}]({results['chart']})",
        "",
        *findings(results),
        "Two agents of one job run on this machine over loopback, each starting two gloo",
        "workers (`tests/workers/steps.py`: an all-reduce every 0.2 s, each step printed with",
        "the world size and the wall-clock time it completed). The first agent is started and",
        "hosts the c10d store (the benchmark waits until its port accepts connections), then",
        "the second. Once the first agent's workers print a step with `world=4`, the second",
        *{
            "agent": [
                "agent's process gets SIGKILL (`--kill agent`): the agent only, not its workers,",
                "as when the agent is OOM-killed or crashes. The",
            ],
            "node": [
                "agent's process and its workers get SIGKILL at the same instant (`--kill",
                "node`), as when the machine is lost. The",
            ],
            "preempt": [
                "agent's process gets SIGTERM (`--kill preempt`), as when a spot instance or a",
                "scheduler preempts the node: the agent is to stop its workers and leave (it is",
                f"SIGKILLed if it still runs {LEAVE_WAIT:.0f} s later: "
                + (f"{late} did" if (late := lingered(results)) else "none did")
                + "). The",
            ],
        }[results["kill"]],
        f"recovery time runs from the {scenario.signal} to the first step that a worker of the",
        "surviving agent completes with `world=2`: the failure has been noticed, the old",
        "workers stopped, a new rendezvous round formed without the lost node, new workers",
        "started, their process group formed and one all-reduce done. Both times come from",
        "the same wall clock (the benchmark's `time.time()` at the signal, the worker's at",
        "the step).",
        "",
        f'A run that does not get there within {cap:.0f} s (`--cap`) counts as "did not',
        'recover" and takes no part in the median; torchrun is known to hang in some such',
        "cases (pytorch issues #111646 and #76287). If torchrun recovered in no run at all,",
        "the ratio shown is an upper bound: rallypoint's median over the cap.",
        "",
        "An orphan is a worker process of the killed node (found with `pgrep -f` on the tag",
        "its command line carries) still running at the end of the measurement, i.e. at the",
        "survivors' first `world=2` step or at the cap. After every run the benchmark SIGKILLs",
        "both agents' process groups and every process carrying the run's tag, and checks",
        "that none is left"
        + (
            "; none was."
            if not any(
                s["leftovers_after_cleanup"] for n in LAUNCHERS for s in results["samples"][n]
            )
            else ": **some were** (see the JSON)."
        ),
        "",
        "## How",
        "",
        "Both launchers get the same command line but for the rendezvous settings:",
        "",
        "```",
        results["command_templates"]["rallypoint"],
        results["command_templates"]["torchrun"],
        "```",
        "",
        "Both declare a node dead 3 s after its last heartbeat and wait 1 s of last call once",
        "the minimum number of nodes has joined:",
        "",
        "- rallypoint: `heartbeat_timeout=3` (a heartbeat every `heartbeat_timeout / 3` = 1 s),",
        "  `last_call_timeout=1`.",
        "- torchrun: torch's c10d rendezvous (`dynamic_rendezvous.create_handler`) has no key",
        "  for the dead-node timeout; it is `keep_alive_interval * keep_alive_max_attempt`",
        "  (default 5 s * 3 = 15 s), so the benchmark sets `keep_alive_interval=1` and",
        "  `keep_alive_max_attempt=3`, plus `last_call_timeout=1`. torch's own",
        "  `heartbeat_timeout` key is the deadline of a single keep-alive write to the store,",
        "  not a dead-node timeout, and is left at its default. The c10d backend's",
        "  `read_timeout` (60 s) and `join_timeout` (600 s) are left at their defaults too.",
        "",
        *torchrun_env,
        "Runs alternate between the launchers, rallypoint first in odd rounds and torchrun",
        "first in even ones. Workers are told to run for "
        f"{worker_seconds(cap, float(results['start_cap_seconds']))} s, longer than any run,",
        "and everything is killed once the measurement ends.",
        "",
        f"The machine has {results['cpus']} CPUs and other work (test suites) ran on it at the",
        "same time; four gloo workers, two agents and that work share the cores, so expect",
        "noise of a second or more per run. The repeat count is kept small for the same",
        "reason. Every sample, with its exact commands, is in",
        f"`{scenario.results.relative_to(ROOT)}`.",
        "",
        "## Rerun",
        "",
        "```",
        ".venv/bin/python benchmarks/bench_recovery.py              # 3 runs per launcher, cap 120 s",
        ".venv/bin/python benchmarks/bench_recovery.py --repeat 5 --cap 90",
        ".venv/bin/python benchmarks/bench_recovery.py --kill preempt  # SIGTERM: its own page",
        ".venv/bin/python benchmarks/bench_recovery.py --render-only  # page and chart from the JSON",
        "```",
        "",
        "The other kind of failure is on "
        + (
            "[its own page](benchmarks-recovery-preempt.md): one node preempted (SIGTERM)."
            if scenario is KILLED
            else "[the node-kill page](benchmarks-recovery.md): one node killed (SIGKILL)."
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per launcher")
    parser.add_argument(
        "--cap",
        type=float,
        default=120.0,
        help="seconds after the kill before a run counts as not recovered (default: %(default)s)",
    )
    parser.add_argument(
        "--start-cap",
        type=float,
        default=180.0,
        help="seconds for the two agents to reach world=4 before the run is given up "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--orphan-grace",
        type=float,
        default=10.0,
        help="seconds to wait for orphans to go away before counting them again",
    )
    parser.add_argument(
        "--kill",
        choices=tuple(SCENARIOS),
        default="agent",
        help="SIGKILL the second agent's process only (default), or it and its workers at "
        "once, as when the machine is lost (node), or send its agent SIGTERM, as a "
        "preemption does (preempt: results and page of their own)",
    )
    parser.add_argument(
        "--torchrun-shared-store",
        action="store_true",
        help="run torchrun without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (it then does not "
        "scale up from one node to two on torch 2.13)",
    )
    common.add_render_only(parser, KILLED.results)
    args = parser.parse_args()
    scenario = SCENARIOS[args.kill]
    if args.render_only:
        saved: dict[str, Any] = json.loads(scenario.results.read_text())
        saved["chart"] = chart(saved)
        scenario.report.write_text(render(saved) + "\n")
        common.wrote(scenario.report, scenario.chart)
        return
    if shutil.which("pgrep") is None:
        parser.error("pgrep is needed to find orphan workers (install procps)")

    import torch

    command = " ".join(["python", "benchmarks/bench_recovery.py", *sys.argv[1:]])
    git = common.git_state("core")
    load_before = common.load_average()
    began = time.time()
    envs: dict[str, dict[str, str]] = {
        "rallypoint": {},
        "torchrun": {} if args.torchrun_shared_store else dict(TORCHRUN_WORKAROUND),
    }
    samples = measure(args.repeat, args.cap, args.start_cap, args.orphan_grace, envs, args.kill)
    summary = {name: summarise(samples[name]) for name in LAUNCHERS}
    templates = {
        name: " ".join(
            [
                *(f"{k}={v}" for k, v in envs[name].items()),
                *agent_command(name, 0, "RUN_ID", worker_seconds(args.cap, args.start_cap), "TAG"),
            ]
        )
        .replace(str(BIN) + "/", ".venv/bin/")
        .replace(str(ROOT) + "/", "")
        .replace(f"{HOST}:0", f"{HOST}:PORT")
        for name in LAUNCHERS
    }
    results: dict[str, Any] = {
        **common.measured_on(began),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git": git,
        "command": command,
        "command_templates": templates,
        "rdzv_conf": RDZV_CONF,
        "kill": args.kill,
        "env": envs,
        "repeat": args.repeat,
        "cap_seconds": args.cap,
        "start_cap_seconds": args.start_cap,
        "orphan_grace_seconds": args.orphan_grace,
        "load_before": load_before,
        "load_after": common.load_average(),
        "wall_seconds": time.time() - began,
        "summary": summary,
        "ratio": ratio(summary, args.cap),
        "samples": {name: [asdict(s) for s in samples[name]] for name in LAUNCHERS},
    }
    results["chart"] = chart(results)
    common.write_results(scenario.results, results)
    scenario.report.write_text(render(results) + "\n")
    print(json.dumps({"summary": summary, "ratio": results["ratio"]}, indent=2))
    common.wrote(scenario.results, scenario.report, scenario.chart)


if __name__ == "__main__":
    main()

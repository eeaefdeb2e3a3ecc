"""Recovery after a node is killed or preempted: rallypoint against torchrun, side by side;
docs/benchmarks-recovery.md and docs/benchmarks-recovery-preempt.md say how.

    .venv/bin/python benchmarks/bench_recovery.py [--repeat 3] [--cap 120] [--kill agent]
    .venv/bin/python benchmarks/bench_recovery.py --kill preempt
    .venv/bin/python benchmarks/bench_recovery.py [--kill preempt] --render-only
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import common
from common import HOST, ROOT

WORKER = ROOT / "tests" / "workers" / "steps.py"
LAUNCHERS = tuple(common.LAUNCHERS)


@dataclass(frozen=True)
class Scenario:
    """Where one kind of failure's results go, and how its page names the failure."""

    name: str  # of the results and the page: recovery.json, benchmarks-recovery.md
    chart: str
    title: str  # "a node is killed"
    signal: str  # what happens to the second node, as the page's sentences say it
    lost: str  # the second node, as the page's table calls it


KILLED = Scenario(
    "recovery", "bench_node_kill_recovery.png", "a node is killed", "SIGKILL", "killed node"
)
PREEMPTED = Scenario(
    "recovery-preempt",
    "bench_preempt_recovery.png",
    "a node is preempted",
    "SIGTERM",
    "preempted node",
)
WORKER_KILLED = Scenario(
    "recovery-worker",
    "bench_worker_kill_recovery.png",
    "a worker is killed",
    "SIGKILL",
    "killed worker",
)
SCENARIOS = {"agent": KILLED, "node": KILLED, "preempt": PREEMPTED, "worker": WORKER_KILLED}
OPTIONS = {
    "repeat": (3, "runs per launcher"),
    "cap": (120.0, "seconds after the kill before a run counts as not recovered"),
    "start_cap": (180.0, "seconds for the two agents to reach world=4 before it is given up"),
    "orphan_grace": (10.0, "seconds for orphans to go away before they are counted again"),
    "kill": (
        tuple(SCENARIOS),
        "SIGKILL the second agent (agent), it and its workers (node), or SIGTERM it "
        "(preempt); or SIGKILL one of its workers (worker: the job restarts at world=4)",
    ),
    "torchrun_shared_store": (False, "torchrun without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
}
#: Seconds a preempted agent has to stop its workers and leave before it is SIGKILLed.
LEAVE_WAIT = 30.0
#: Both declare a node dead 3 s after its last heartbeat (see the page's "How").
RDZV_CONF = {
    "rallypoint": "heartbeat_timeout=3,last_call_timeout=1",
    "torchrun": "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
}
#: Without it torch 2.13 never scales the job from one node to two (see the page).
TORCHRUN_WORKAROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
STEP = re.compile(r"step rank=(\d+) world=(\d+) sum=\d+ at=([\d.]+) pid=(\d+)")
STORE_WAIT = 60.0  # seconds for the first agent to open the store's port
CLEANUP_WAIT = 30.0  # seconds for killed processes to disappear


@dataclass
class Sample:
    """One kill-and-recover run of one launcher."""

    launcher: str
    commands: list[list[str]]
    env: dict[str, str]  # set on top of this process's
    status: str = "failed to start"  # or "recovered", "did not recover"
    recovery_seconds: float | None = None  # kill -> first world=2 step of the survivor's workers
    seconds_to_world4: float | None = None  # first agent started -> its workers at world=4
    orphans: int = 0  # workers of the killed node still running when the measurement ended
    orphans_after_grace: int = 0  # ... and after a further grace period
    survivor_returncode: int | None = None  # set if the surviving agent exited during the run
    leftovers_after_cleanup: int = 0  # processes carrying the run's tag after the cleanup
    # Steps the survivor's workers completed still at world=4 after the kill (with the
    # killed node's orphaned workers), and the last one's time after the kill.
    world4_steps_after_kill: int = 0
    world4_until: float | None = None
    load_at_kill: float | None = None  # 1-minute load average of the machine
    error: str | None = None
    survivor_log_tail: str = ""  # kept when the run did not recover
    victim_returncode: int | None = None  # how the signalled agent exited


# --- one run ------------------------------------------------------------------------------


#: What a launcher needs besides its command (``bench_peers.py`` registers them): a process
#: started first that serves the run on its port (DLRover's job master), and the
#: environment of the agent of node ``i`` (a node rank), as a prefix of its command.
HELPERS: dict[str, Callable[[int, str, Path], subprocess.Popen[bytes]]] = {}
NODE_ENV: dict[str, Callable[[int, int], dict[str, str]]] = {}


def agent_command(
    launcher: str, port: int, run_id: str, seconds: int, tag: str, node: int = 0
) -> list[str]:
    env = NODE_ENV[launcher](port, node) if launcher in NODE_ENV else {}
    return [
        *(["env", *(f"{k}={v}" for k, v in env.items())] if env else []),
        *common.LAUNCHERS[launcher],
        "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{HOST}:{port}", "--rdzv-id", run_id,
        "--rdzv-conf", RDZV_CONF[launcher],
        str(WORKER), str(seconds), tag,
    ]  # fmt: skip


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """An agent in a session of its own, so that whatever shares its group can be killed
    with it; torchrun's workers sit in sessions of their own and are found by their tag."""
    with log.open("wb") as out:
        return subprocess.Popen(
            command,
            env=common.clean_env(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


class Log:
    """An agent's output as it grows: the steps its workers print."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def steps(self) -> list[tuple[str, float, int]]:
        """(world size, time, worker's pid) of each step printed since the last call."""
        with contextlib.suppress(FileNotFoundError), self.path.open("rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
            self.offset += len(data)
            *lines, self.partial = (self.partial + data).split(b"\n")
            found = (STEP.search(line.decode(errors="replace")) for line in lines)
            return [
                (match.group(2), float(match.group(3)), int(match.group(4)))
                for match in found
                if match
            ]
        return []

    def tail(self, lines: int = 40) -> str:
        text = self.path.read_bytes().decode(errors="replace") if self.path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def kill_everything(agents: list[subprocess.Popen[bytes]], tag: str, run_id: str) -> int:
    """SIGKILL both agents' process groups and every process with the run's tag; return how
    many tagged processes are still there after CLEANUP_WAIT (0 unless something is stuck)."""
    for agent in agents:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, signal.SIGKILL)
    left = common.kill_tagged(tag, CLEANUP_WAIT)
    for agent in agents:
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=5)
    # SIGKILLed agents cannot clean up their log folders: rallypoint's
    # rallypoint-<run id>-*, torchrun's torchelastic_*/<run id>_*.
    base = Path(tempfile.gettempdir())
    for path in [
        *base.glob(f"rallypoint-{run_id}-*"),
        *(p.parent for p in base.glob(f"torchelastic_*/{run_id}_*")),
    ]:
        shutil.rmtree(path, ignore_errors=True)
    return left


def wait_until(condition: Callable[[], object], seconds: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())


def worker_seconds(args: argparse.Namespace) -> int:
    """How long the workers train: longer than the startup, the kill and the full cap."""
    return int(args.start_cap + args.cap + 60)


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((HOST, port)) == 0


def measure_once(launcher: str, args: argparse.Namespace, env: dict[str, str]) -> Sample:
    """One run: two agents, world=4, SIGKILL (or, ``preempt``, SIGTERM) the second, wait
    for world=2 (at most ``--cap``)."""
    port, unique = common.free_port(), uuid.uuid4().hex[:10]
    run_id, tag = f"bench-recovery-{unique}", f"rpbench-{unique}"  # the tag: on every command
    commands = [
        agent_command(launcher, port, run_id, worker_seconds(args), f"{tag}-{role}", node)
        for node, role in enumerate(("survivor", "victim"))
    ]
    workdir = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    log = Log(workdir / "survivor.log")
    agents: list[subprocess.Popen[bytes]] = []
    sample = Sample(launcher, commands, env)
    try:
        began = time.time()
        if launcher in HELPERS:  # killed with the agents at the end
            agents.append(HELPERS[launcher](port, run_id, workdir))
        agents.append(survivor := start(commands[0], env, log.path))
        # The first agent hosts the c10d store; losing the host would end the job.
        opened = wait_until(lambda: port_open(port) or survivor.poll() is not None, STORE_WAIT)
        if not opened or survivor.poll() is not None:
            sample.error = f"the first agent did not open the store on port {port}"
            sample.survivor_log_tail = log.tail()
            return sample
        agents.append(victim := start(commands[1], env, workdir / "victim.log"))
        world4: list[float] = []
        before: set[int] = set()  # the survivor's workers' pids

        def at_world4() -> bool:
            for world, at, pid in log.steps():
                before.add(pid)
                if world == "4":
                    world4.append(at)
            return bool(world4) or survivor.poll() is not None or victim.poll() is not None

        if not wait_until(at_world4, args.start_cap, 0.1) or not world4:
            sample.error = f"the two agents did not reach world=4 within {args.start_cap:.0f} s"
            sample.survivor_log_tail = log.tail()
            return sample
        sample.seconds_to_world4 = world4[0] - began
        if args.kill == "worker":
            kill_a_worker(sample, log, Log(workdir / "victim.log"), before, survivor, args)
            return sample
        # "node": the agent and its workers at once, as when a machine is lost; "agent":
        # the agent process only, its workers then on their own; "preempt": SIGTERM to
        # the agent alone, which is to stop its workers and leave.
        victim_workers = common.matching(f"{tag}-victim") if args.kill == "node" else []
        sample.load_at_kill = os.getloadavg()[0]
        killed_at = time.time()
        victim.send_signal(signal.SIGTERM if args.kill == "preempt" else signal.SIGKILL)
        common.kill(pid for pid in victim_workers if pid != victim.pid)
        try:
            sample.victim_returncode = victim.wait(timeout=LEAVE_WAIT)
        except subprocess.TimeoutExpired:
            sample.error = f"the preempted agent was still running {LEAVE_WAIT:.0f} s later"
            victim.kill()
            victim.wait(timeout=CLEANUP_WAIT)
        after: dict[str, list[float]] = {"2": [], "4": []}

        def at_world2() -> bool:
            for world, at, _pid in log.steps():
                if at >= killed_at and world in after:
                    after[world].append(at)
            return bool(after["2"]) or survivor.poll() is not None

        wait_until(at_world2, args.cap, 0.1)
        sample.survivor_returncode = survivor.poll()
        sample.world4_steps_after_kill = len(after["4"])
        sample.world4_until = max(after["4"]) - killed_at if after["4"] else None

        def orphans() -> int:
            """The killed node's workers still running: processes with its tag, but for the
            agents and the processes that run the launcher itself (ft_launcher's rank
            monitors, forked from its agent, carry its command line)."""
            found = common.matching(f"{tag}-victim")
            launcher_marker = common.LAUNCHERS[launcher][0].encode()
            return len(
                [
                    pid
                    for pid in found
                    if pid not in (survivor.pid, victim.pid)
                    and launcher_marker not in _cmdline(pid)
                ]
            )

        sample.orphans = orphans()
        if sample.orphans:
            wait_until(lambda: not orphans(), args.orphan_grace, 0.5)
            sample.orphans_after_grace = orphans()
        if after["2"] and after["2"][0] - killed_at <= args.cap:
            sample.status, sample.recovery_seconds = "recovered", after["2"][0] - killed_at
        else:
            sample.status = "did not recover"
            if sample.survivor_returncode is not None:
                sample.error = f"the surviving agent exited with {sample.survivor_returncode}"
            sample.survivor_log_tail = log.tail()
        return sample
    finally:
        sample.leftovers_after_cleanup = kill_everything(agents, tag, run_id)
        shutil.rmtree(workdir, ignore_errors=True)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def kill_a_worker(
    sample: Sample,
    log: Log,
    victim_log: Log,
    before: set[int],
    survivor: subprocess.Popen[bytes],
    args: argparse.Namespace,
) -> None:
    """SIGKILL one worker of the second node (the first pid its log shows) and time the
    survivor's first step from a worker it did not have before: the job's restart."""
    seen = victim_log.steps()
    deadline = time.monotonic() + STORE_WAIT
    while not seen and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = victim_log.steps()
    if not seen:
        sample.error = "the second node's log showed no worker's step"
        return
    # A second of steps at world 4 first: every survivor's worker has printed by then
    # (each prints every 0.2 s), so that none is taken for a restarted one.
    time.sleep(1.0)
    before.update(pid for _world, _at, pid in log.steps())
    sample.load_at_kill = os.getloadavg()[0]
    killed_at = time.time()
    common.kill([seen[0][2]])
    restarted: list[float] = []

    def again() -> bool:
        restarted.extend(at for world, at, pid in log.steps() if pid not in before)
        return bool(restarted) or survivor.poll() is not None

    wait_until(again, args.cap, 0.1)
    sample.survivor_returncode = survivor.poll()
    if restarted and restarted[0] - killed_at <= args.cap:
        sample.status, sample.recovery_seconds = "recovered", restarted[0] - killed_at
    else:
        sample.status = "did not recover"
        sample.survivor_log_tail = log.tail()


def show(sample: Sample) -> str:
    seconds = sample.recovery_seconds
    shown = f"{seconds:.2f} s" if seconds is not None else sample.status
    extra = f"; {sample.orphans} orphan(s)" if sample.orphans else ""
    return shown + extra + (f"; {sample.error}" if sample.error else "")


def summarise(samples: list[Sample]) -> dict[str, Any]:
    times = [s.recovery_seconds for s in samples if s.recovery_seconds is not None]
    return {
        "runs": len(samples),
        "recovered": len(times),
        "did_not_recover": sum(s.status == "did not recover" for s in samples),
        "failed_to_start": sum(s.status == "failed to start" for s in samples),
        "median_recovery_seconds": common.median(times),
        "min_recovery_seconds": min(times, default=None),
        "max_recovery_seconds": max(times, default=None),
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


def measure(args: argparse.Namespace) -> dict[str, Any]:
    git = common.git_state("core")
    envs = {"rallypoint": {}, "torchrun": {} if args.torchrun_shared_store else TORCHRUN_WORKAROUND}
    once = lambda name: measure_once(name, args, envs[name])  # noqa: E731
    samples = common.rounds(args.repeat, LAUNCHERS, once, show)
    summary = {name: summarise(samples[name]) for name in LAUNCHERS}
    ours = summary["rallypoint"]["median_recovery_seconds"]
    theirs = summary["torchrun"]["median_recovery_seconds"]
    # rallypoint / torchrun of the median recovery time. If torchrun never recovered, its
    # time is over the cap and the ratio is at most rallypoint's median / cap.
    if ours is not None and theirs:
        ratio = {"value": ours / theirs, "bound": "exact"}
    elif ours is not None and summary["torchrun"]["did_not_recover"]:
        ratio = {"value": ours / args.cap, "bound": "at most"}
    else:
        ratio = {"value": None, "bound": "n/a"}
    templates = {}
    for name in LAUNCHERS:
        command = agent_command(name, 0, "RUN_ID", worker_seconds(args), "TAG")
        template = " ".join([*(f"{k}={v}" for k, v in envs[name].items()), *command])
        template = template.replace(str(common.BIN) + "/", ".venv/bin/")
        templates[name] = template.replace(str(ROOT) + "/", "").replace(f"{HOST}:0", f"{HOST}:PORT")
    return {
        "git": git,
        "command_templates": templates,
        "rdzv_conf": RDZV_CONF,
        "kill": args.kill,
        "env": envs,
        "repeat": args.repeat,
        "cap_seconds": args.cap,
        "start_cap_seconds": args.start_cap,
        "orphan_grace_seconds": args.orphan_grace,
        "summary": summary,
        "ratio": ratio,
        "samples": {name: [asdict(s) for s in samples[name]] for name in LAUNCHERS},
    }


# --- the report ---------------------------------------------------------------------------


def chart(results: dict[str, Any]) -> None:
    scenario = SCENARIOS[results["kill"]]
    cap = float(results["cap_seconds"])
    figure, axis = common.figure(figsize=(6.4, 3.0))
    for row, name in enumerate(LAUNCHERS):
        median = results["summary"][name]["median_recovery_seconds"]
        if median is not None:
            axis.barh(row, median, color=common.COLORS[name], alpha=0.8, height=0.6)
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
    common.save(figure, scenario.chart)


def launcher_cells(results: dict[str, Any], name: str) -> list[str]:
    """The column of the page's table for launcher ``name``, row by row (see render)."""
    summary, samples, cap = (
        results["summary"][name],
        results["samples"][name],
        results["cap_seconds"],
    )

    def of(key: str) -> str:
        return f"{summary[key]} of {summary['runs']}"

    def each(cell: Callable[[dict[str, Any]], object]) -> str:
        return ", ".join(str(cell(sample)) for sample in samples)

    median = summary["median_recovery_seconds"]
    ends = (summary["min_recovery_seconds"], summary["max_recovery_seconds"])
    latest = common.number(summary["max_world4_seconds_after_kill"], " s")
    return [
        common.number(median, " s") if median is not None else f"did not recover (> {cap:.0f} s)",
        " / ".join(common.number(end, " s") for end in ends),
        of("recovered"),
        of("runs_with_orphans"),
        f"{of('runs_still_at_world4_after_kill')}; {latest}",
        each(
            lambda s: (
                s["status"] if s["recovery_seconds"] is None else f"{s['recovery_seconds']:.2f}"
            )
        ),
        each(lambda s: s["victim_returncode"]),
        each(lambda s: "-" if s["load_at_kill"] is None else f"{s['load_at_kill']:.0f}"),
    ]


def render(results: dict[str, Any]) -> dict[str, list[str]]:
    scenario = SCENARIOS[results["kill"]]
    labels = [
        "Median recovery time",
        "Fastest / slowest recovery",
        f"Runs that recovered within {results['cap_seconds']:.0f} s",
        f"Runs leaving a worker of the {scenario.lost} running",
        "Runs where the survivors trained on at `world=4` (with the orphans) > 1 s "
        f"after the {scenario.signal}; latest such step",
        "Every run, seconds",
        "Exit code of the preempted agent",
        "1-minute load average at each kill",
    ]
    value, bound = results["ratio"]["value"], results["ratio"]["bound"]
    ratio = "n/a" if value is None else ("≤ " if bound == "at most" else "") + f"{value:.2f}x"
    ratios = [ratio] + [""] * (len(labels) - 1)
    columns = [launcher_cells(results, name) for name in LAUNCHERS]
    rows = [list(row) for row in zip(labels, *columns, ratios, strict=True)]
    if results["kill"] != "preempt":
        del rows[6]  # a SIGKILLed agent's exit code says nothing
    everything = [s for name in LAUNCHERS for s in results["samples"][name]]

    def total(test: Callable[[dict[str, Any]], bool]) -> str:
        return f"{sum(map(test, everything))} of {len(everything)}"

    def exited(name: str) -> str:
        codes = [s["survivor_returncode"] for s in results["samples"][name]]
        known = sorted({code for code in codes if code is not None})
        count = f"{name} {len(codes) - codes.count(None)} of {len(codes)}"
        return count + (f" (exit code {', '.join(map(str, known))})" if known else "")

    facts = [
        f"- Python {results['python']}, torch {results['torch']}; rallypoint {results['git']}",
        f"- Load average before / after: {results['load_before']} / {results['load_after']}",
    ]
    checks = [
        f"- Runs that failed to start (no `world=4` within {results['start_cap_seconds']:.0f} s): "
        + total(lambda s: s["status"] == "failed to start"),
        "- Runs whose surviving agent exited during the run: " + ", ".join(map(exited, LAUNCHERS)),
        f"- Signalled agents still running {LEAVE_WAIT:.0f} s later (then SIGKILLed): "
        + total(lambda s: "still running" in (s["error"] or "")),
        "- Runs leaving a process with the run's tag after the cleanup: "
        + total(lambda s: s["leftovers_after_cleanup"] > 0),
    ]
    templates = results["command_templates"]
    return {
        "results": [
            *common.measured(results, *facts),
            "",
            f"Time from the {scenario.signal} of one of two nodes to the survivors' first "
            f"training step in the smaller world; {results['repeat']} runs per launcher.",
            "",
            *common.table("measurement | rallypoint | torchrun | ratio", rows),
            "",
            *checks,
        ],
        "commands": ["```", templates["rallypoint"], templates["torchrun"], "```"],
    }


def main() -> None:
    args = common.options(__doc__, **OPTIONS).parse_args()
    scenario = SCENARIOS[args.kill]
    common.publish(args, scenario.name, f"benchmarks-{scenario.name}", measure, chart, render)


if __name__ == "__main__":
    main()

"""Scaling a job up and down: what a join and a departure cost the node that keeps training,
rallypoint against torchrun side by side in one run; docs/benchmarks-scale.md says how.

Two nodes of two workers on this machine, ``--nnodes 1:2``: node a trains alone, node b's
agent starts (the join: node a's pause), both train, node b's agent gets SIGTERM (the
departure: the seconds until node a trains again, and the steps lost).

    .venv/bin/python benchmarks/bench_scale.py [--repeat 3]
    .venv/bin/python benchmarks/bench_scale.py --repeat 1 --only rallypoint   # a short try
    .venv/bin/python benchmarks/bench_scale.py --render-only
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
from bench_recovery import (
    LEAVE_WAIT,
    RDZV_CONF,
    TORCHRUN_WORKAROUND,
    kill_everything,
    start,
    wait_until,
)
from common import BIN, HOST, ROOT

TRAIN = ROOT / "benchmarks" / "workloads" / "scale_train.py"
LAUNCHERS = tuple(common.LAUNCHERS)
SCENARIOS = ("join", "sigterm")
#: rallypoint's targets: node a's pause at a join; from the SIGTERM to node a's first step
#: in the new round, and the steps lost then.
TARGETS = {"join_pause": 0.5, "sigterm_seconds": 1.5, "sigterm_lost": 0}
OPTIONS = {
    "repeat": (3, "runs per launcher, each a join and then a SIGTERM"),
    "join_after": (10.0, "seconds node a trains alone, from its first step, before node b starts"),
    "world4_seconds": (5.0, "seconds both nodes train, from the first step at world 4, before the SIGTERM"),
    "cap": (60.0, "seconds after node b's start (after the SIGTERM) before a run counts as not joined (recovered)"),
    "step_seconds": (0.05, "length of a training step"),
    "save_every": (10, "steps between checkpoints"),
    "memory": ("64MB", "rallypoint's --checkpoint-memory"),
    "scenario": (("both", *SCENARIOS), "measure both (a join, then a SIGTERM) or one"),
    "only": (("", *LAUNCHERS), "run one launcher only (for trying things out)"),
}  # fmt: skip
STORE_WAIT = 60.0  # seconds for node a's agent to open the c10d store's port
_RUNS: dict[str, int] = {}  # runs of each launcher so far (where its SIGTERMs land)
START_CAP = 120.0  # seconds from node a's start to its first step
DONE = re.compile(r"done step=(\d+) world=(\d+) rank=\d+ at=([\d.]+)")
RESUMED = re.compile(r"resumed step=(\d+) world=(\d+) rank=\d+ at=([\d.]+)")


@dataclass(frozen=True)
class Line:
    """A step done, or a checkpoint loaded, by a node's first worker: when, which, at what
    world size."""

    at: float
    step: int
    world: int


def lines(path: Path, pattern: re.Pattern[str]) -> list[Line]:
    """The lines of ``pattern`` in an agent's output so far, in time order."""
    try:
        text = path.read_bytes().decode(errors="replace")
    except OSError:
        return []
    found = (Line(float(at), int(step), int(world)) for step, world, at in pattern.findall(text))
    return sorted(found, key=lambda line: line.at)


def tail(path: Path, count: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_bytes().decode(errors="replace").splitlines()[-count:])
    return ""


def wait_for(
    find: Callable[[], Line | None], seconds: float, alive: Callable[[], bool]
) -> Line | None:
    """Poll ``find`` every 0.05 s for ``seconds`` or until ``alive`` says no; what it found."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (found := find()) is not None or not alive():
            return found if found is not None else find()
        time.sleep(0.05)
    return find()


class Failed(Exception):
    """A run that could not go on, in a sentence."""


# --- one run ------------------------------------------------------------------------------


def node_command(
    launcher: str, args: argparse.Namespace, port: int, run_id: str, tag: str, ckpt: str, logs: str
) -> list[str]:
    """One node's agent command; node b's differs from node a's in ``tag`` and ``logs``."""
    rendezvous = [
        "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{HOST}:{port}", "--rdzv-id", run_id,
        "--rdzv-conf", RDZV_CONF[launcher], "--log-dir", logs,
    ]  # fmt: skip
    features = []
    if launcher == "rallypoint":  # torchrun's workers get RALLYPOINT_CHECKPOINT_URL instead
        features = ["--checkpoint-dir", ckpt, "--checkpoint-memory", args.memory]
    script = [str(TRAIN), "--step-seconds", str(args.step_seconds),
              "--save-every", str(args.save_every), "--tag", tag]  # fmt: skip
    return [*common.LAUNCHERS[launcher], *rendezvous, *features, *script]


def environment(launcher: str, ckpt: str) -> dict[str, str]:
    """Set on top of this process's environment: torchrun's workaround (without it torch
    never scales a c10d job from one node to two, benchmarks-recovery.md) and its workers'
    checkpoint directory."""
    if launcher == "rallypoint":
        return {}
    return {**TORCHRUN_WORKAROUND, "RALLYPOINT_CHECKPOINT_URL": ckpt}


def run_once(launcher: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run: node a alone, node b joins (``join``), both train, node b's agent gets
    SIGTERM (``sigterm``); then every process of the run killed."""
    scenarios = SCENARIOS if args.scenario == "both" else (args.scenario,)
    unique = uuid.uuid4().hex[:10]
    run_id, base = f"bench-scale-{unique}", f"rpscale-{unique}"  # base: on every command
    workdir = Path(tempfile.mkdtemp(prefix="rallypoint-bench-scale-"))
    ckpt, port = str(workdir / "checkpoints"), common.free_port()
    env = environment(launcher, ckpt)
    commands = {
        node: node_command(launcher, args, port, run_id, f"{base}-{node}", ckpt,
                           str(workdir / f"logs-{node}"))
        for node in ("a", "b")
    }  # fmt: skip
    logs = {node: workdir / f"{node}.log" for node in commands}
    result: dict[str, Any] = {"launcher": launcher, "error": None, "join": None, "sigterm": None}
    agents: list[subprocess.Popen[bytes]] = []
    try:
        began = time.time()
        agents.append(a := start(commands["a"], env, logs["a"]))
        # Node a hosts the c10d store: node b can only start once it listens.
        opened = wait_until(lambda: common.port_open(port) or a.poll() is not None, STORE_WAIT)
        if not opened or a.poll() is not None:
            raise Failed(f"node a's agent did not open the store on port {port}")
        if "join" in scenarios:
            first = wait_for(lambda: next(iter(lines(logs["a"], DONE)), None), START_CAP,
                             lambda: a.poll() is None)  # fmt: skip
            if first is None:
                raise Failed(f"node a did no step within {START_CAP:.0f} s of its start")
            result["first_step_seconds"] = first.at - began
            time.sleep(max(0.0, first.at + args.join_after - time.time()))
        result["load_at_join"] = common.load_average()
        joined = time.time()
        agents.append(b := start(commands["b"], env, logs["b"]))

        def at_world4() -> Line | None:
            return next((d for d in lines(logs["a"], DONE) if d.world == 4 and d.at > joined), None)

        cap = args.cap if "join" in scenarios else START_CAP
        both = lambda: a.poll() is None and b.poll() is None  # noqa: E731
        world4 = wait_for(at_world4, cap, both)
        if "join" in scenarios:
            if world4 is not None:  # steps redone: on to the first step not done before

                def new_step() -> Line | None:
                    done = lines(logs["a"], DONE)
                    newest = max((d.step for d in done if d.at < world4.at), default=-1)
                    return next((d for d in done if d.at >= world4.at and d.step > newest), None)

                wait_for(new_step, max(0.0, joined + cap - time.time()), both)
            result["join"] = join_figures(logs["a"], joined, world4)
        if world4 is None:
            raise Failed(f"node a did no step at world 4 within {cap:.0f} s of node b's start")
        if "sigterm" in scenarios:
            # The k-th run's signal lands (k + 0.5) / repeat of the way into a save interval:
            # the steps a launcher loses are not decided by where the schedule puts it.
            k = _RUNS[launcher] = _RUNS.get(launcher, -1) + 1
            offset = (k % args.repeat + 0.5) / args.repeat * args.save_every * args.step_seconds
            result["signal_offset"] = offset
            time.sleep(max(0.0, world4.at + args.world4_seconds + offset - time.time()))
            result["load_at_signal"] = common.load_average()
            signalled = time.time()
            b.send_signal(signal.SIGTERM)

            def at_world2() -> Line | None:
                after = lines(logs["a"], DONE)
                return next((d for d in after if d.world == 2 and d.at > signalled), None)

            wait_for(at_world2, args.cap, lambda: a.poll() is None)
            victim: dict[str, Any] = {"returncode": None, "exit_seconds": None}
            with contextlib.suppress(subprocess.TimeoutExpired):
                victim["returncode"] = b.wait(
                    timeout=max(0.0, signalled + LEAVE_WAIT - time.time())
                )
                victim["exit_seconds"] = time.time() - signalled
            result["sigterm"] = {**sigterm_figures(logs["a"], signalled), **victim}
    except Failed as failed:
        result["error"] = str(failed)
    finally:
        result["exits"] = {node: agent.poll() for node, agent in zip("ab", agents, strict=False)}
        result["leftovers"] = kill_everything(agents, base, run_id)
        for path in Path("/dev/shm").glob(f"rallypoint-{run_id}-*"):
            shutil.rmtree(path, ignore_errors=True)
        if result["error"] or not all(result[s] and result[s]["status"] == "ok" for s in scenarios):
            result["log_tails"] = {node: tail(path) for node, path in logs.items()}
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def join_figures(log: Path, joined: float, world4: Line | None) -> dict[str, Any]:
    """What node b's start at ``joined`` cost node a, from its first worker's lines: the
    pause from its last step at world 2 to its first at world 4, and the steps redone."""
    done = lines(log, DONE)
    if world4 is None:
        trained_on = [d for d in done if d.world == 2 and d.at > joined]
        return {"status": "did not join", "world2_steps_after_start": len(trained_on)}
    before = [d for d in done if d.world == 2 and d.at < world4.at]
    if not before:
        return {"status": "no step at world 2 before the join"}
    last = before[-1]
    new = next((d for d in done if d.at >= world4.at and d.step > last.step), None)
    resumed = [r for r in lines(log, RESUMED) if r.world == 4 and r.at > joined]
    return {
        "status": "ok",
        "pause_seconds": world4.at - last.at,
        "last_step": last.step,  # the newest step done at world 2
        "first_step": world4.step,  # the first done at world 4
        "resumed_step": resumed[0].step if resumed else None,  # the checkpoint loaded
        "steps_redone": max(0, last.step + 1 - world4.step),
        "seconds_to_new_step": None if new is None else new.at - last.at,
        # How long node b took to join, and node a trained on meanwhile.
        "seconds_from_start": world4.at - joined,
        "world2_seconds_after_start": max(0.0, last.at - joined),
        "world2_steps_after_start": sum(d.world == 2 and d.at > joined for d in before),
    }


def sigterm_figures(log: Path, signalled: float) -> dict[str, Any]:
    """What node b's SIGTERM at ``signalled`` cost node a, from its first worker's lines:
    the seconds to its first step at world 2, and the steps lost (the newest step done
    before the signal, less the step resumed from)."""
    done = lines(log, DONE)
    reached = max((d.step for d in done if d.at <= signalled), default=-1)
    world2 = next((d for d in done if d.world == 2 and d.at > signalled), None)
    # Steps done at world 4 after the signal: those up to a save on notice.
    after4 = [d for d in done if d.world == 4 and d.at > signalled]
    common_part: dict[str, Any] = {
        "reached_step": reached,
        "world4_steps_after_signal": len(after4),
        "world4_seconds_after_signal": after4[-1].at - signalled if after4 else None,
    }
    if world2 is None:
        return {"status": "did not recover", **common_part}
    resumed = [r for r in lines(log, RESUMED) if r.world == 2 and r.at > signalled]
    # The step resumed from: the checkpoint loaded (none: -1, from the start).
    resumed_from = resumed[0].step if resumed else world2.step - 1
    last4 = max((d.step for d in done if d.world == 4 and d.at < world2.at), default=-1)
    return {
        "status": "ok",
        "seconds": world2.at - signalled,
        "first_step": world2.step,
        "resumed_step": resumed[0].step if resumed else None,
        "steps_lost": max(0, reached - resumed_from),
        # Against the newest step done at world 4, the steps after the signal included.
        "steps_redone": max(0, last4 + 1 - world2.step),
        **common_part,
    }


def show(run: dict[str, Any]) -> str:
    parts = []
    if (join := run["join"]) is not None:
        parts.append(
            f"join: pause {join['pause_seconds']:.2f} s, {join['steps_redone']} redone"
            if join["status"] == "ok" else f"join: {join['status']}"
        )  # fmt: skip
    if (term := run["sigterm"]) is not None:
        parts.append(
            f"sigterm: {term['seconds']:.2f} s, {term['steps_lost']} lost"
            if term["status"] == "ok" else f"sigterm: {term['status']}"
        )  # fmt: skip
    if run["error"]:
        parts.append(run["error"])
    return "; ".join(parts)


# --- the results --------------------------------------------------------------------------


def figures(runs: list[dict[str, Any]], scenario: str, key: str) -> list[Any]:
    """``key`` of ``scenario`` in each run that measured it (None where it failed)."""
    found = [run[scenario] for run in runs if run[scenario] is not None]
    return [part.get(key) if part["status"] == "ok" else None for part in found]


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def known(scenario: str, key: str) -> list[Any]:
        return [x for x in figures(runs, scenario, key) if x is not None]

    summary: dict[str, Any] = {"runs": len(runs)}
    pauses, lost = known("join", "pause_seconds"), known("sigterm", "steps_lost")
    summary["join"] = {
        "measured": len(figures(runs, "join", "status")),
        "joined": len(pauses),
        "median_pause_seconds": common.median(pauses),
        "median_steps_redone": common.median(known("join", "steps_redone")),
        "median_seconds_to_new_step": common.median(known("join", "seconds_to_new_step")),
        "median_seconds_from_start": common.median(known("join", "seconds_from_start")),
    }
    summary["sigterm"] = {
        "measured": len(figures(runs, "sigterm", "status")),
        "recovered": len(known("sigterm", "seconds")),
        "median_seconds": common.median(known("sigterm", "seconds")),
        "median_steps_lost": common.median(lost),
        "max_steps_lost": max(lost, default=None),
        "median_steps_redone": common.median(known("sigterm", "steps_redone")),
    }
    return summary


def ratio(summary: dict[str, Any], scenario: str, key: str) -> float | None:
    ours, theirs = (summary.get(n, {}).get(scenario, {}).get(key) for n in LAUNCHERS)
    return ours / theirs if ours is not None and theirs else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    launchers = [args.only] if args.only else list(LAUNCHERS)
    runs = common.rounds(args.repeat, launchers, lambda name: run_once(name, args), show)
    summary = {name: summarise(runs[name]) for name in launchers}
    templates = {}
    for name in launchers:
        command = node_command(name, args, 0, "RUN_ID", "TAG", "DIR", "LOG_DIR")
        line = " ".join([*(f"{k}={v}" for k, v in environment(name, "DIR").items()), *command])
        line = line.replace(str(BIN) + "/", ".venv/bin/").replace(str(ROOT) + "/", "")
        templates[name] = line.replace(f"{HOST}:0", f"{HOST}:PORT")
    return {
        "git": common.git_state("core"),
        "settings": {k: getattr(args, k) for k in OPTIONS if k != "only"},
        "command_templates": templates,
        "env": {name: environment(name, "DIR") for name in launchers},
        "targets": TARGETS,
        "summary": summary,
        "ratio": {
            "join_pause": ratio(summary, "join", "median_pause_seconds"),
            "sigterm_seconds": ratio(summary, "sigterm", "median_seconds"),
        },
        "runs": runs,
    }


# --- the page -----------------------------------------------------------------------------


def chart(results: dict[str, Any]) -> None:
    panels = [
        ("join", "pause_seconds", "join_pause", "node a's pause at node b's join, s"),
        ("sigterm", "seconds", "sigterm_seconds", "SIGTERM of node b to node a's next step, s"),
    ]
    figure, axes = common.figure(1, 2, figsize=(10, 2.8))
    names = [name for name in LAUNCHERS if name in results["summary"]]
    for axis, (scenario, key, target, label) in zip(axes, panels, strict=True):
        for row, name in enumerate(names):
            values = [x for x in figures(results["runs"][name], scenario, key) if x is not None]
            if values:
                median = common.median(values) or 0.0
                axis.barh(row, median, color=common.COLORS[name], alpha=0.8, height=0.6)
                axis.annotate(f"median {median:.2f} s", (median, row), textcoords="offset points",
                              xytext=(6, 10), fontsize=8)  # fmt: skip
                axis.plot(values, [row] * len(values), "o", color="black", markersize=4, zorder=3)
        axis.axvline(results["targets"][target], color="#d62728", linestyle="--", linewidth=1)
        axis.set_yticks(range(len(names)))
        axis.set_yticklabels(names)
        axis.invert_yaxis()
        axis.margins(x=0.15, y=0.3)
        axis.set_xlim(left=0)
        axis.set_xlabel(label + " (red: rallypoint's target)", fontsize=9)
        axis.grid(True, axis="x", alpha=0.3)
    figure.suptitle("Scaling from one node to two and back (bars: median; dots: runs)", fontsize=10)
    common.save(figure, "bench_scale.png")


def every(runs: list[dict[str, Any]], scenario: str, key: str, digits: int = 2) -> str:
    cells = []
    for run in runs:
        part = run[scenario]
        if part is None:
            cells.append("not run")
        elif part["status"] != "ok":
            cells.append(part["status"])
        elif part.get(key) is None:
            cells.append("n/a")
        else:
            value = part[key]
            cells.append(f"{value:.{digits}f}" if isinstance(value, float) else str(value))
    return ", ".join(cells) or "n/a"


def steps(value: float | None) -> str:
    """A count of steps, or the median of some (``2.5``)."""
    return "n/a" if value is None else f"{value:g}"


def met(value: float | None, target: float) -> str:
    return "" if value is None else (" (met)" if value <= target else " (missed)")


def render(results: dict[str, Any]) -> dict[str, list[str]]:
    settings, targets, summary = results["settings"], results["targets"], results["summary"]
    names = [name for name in LAUNCHERS if name in summary]
    runs = results["runs"]

    def row(label: str, cell: Callable[[str], str], ratio: str = "", target: str = "") -> list[str]:
        return [label, *(cell(name) for name in names), ratio, target]

    def of(scenario: str, key: str, unit: str = " s", digits: int = 2) -> Callable[[str], str]:
        return lambda name: common.number(summary[name][scenario][key], unit, digits)

    def times(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}x"

    header = " | ".join(["measurement", *names, "ratio", "rallypoint's target"])
    ours = summary.get("rallypoint", {})
    pause = ours.get("join", {}).get("median_pause_seconds")
    join_rows = [
        row("Pause of node a, median", of("join", "median_pause_seconds"),
            times(results["ratio"]["join_pause"]),
            f"≤ {targets['join_pause']} s{met(pause, targets['join_pause'])}"),
        row("Pause of node a, every run (s)", lambda n: every(runs[n], "join", "pause_seconds")),
        row("Steps redone, median", lambda n: steps(summary[n]["join"]["median_steps_redone"])),
        row("Steps redone, every run", lambda n: every(runs[n], "join", "steps_redone")),
        row("Node a's last step at world 2 to its first new step, median",
            of("join", "median_seconds_to_new_step")),
        row("Node b's start to node a's first step at world 4, median",
            of("join", "median_seconds_from_start")),
        row("Node a trained on at world 2 after node b's start, every run (s)",
            lambda n: every(runs[n], "join", "world2_seconds_after_start", 1)),
        row(f"Runs that reached world 4 within {settings['cap']:.0f} s",
            lambda n: f"{summary[n]['join']['joined']} of {summary[n]['join']['measured']}"),
    ]  # fmt: skip
    seconds = ours.get("sigterm", {}).get("median_seconds")
    most_lost = ours.get("sigterm", {}).get("max_steps_lost")
    sigterm_rows = [
        row("SIGTERM to node a's first step at world 2, median", of("sigterm", "median_seconds"),
            times(results["ratio"]["sigterm_seconds"]),
            f"≤ {targets['sigterm_seconds']} s{met(seconds, targets['sigterm_seconds'])}"),
        row("The same, every run (s)", lambda n: every(runs[n], "sigterm", "seconds")),
        row("Steps lost, median / most", lambda n: " / ".join([
            steps(summary[n]["sigterm"]["median_steps_lost"]),
            str(summary[n]["sigterm"]["max_steps_lost"])]),
            "", f"{targets['sigterm_lost']} in every run{met(most_lost, targets['sigterm_lost'])}"),
        row("Steps lost, every run", lambda n: every(runs[n], "sigterm", "steps_lost")),
        row("Newest step before the SIGTERM / step resumed from, every run",
            lambda n: ", ".join(f"{r['sigterm'].get('reached_step')} / {r['sigterm'].get('resumed_step')}"
                                for r in runs[n] if r["sigterm"] is not None) or "n/a"),
        row("Steps node a did at world 4 after the SIGTERM, every run",
            lambda n: every(runs[n], "sigterm", "world4_steps_after_signal")),
        row("Exit code of node b's agent (seconds after the SIGTERM)",
            lambda n: ", ".join(f"{r['sigterm']['returncode']} ({common.number(r['sigterm']['exit_seconds'], ' s', 1)})"
                                for r in runs[n] if r["sigterm"] is not None) or "n/a"),
        row(f"Runs that recovered within {settings['cap']:.0f} s",
            lambda n: f"{summary[n]['sigterm']['recovered']} of {summary[n]['sigterm']['measured']}"),
    ]  # fmt: skip
    checks = []
    for name in names:
        errors = [r["error"] for r in runs[name] if r["error"]]
        left = sum(r["leftovers"] > 0 for r in runs[name])
        firsts = [r["first_step_seconds"] for r in runs[name] if "first_step_seconds" in r]
        start = common.number(common.median(firsts), " s", 1)
        checks.append(
            f"- {name}: node a's start to its first step, median {start}; "
            f"runs cut short: {len(errors)} of {len(runs[name])}"
            + (f" ({'; '.join(errors)})" if errors else "")
            + f"; runs leaving a process after the cleanup: {left}"
        )
    setup = common.measured(
        results,
        f"- Python {results['python']}, torch {results['torch']}; rallypoint {results['git']}",
        f"- Load average (1, 5, 15 min) before / after: {results['load_before']} / "
        f"{results['load_after']}",
        f"- {settings['repeat']} run{'s' if settings['repeat'] != 1 else ''} per launcher; node b started after node a's "
        f"{settings['join_after']:.0f} s alone, SIGTERMed after {settings['world4_seconds']:.0f} s "
        f"at world 4; {settings['step_seconds']} s steps, a checkpoint every "
        f"{settings['save_every']} steps",
    )
    templates = results["command_templates"]
    return {
        "setup": setup,
        "join": [*common.table(header, join_rows), "", *checks],
        "sigterm": common.table(header, sigterm_rows),
        "commands": ["```", *(templates[name] for name in names), "```"],
    }


def main() -> None:
    args = common.options(__doc__, **OPTIONS).parse_args()
    common.publish(args, "scale", "benchmarks-scale", measure, chart, render)


if __name__ == "__main__":
    main()

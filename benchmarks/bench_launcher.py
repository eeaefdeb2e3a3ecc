"""rallypoint against torchrun on one node: a no-op job's wall time, a torch job's first
start, the launcher's peak memory, the recovery from one worker crash and the memory of
the workers, side by side (docs/benchmarks.md says how).

    .venv/bin/python benchmarks/bench_launcher.py [--repeat 10] [--recovery-repeat 20]
    .venv/bin/python benchmarks/bench_launcher.py --render-only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import common
from common import LAUNCHERS, ROOT

WORKLOADS = Path(__file__).parent / "workloads"
ALLREDUCE = str(ROOT / "tests" / "workers" / "allreduce.py")
NOOP = ["--standalone", "--nproc-per-node", "2", str(WORKLOADS / "noop.py")]
FIRST_START = ["--standalone", "--nproc-per-node", "2", ALLREDUCE, "1"]
CRASH = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
CRASH += [ALLREDUCE, "10", "--crash-at", "5", "--print-steps"]
RESIDENT = ["--standalone", "--nproc-per-node", "2", str(WORKLOADS / "resident.py")]
CHARTS = {
    "noop_wall_seconds": ("No-op job, 2 workers: wall time", "seconds"),
    "first_start_seconds": ("Torch job, 2 workers, one all-reduce: wall time", "seconds"),
    "agent_peak_rss_mb": ("Launcher peak memory (RSS)", "MB"),
    "recovery_gap_seconds": ("Recovery gap after one worker crash", "seconds"),
    "step_gap_seconds": ("Crash job: last step before to first step after", "seconds"),
    "recovery_rate": ("Recoveries that finished the job", "fraction"),
}
OPTIONS = {
    "repeat": (10, "runs of each job per launcher"),
    "recovery_repeat": (20, "crash runs for rallypoint (torchrun: --repeat)"),
    "timeout": (60.0, "seconds before a run is killed"),
}
ROWS = [  # label, summary key, unit, target
    ("No-op 2-worker job, median wall time", "noop_wall_seconds", " s", "≤ 0.5x"),
    ("First start: 2 workers import torch, one all-reduce", "first_start_seconds", " s", "≤ 0.45x"),
    ("Launcher peak RSS, median", "agent_peak_rss_mb", " MB", "≤ 60 MB"),
    ("Recovery gap after one worker crash, median", "recovery_gap_seconds", " s", "≤ 0.25x"),
    ("Crash job: last step before to first step after", "step_gap_seconds", " s", "≤ 0.25x"),
]
#: The phases of a warm recovery, from the crash job's event log and its workers' lines.
PHASES = [
    ("crash", "worker_failed", "the crashed worker's exit, its peers stopped, the report"),
    ("worker_failed", "workers_started", "the restart policy, the rendezvous, the fork"),
    ("workers_started", "joined", "the script's set-up and init_process_group"),
    ("joined", "first_step", "the first all-reduce"),
]


def peak_rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith("VmHWM:")), 0)
    except (FileNotFoundError, ProcessLookupError):
        return 0


def _times(pattern: str, stdout: str) -> list[float]:
    return [float(t) for t in re.findall(pattern, stdout)]


def recovery_gap(stdout: str) -> float | None:
    """Seconds from rank 1's crash until every worker of the second attempt is running."""
    crash = _times(r"crashing rank=1 at=([\d.]+)", stdout)
    restarted = _times(r"started rank=\d+ attempt=1 at=([\d.]+)", stdout)
    if len(crash) != 1 or len(restarted) != 2:
        return None
    return max(restarted) - crash[0]


def step_gap(stdout: str) -> float | None:
    """Seconds from the last step both workers finished before the crash (step 4) to the
    first both finished after it."""
    before = _times(r"step rank=\d+ attempt=0 step=4 at=([\d.]+)", stdout)
    after = _times(r"step rank=\d+ attempt=1 step=0 at=([\d.]+)", stdout)
    if len(before) != 2 or len(after) != 2:
        return None
    return max(after) - max(before)


def phases(stdout: str, event_log: Path) -> dict[str, float] | None:
    """How long each phase of the recovery took (``PHASES``), in seconds."""
    marks: dict[str, float] = {}
    with contextlib.suppress(OSError, ValueError, KeyError):
        for line in event_log.read_text().splitlines():
            event = json.loads(line)
            if event["event"] in ("worker_failed", "workers_started"):
                marks[event["event"]] = event["wall_time"]  # the last: the restart's
    crash = _times(r"crashing rank=1 at=([\d.]+)", stdout)
    joined = _times(r"started rank=\d+ attempt=1 at=([\d.]+)", stdout)
    first = _times(r"step rank=\d+ attempt=1 step=0 at=([\d.]+)", stdout)
    if not crash or len(joined) != 2 or len(first) != 2 or len(marks) != 2:
        return None
    marks.update(crash=crash[0], joined=max(joined), first_step=max(first))
    return {f"{a}->{b}": marks[b] - marks[a] for a, b, _ in PHASES}


def run(launcher: str, args: list[str], timeout: float) -> dict[str, Any]:
    """One job; the launcher's peak RSS is sampled every 5 ms until it exits."""
    peak = 0

    def sample(process: subprocess.Popen[str], _: list[str]) -> None:
        nonlocal peak
        while process.poll() is None:
            peak = max(peak, peak_rss_kb(process.pid))
            time.sleep(0.005)

    script = next(a for a in args if a.endswith(".py"))
    with tempfile.TemporaryDirectory() as scratch:
        event_log = Path(scratch) / "events.jsonl"
        logged = ["--event-log", str(event_log)] if launcher == "rallypoint" else []
        command = [*LAUNCHERS[launcher], *logged, *args]
        code, stdout, wall = common.run_job(command, timeout, sample, script)
        # returncode None: killed after the timeout
        kept = dict(launcher=launcher, returncode=code, wall_seconds=wall, peak_rss_mb=peak / 1024)
        if "--crash-at" in args:
            done = ("done rank=0 world=2 attempt=1", "done rank=1 world=2 attempt=1")
            recovered = code == 0 and all(line in stdout for line in done)
            kept.update(recovered=recovered, gap=recovery_gap(stdout), step_gap=step_gap(stdout))
            if launcher == "rallypoint":
                kept["phases"] = phases(stdout, event_log)
    return kept


# --- memory: every process of the job, while its workers are up -----------------------------


def _memory_kb(pid: int) -> dict[str, int]:
    """RSS and PSS (a shared page counted once, split among its sharers) of ``pid``."""
    found = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    found[key.lower()] = int(rest.split()[0])
    except OSError:
        pass
    return found


def _tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as handle:
                    children = [int(child) for child in handle.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def memory(command: list[str], timeout: float) -> dict[str, Any]:
    """The job's processes by role once both workers are up: MB of RSS and PSS each."""
    process = subprocess.Popen(
        command,
        env=common.clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    workers: set[int] = set()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        assert process.stdout is not None
        for line in process.stdout:
            seen.append(line)
            if match := re.search(r"resident rank=\d+ pid=(\d+)", line):
                workers.add(int(match.group(1)))
            if len(workers) == 2 or time.monotonic() > deadline:
                break
        time.sleep(1.0)  # the pages the workers write after the all-reduce
        roles: dict[str, list[dict[str, int]]] = {"launcher": [_memory_kb(process.pid)]}
        for pid in _tree(process.pid):
            with contextlib.suppress(OSError, ValueError, KeyError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                role = "worker" if pid in workers else "other"
                if b"_rallypoint_zygote" in cmdline:
                    role = "preloaded interpreter"
                elif b"_rallypoint_keeper" in cmdline:
                    role = "keeper"
                roles.setdefault(role, []).append(_memory_kb(pid))
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    mb = {
        role: {key: sum(m.get(key, 0) for m in found) / 1024 / len(found) for key in ("rss", "pss")}
        for role, found in roles.items()
    }
    if len(workers) < 2:  # it failed: say how, measure nothing
        return {"error": "".join(seen[-10:])}
    total = sum(v["pss"] * len(roles[role]) for role, v in mb.items())
    return {
        "per_process_mb": mb,
        "counts": {r: len(f) for r, f in roles.items()},
        "node_pss_mb": total,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    def jobs(job: list[str], count: int) -> dict[str, list[dict[str, Any]]]:
        # torchrun's failed recoveries hang until the timeout: run it at most `repeat` times.
        return common.rounds(
            count,
            list(LAUNCHERS),
            lambda name: run(name, job, args.timeout),
            lambda run: f"{run['wall_seconds']:.2f} s, exit {run['returncode']}",
            rotate=False,
            skip=lambda name, index: name == "torchrun" and index >= args.repeat,
        )

    noop, first = jobs(NOOP, args.repeat), jobs(FIRST_START, args.repeat)
    crash = jobs(CRASH, args.recovery_repeat)
    summary = {}
    for name in LAUNCHERS:
        ok = [r["wall_seconds"] for r in noop[name] if r["returncode"] == 0]
        recovered = [r for r in crash[name] if r["recovered"]]
        summary[name] = {
            "noop_wall_seconds": common.median(ok),
            "noop_failures": len(noop[name]) - len(ok),
            "first_start_seconds": common.median(
                r["wall_seconds"] for r in first[name] if r["returncode"] == 0
            ),
            "agent_peak_rss_mb": common.median(r["peak_rss_mb"] for r in noop[name]),
            "recovery_runs": len(crash[name]),
            "recovered": len(recovered),
            "recovery_gap_seconds": common.median(
                r["gap"] for r in recovered if r["gap"] is not None
            ),
            "step_gap_seconds": common.median(
                r["step_gap"] for r in recovered if r["step_gap"] is not None
            ),
        }
    timed = [r["phases"] for r in crash["rallypoint"] if r["recovered"] and r.get("phases")]
    summary["rallypoint"]["phases"] = {
        key: common.median(p[key] for p in timed) for key in (timed[0] if timed else {})
    }
    cold = [*LAUNCHERS["rallypoint"], "--warm-start", "off"]
    mem = {
        "rallypoint": memory([*LAUNCHERS["rallypoint"], *RESIDENT], args.timeout),
        "rallypoint --warm-start off": memory([*cold, *RESIDENT], args.timeout),
        "torchrun": memory([*LAUNCHERS["torchrun"], *RESIDENT], args.timeout),
    }
    return {
        "summary": summary,
        "memory": mem,
        "samples": {"noop": noop, "first_start": first, "crash": crash},
        "timeout": args.timeout,
        "command": "make bench  # = " + common.command_line(),
    }


def charts(results: dict[str, Any]) -> None:
    for key, (title, unit) in CHARTS.items():
        values = []
        for data in results["summary"].values():
            if key == "recovery_rate":
                runs = int(data["recovery_runs"])
                values.append(int(data["recovered"]) / runs if runs else 0.0)
            else:
                values.append(float(data[key]) if isinstance(data[key], (int, float)) else 0.0)
        figure, axis = common.figure(figsize=(5, 2.6))
        bars = axis.barh(list(LAUNCHERS), values, color=list(common.COLORS.values()))
        axis.bar_label(bars, fmt="%.2f")
        axis.margins(x=0.15)
        axis.set_title(title)
        axis.set_xlabel(unit)
        axis.invert_yaxis()
        common.save(figure, f"bench_{key}.png")


def render(results: dict[str, Any]) -> dict[str, list[str]]:
    # Results written before the command was kept were measured by plain `make bench`.
    results.setdefault("command", "make bench  # = python benchmarks/bench_launcher.py")
    ours, theirs = results["summary"]["rallypoint"], results["summary"]["torchrun"]
    fmt = common.number

    def row(label: str, key: str, unit: str, target: str) -> list[object]:
        mine, other = ours.get(key), theirs.get(key)
        ratio = mine / other if isinstance(mine, (int, float)) and other else None
        return [label, fmt(mine, unit), fmt(other, unit), fmt(ratio, "x"), target]

    rows: list[str | list[object]] = [row(*spec) for spec in ROWS]
    runs = [f"{data['recovered']} of {data['recovery_runs']}" for data in (ours, theirs)]
    rows.append(f"Recoveries that finished the job | {' | '.join(runs)} | | all")
    facts = [
        f"- Python {results['python']}, torch {results['torch']}",
        f"- Timeout: a run not done after {results['timeout']:.0f} s is killed",
    ]
    header = "measurement | rallypoint | torchrun | ratio | target"
    blocks = {"results": [*common.measured(results, *facts), "", *common.table(header, rows)]}
    timed = ours.get("phases") or {}
    if timed:
        lines = [[why, fmt(timed.get(f"{a}->{b}"), " s")] for a, b, why in PHASES]
        blocks["phases"] = common.table("phase of rallypoint's recovery | median", lines)
    if "memory" in results:
        lines = []
        for launcher, found in results["memory"].items():
            if "error" in found:
                lines.append([launcher, "did not start", "", ""])
                continue
            for role, mb in found["per_process_mb"].items():
                count = found["counts"][role]
                lines.append(
                    [launcher, f"{role} (x{count})", fmt(mb["rss"], " MB"), fmt(mb["pss"], " MB")]
                )
            lines.append(
                [launcher, "**the node, all of them**", "", fmt(found["node_pss_mb"], " MB")]
            )
        blocks["memory"] = common.table("launcher | process | RSS each | PSS each", lines)
    return blocks


def main() -> None:
    args = common.options(__doc__, **OPTIONS).parse_args()
    common.publish(args, "launcher", "benchmarks", measure, charts, render)


if __name__ == "__main__":
    main()

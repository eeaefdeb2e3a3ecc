"""rallypoint against torchrun on one node: a no-op job's wall time, the launcher's peak
memory and the recovery from one worker crash, side by side (docs/benchmarks.md says how).

    .venv/bin/python benchmarks/bench_launcher.py [--repeat 10] [--recovery-repeat 20]
    .venv/bin/python benchmarks/bench_launcher.py --render-only
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import common
from common import LAUNCHERS, ROOT

NOOP = ["--standalone", "--nproc-per-node", "2", str(Path(__file__).parent / "workloads/noop.py")]
CRASH = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
CRASH += [str(ROOT / "tests" / "workers" / "allreduce.py"), "10", "--crash-at", "5"]
CHARTS = {
    "noop_wall_seconds": ("No-op job, 2 workers: wall time", "seconds"),
    "agent_peak_rss_mb": ("Launcher peak memory (RSS)", "MB"),
    "recovery_gap_seconds": ("Recovery gap after one worker crash", "seconds"),
    "recovery_rate": ("Recoveries that finished the job", "fraction"),
}
OPTIONS = {
    "repeat": (10, "runs of each job per launcher"),
    "recovery_repeat": (20, "crash runs for rallypoint (torchrun: --repeat)"),
    "timeout": (60.0, "seconds before a run is killed"),
}
ROWS = [  # label, summary key, unit, target
    ("No-op 2-worker job, median wall time", "noop_wall_seconds", " s", "≤ 0.5x"),
    ("Launcher peak RSS, median", "agent_peak_rss_mb", " MB", "≤ 60 MB"),
    ("Recovery gap after one worker crash, median", "recovery_gap_seconds", " s", "≤ 1x"),
]


def peak_rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith("VmHWM:")), 0)
    except (FileNotFoundError, ProcessLookupError):
        return 0


def recovery_gap(stdout: str) -> float | None:
    """Seconds from rank 1's crash until every worker of the second attempt is running."""
    crash = re.search(r"crashing rank=1 at=([\d.]+)", stdout)
    restarted = [float(t) for t in re.findall(r"started rank=\d+ attempt=1 at=([\d.]+)", stdout)]
    if not crash or len(restarted) != 2:
        return None
    return max(restarted) - float(crash.group(1))


def run(launcher: str, args: list[str], timeout: float) -> dict[str, Any]:
    """One job; the launcher's peak RSS is sampled every 5 ms until it exits."""
    peak = 0

    def sample(process: subprocess.Popen[str], _: list[str]) -> None:
        nonlocal peak
        while process.poll() is None:
            peak = max(peak, peak_rss_kb(process.pid))
            time.sleep(0.005)

    script = next(a for a in args if a.endswith(".py"))
    code, stdout, wall = common.run_job([*LAUNCHERS[launcher], *args], timeout, sample, script)
    # returncode None: killed after the timeout
    kept = dict(launcher=launcher, returncode=code, wall_seconds=wall, peak_rss_mb=peak / 1024)
    if "--crash-at" in args:
        done = ("done rank=0 world=2 attempt=1", "done rank=1 world=2 attempt=1")
        recovered = code == 0 and all(line in stdout for line in done)
        kept.update(recovered=recovered, gap=recovery_gap(stdout))
    return kept


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

    noop, crash = jobs(NOOP, args.repeat), jobs(CRASH, args.recovery_repeat)
    summary = {}
    for name in LAUNCHERS:
        ok = [r["wall_seconds"] for r in noop[name] if r["returncode"] == 0]
        recovered = [r for r in crash[name] if r["recovered"]]
        summary[name] = {
            "noop_wall_seconds": common.median(ok),
            "noop_failures": len(noop[name]) - len(ok),
            "agent_peak_rss_mb": common.median(r["peak_rss_mb"] for r in noop[name]),
            "recovery_runs": len(crash[name]),
            "recovered": len(recovered),
            "recovery_gap_seconds": common.median(
                r["gap"] for r in recovered if r["gap"] is not None
            ),
        }
    return {
        "summary": summary,
        "samples": {"noop": noop, "crash": crash},
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
        mine, other = ours[key], theirs[key]
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
    return {"results": [*common.measured(results, *facts), "", *common.table(header, rows)]}


def main() -> None:
    args = common.options(__doc__, **OPTIONS).parse_args()
    common.publish(args, "launcher", "benchmarks", measure, charts, render)


if __name__ == "__main__":
    main()

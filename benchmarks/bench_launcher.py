"""rallypoint against torchrun on one node, side by side in one run.

    .venv/bin/python benchmarks/bench_launcher.py [--repeat 10] [--recovery-repeat 20]
    .venv/bin/python benchmarks/bench_launcher.py --render-only

Measures, for both launchers, alternating runs so that machine noise hits both alike:

* wall time of a no-op job with 2 workers (``--standalone --nproc-per-node 2``);
* the launcher's own peak resident memory (VmHWM of the agent process, workers excluded);
* recovery after one worker crash (gloo, rank 1 raises at step 5 of the first attempt,
  ``--max-restarts 1``): whether the job then finishes, and the gap from the crash to the
  moment every restarted worker is running again (after ``init_process_group``).

Results go to ``benchmarks/results/launcher.json`` and ``docs/benchmarks.md`` with one PNG
chart per comparison in ``docs/img/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import common
from common import IMAGES, ROOT

BIN = Path(sys.executable).parent
WORKLOADS = Path(__file__).resolve().parent / "workloads"
CRASH_WORKLOAD = ROOT / "tests" / "workers" / "allreduce.py"
LAUNCHERS = {
    "rallypoint": [str(BIN / "rallypoint"), "run"],
    "torchrun": [str(BIN / "torchrun")],
}
RESULTS = ROOT / "benchmarks" / "results" / "launcher.json"
REPORT = ROOT / "docs" / "benchmarks.md"


@dataclass
class Run:
    launcher: str
    returncode: int | None  # None: killed after the timeout
    wall_seconds: float
    peak_rss_mb: float
    stdout: str


def _peak_rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def run_job(launcher: str, args: list[str], timeout: float) -> Run:
    """Run one job; sample the launcher's peak RSS until it exits; kill it all on timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "RALLYPOINT_"))}
    began = time.monotonic()
    process = subprocess.Popen(
        [*LAUNCHERS[launcher], *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _peak_rss_kb(process.pid))
            done.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stdout, _ = process.communicate(timeout=timeout)
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        # torchrun's workers may sit in sessions of their own, holding the output pipe open.
        _kill_leftovers(args)
        stdout, _ = process.communicate(timeout=30)
        code = None
    wall = time.monotonic() - began
    done.set()
    sampler.join()
    _kill_leftovers(args)
    return Run(launcher, code, wall, peak / 1024, stdout)


def _kill_leftovers(args: list[str]) -> None:
    """A launcher that hung or died may leave workers behind; do not let them skew the next run."""
    marker = next((a for a in args if a.endswith(".py")), None)
    if marker is None:
        return
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(entry.name) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def recovery_gap(stdout: str) -> float | None:
    """Seconds from rank 1's crash until every worker of the second attempt is running."""
    crash = re.search(r"crashing rank=1 at=([\d.]+)", stdout)
    restarted = [float(t) for t in re.findall(r"started rank=\d+ attempt=1 at=([\d.]+)", stdout)]
    if not crash or len(restarted) != 2:
        return None
    return max(restarted) - float(crash.group(1))


def recovered(run: Run) -> bool:
    return (
        run.returncode == 0
        and "done rank=0 world=2 attempt=1" in run.stdout
        and "done rank=1 world=2 attempt=1" in run.stdout
    )


def measure(repeat: int, recovery_repeat: int, timeout: float) -> dict[str, object]:
    noop_args = ["--standalone", "--nproc-per-node", "2", str(WORKLOADS / "noop.py")]
    crash_args = [
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        str(CRASH_WORKLOAD), "10", "--crash-at", "5",
    ]  # fmt: skip
    noop: dict[str, list[Run]] = {name: [] for name in LAUNCHERS}
    crash: dict[str, list[Run]] = {name: [] for name in LAUNCHERS}
    for index in range(repeat):
        for name in LAUNCHERS:
            noop[name].append(run_job(name, noop_args, timeout))
        print(f"no-op job {index + 1}/{repeat} done", flush=True)
    for index in range(recovery_repeat):
        # torchrun's failed recoveries hang until the timeout: run it at most `repeat` times.
        for name in LAUNCHERS:
            if name == "torchrun" and index >= repeat:
                continue
            crash[name].append(run_job(name, crash_args, timeout))
        print(f"crash job {index + 1}/{recovery_repeat} done", flush=True)

    summary: dict[str, dict[str, object]] = {}
    for name in LAUNCHERS:
        ok_noop = [r for r in noop[name] if r.returncode == 0]
        gaps = [
            g for r in crash[name] if recovered(r) and (g := recovery_gap(r.stdout)) is not None
        ]
        summary[name] = {
            "noop_wall_seconds": statistics.median(r.wall_seconds for r in ok_noop)
            if ok_noop
            else None,
            "noop_failures": len(noop[name]) - len(ok_noop),
            "agent_peak_rss_mb": statistics.median(r.peak_rss_mb for r in noop[name]),
            "recovery_runs": len(crash[name]),
            "recovered": sum(recovered(r) for r in crash[name]),
            "recovery_gap_seconds": statistics.median(gaps) if gaps else None,
        }
    return {
        "summary": summary,
        "samples": {
            "noop": {n: [_sample(r) for r in runs] for n, runs in noop.items()},
            "crash": {
                n: [
                    {**_sample(r), "recovered": recovered(r), "gap": recovery_gap(r.stdout)}
                    for r in runs
                ]
                for n, runs in crash.items()
            },
        },
    }


def _sample(run: Run) -> dict[str, object]:
    record = asdict(run)
    del record["stdout"]
    return record


def ratio(ours: object, theirs: object) -> float | None:
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and theirs:
        return float(ours) / float(theirs)
    return None


def charts(summary: dict[str, dict[str, object]]) -> list[tuple[str, str]]:
    plt = common.pyplot()
    made = []
    for key, title, unit in [
        ("noop_wall_seconds", "No-op job, 2 workers: wall time", "seconds"),
        ("agent_peak_rss_mb", "Launcher peak memory (RSS)", "MB"),
        ("recovery_gap_seconds", "Recovery gap after one worker crash", "seconds"),
        ("recovery_rate", "Recoveries that finished the job", "fraction"),
    ]:
        values = []
        for name in LAUNCHERS:
            data = summary[name]
            if key == "recovery_rate":
                runs = int(data["recovery_runs"])  # type: ignore[call-overload]
                values.append(int(data["recovered"]) / runs if runs else 0.0)  # type: ignore[call-overload]
            else:
                value = data[key]
                values.append(float(value) if isinstance(value, (int, float)) else 0.0)
        figure, axis = plt.subplots(figsize=(5, 2.6))
        bars = axis.barh(list(LAUNCHERS), values, color=["#2b7bba", "#999999"])
        axis.bar_label(bars, fmt="%.2f")
        axis.margins(x=0.15)
        axis.set_title(title)
        axis.set_xlabel(unit)
        axis.invert_yaxis()
        made.append((title, common.save_chart(figure, IMAGES / f"bench_{key}.png")))
    return made


def render(results: dict[str, object], command: str) -> str:
    summary: dict[str, dict[str, object]] = results["summary"]  # type: ignore[assignment]
    ours, theirs = summary["rallypoint"], summary["torchrun"]

    def fmt(value: object, unit: str = "") -> str:
        return f"{value:.2f}{unit}" if isinstance(value, (int, float)) else "n/a"

    rows = [
        ("No-op 2-worker job, median wall time", "noop_wall_seconds", " s", "≤ 0.5x"),
        ("Launcher peak RSS, median", "agent_peak_rss_mb", " MB", "≤ 60 MB"),
        ("Recovery gap after one worker crash, median", "recovery_gap_seconds", " s", "≤ 1x"),
    ]
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`benchmarks/bench_launcher.py`); do not edit by hand.",
        "rallypoint and torchrun run alternately in one session on the same machine, so both",
        "see the same noise. Ratios are rallypoint / torchrun.",
        "",
        f"- Measured: {results['date']} on {results['machine']}",
        f"- Python {results['python']}, torch {results['torch']}",
        f"- Command: `{command}`",
        "",
        "| measurement | rallypoint | torchrun | ratio | target |",
        "|---|---|---|---|---|",
    ]
    for label, key, unit, target in rows:
        r = ratio(ours[key], theirs[key])
        lines.append(
            f"| {label} | {fmt(ours[key], unit)} | {fmt(theirs[key], unit)} | "
            f"{fmt(r, 'x')} | {target} |"
        )
    lines.append(
        f"| Recoveries that finished the job | {ours['recovered']} of {ours['recovery_runs']} | "
        f"{theirs['recovered']} of {theirs['recovery_runs']} | | all |"
    )
    lines += [
        "",
        "The no-op job runs `benchmarks/workloads/noop.py` with `--standalone --nproc-per-node 2`.",
        "Peak RSS is the launcher process's VmHWM, sampled every 5 ms; workers are not counted.",
        "The crash job is `tests/workers/allreduce.py 10 --crash-at 5` (gloo all-reduce, rank 1",
        "raises at step 5 of the first attempt) with `--max-restarts 1`; the gap runs from the",
        "crash to the moment both restarted workers have joined their new process group. A run",
        f"that does not finish within {results['timeout']:.0f} s counts as not recovered.",
        "",
    ]
    for title, image in results["charts"]:  # type: ignore[attr-defined]
        lines += [f"![{title}]({image})", ""]
    lines += MORE_BENCHMARKS
    return "\n".join(lines)


#: The other benchmarks' pages, each written by its own script (``make bench`` runs all).
MORE_BENCHMARKS = [
    "## More benchmarks",
    "",
    "Each on its own page, written by its own script; `make bench` runs them all.",
    "",
    "- [Rendezvous](benchmarks-rendezvous.md) (`benchmarks/bench_rendezvous.py`): time to",
    "  form one round of 8 to 1024 simulated nodes on the c10d, etcd and Redis backends,",
    "  beside torch's c10d rendezvous.",
    "- [Node-kill recovery](benchmarks-recovery.md) (`benchmarks/bench_recovery.py`): from",
    "  the SIGKILL of one of two nodes to the survivors training again, beside torchrun.",
    "- [Preemption recovery](benchmarks-recovery-preempt.md) (`benchmarks/bench_recovery.py",
    "  --kill preempt`): the same from a SIGTERM to one node's agent, as a preemption sends.",
    "- [Checkpoint saves](benchmarks-checkpoint.md) (`benchmarks/bench_checkpoint.py`):",
    "  how long a save stops the training loop, `torch.save` against the asynchronous mode.",
    "- [Worker metrics](benchmarks-metrics.md) (`benchmarks/bench_metrics.py`): what",
    "  worker metrics cost a training step.",
    "",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10, help="runs of each job per launcher")
    parser.add_argument(
        "--recovery-repeat",
        type=int,
        default=20,
        help="crash runs for rallypoint (torchrun: --repeat)",
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds before a run is killed"
    )
    common.add_render_only(parser, RESULTS)
    args = parser.parse_args()
    if args.render_only:
        saved: dict[str, object] = json.loads(RESULTS.read_text())
        # Results written before the command was kept were measured by plain `make bench`.
        command = str(saved.get("command", "make bench  # = python benchmarks/bench_launcher.py"))
        REPORT.write_text(render(saved, command) + "\n")
        common.wrote(REPORT)
        return
    import torch

    results = measure(args.repeat, args.recovery_repeat, args.timeout)
    results.update(
        common.measured_on(),
        python=platform.python_version(),
        torch=torch.__version__,
        timeout=args.timeout,
    )
    results["charts"] = charts(results["summary"])  # type: ignore[arg-type]
    command = "make bench  # = " + " ".join(
        ["python", "benchmarks/bench_launcher.py", *sys.argv[1:]]
    )
    results["command"] = command
    common.write_results(RESULTS, results)
    REPORT.write_text(render(results, command) + "\n")
    print(json.dumps(results["summary"], indent=2))
    common.wrote(RESULTS, REPORT)


if __name__ == "__main__":
    main()

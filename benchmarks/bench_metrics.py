"""The cost of worker metrics on a training loop: metrics off, no-op and exported, side by
side; the script is its own worker (``--as-worker``). docs/benchmarks-metrics.md says how.

    .venv/bin/python benchmarks/bench_metrics.py [--repeat 5] [--steps 500] [--nproc 1]
    .venv/bin/python benchmarks/bench_metrics.py --render-only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import common

MODES = ("off", "no-op", "prometheus")
STEP_SECONDS = 0.010
WARMUP = 20
TARGET = 0.02
OPTIONS = {
    "repeat": (5, "runs of each mode"),
    "steps": (500, "measured steps per run"),
    "nproc": (1, "workers per run"),
    "timeout": (120.0, "seconds before a run is killed"),
}
# A proxy from the environment can never reach the agent on loopback.
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def work(steps: int, emit: bool) -> None:
    """The training loop of one worker; prints one ``BENCH {json}`` line at the end."""
    from rallypoint import metrics

    counter = metrics.counter("bench_steps", "Steps of the benchmark loop.")
    histogram = metrics.histogram("bench_step_seconds", "Step time of the benchmark loop.")
    step_times: list[float] = []
    call_times: list[float] = []
    previous = STEP_SECONDS
    for _ in range(steps + WARMUP):
        began = time.perf_counter()
        deadline = began + STEP_SECONDS
        while time.perf_counter() < deadline:  # the step's computation
            pass
        called = time.perf_counter()
        if emit:
            counter.inc()
            histogram.observe(previous)
        ended = time.perf_counter()
        previous = ended - began
        step_times.append(previous)
        call_times.append(ended - called)
    report = {
        "rank": int(os.environ.get("RANK", "0")),
        "enabled": metrics.enabled(),
        "step_median": statistics.median(step_times[WARMUP:]),
        "step_mean": statistics.fmean(step_times[WARMUP:]),
        "call_median": statistics.median(call_times[WARMUP:]),
        "call_mean": statistics.fmean(call_times[WARMUP:]),
    }
    print("BENCH " + json.dumps(report), flush=True)


def run_once(mode: str, steps: int, nproc: int, timeout: float) -> dict[str, Any]:
    """One job in ``mode``; the workers' reports and how many scrapes were made."""
    command = [*common.LAUNCHERS["rallypoint"], "--standalone", "--nproc-per-node", str(nproc)]
    if mode == "prometheus":
        command += ["--metrics", "prometheus", "--metrics-conf", "addr=127.0.0.1"]
    command += [str(Path(__file__).resolve()), "--as-worker", "--steps", str(steps)]
    scrapes = {"ok": 0, "failed": 0}

    def scrape(process: subprocess.Popen[str], lines: list[str]) -> None:
        """As Prometheus would, once a second, from when the agent says where."""
        port = None
        while mode == "prometheus" and process.poll() is None:
            if port is None:
                match = re.search(r"metrics on http://[^:]+:(\d+)/metrics", "".join(lines))
                port = int(match.group(1)) if match else None
            if port is None:
                time.sleep(0.01)
                continue
            try:
                with HTTP.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                    reply.read()
                scrapes["ok"] += 1
            except OSError:
                scrapes["failed"] += 1
            time.sleep(1.0)

    code, output, _ = common.run_job(command + ["--emit"] * (mode != "off"), timeout, scrape)
    reports = [
        json.loads(line.split("BENCH ", 1)[1]) for line in output.splitlines() if "BENCH {" in line
    ]
    return {"mode": mode, "returncode": code, "workers": reports, "scrapes": scrapes}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from importlib.metadata import version

    def show(run: dict[str, Any]) -> str:
        return f"exit {run['returncode']}, {len(run['workers'])} worker reports"

    def once(mode: str) -> dict[str, Any]:
        return run_once(mode, args.steps, args.nproc, args.timeout)

    runs = common.rounds(args.repeat, MODES, once, show)
    summary: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        ok = [r for r in runs[mode] if r["returncode"] == 0 and len(r["workers"]) == args.nproc]
        workers = [w for r in ok for w in r["workers"]]
        step = common.median(w["step_median"] for w in workers)
        calls = common.median(w["call_median"] for w in workers)
        summary[mode] = {
            "runs": len(runs[mode]),
            "failed_runs": len(runs[mode]) - len(ok),
            "enabled": sorted({bool(w["enabled"]) for w in workers}),
            "step_ms": None if step is None else step * 1e3,
            "calls_us": None if calls is None else calls * 1e6,
            "calls_fraction_of_step": None if calls is None else calls / STEP_SECONDS,
            "scrapes": sum(r["scrapes"]["ok"] for r in ok),
            "failed_scrapes": sum(r["scrapes"]["failed"] for r in ok),
        }
    base = summary["off"]["step_ms"]
    for data in summary.values():
        step = data["step_ms"]
        data["overhead_vs_off"] = (step - base) / base if step is not None and base else None
    return {
        "summary": summary,
        "runs": runs,
        "prometheus_client": version("prometheus_client"),
        **{key: getattr(args, key) for key in ("repeat", "steps", "nproc")},
    }


def chart(results: dict[str, Any]) -> None:
    summary = results["summary"]
    figure, (share, calls) = common.figure(1, 2, figsize=(9.5, 2.8))
    colors = ["#999999", "#7fb2d9", "#2b7bba"]
    measured = [100 * float(summary[m]["overhead_vs_off"] or 0.0) for m in MODES]
    direct = [100 * float(summary[m]["calls_fraction_of_step"] or 0.0) for m in MODES]
    rows = range(len(MODES))
    bars = share.barh([r - 0.2 for r in rows], measured, height=0.4, color=colors)
    share.bar_label(bars, fmt="%.2f %%", fontsize=8)
    bars = share.barh([r + 0.2 for r in rows], direct, height=0.4, color=colors, hatch="//")
    share.bar_label(bars, fmt="%.2f %%", fontsize=8)
    share.axvline(100 * TARGET, color="#c0392b", linestyle="--", linewidth=1)
    share.text(100 * TARGET, -0.7, " target", color="#c0392b", fontsize=8)
    share.set_yticks(list(rows), list(MODES))
    share.set_xlim(min(0.0, *measured) - 0.1, 100 * TARGET * 1.15)
    share.set_title("Cost, % of a 10 ms step", fontsize=10)
    share.set_xlabel("plain: step time vs off; hatched: the calls alone", fontsize=8)
    share.invert_yaxis()
    micro = [float(summary[m]["calls_us"] or 0.0) for m in MODES]
    bars = calls.barh(list(MODES), micro, color=colors)
    calls.bar_label(bars, fmt="%.1f µs")
    calls.margins(x=0.25)
    calls.set_title("Counter + histogram call time per step", fontsize=10)
    calls.set_xlabel("µs (median)", fontsize=8)
    calls.invert_yaxis()
    common.save(figure, "bench_metrics_overhead.png")


def render(results: dict[str, Any]) -> dict[str, list[str]]:
    summary = results["summary"]

    def pct(value: object) -> str:
        return f"{100 * value:+.2f} %" if isinstance(value, (int, float)) else "n/a"

    exported = summary["prometheus"]
    shares = (exported["overhead_vs_off"], exported["calls_fraction_of_step"])
    worst = max((v for v in shares if v is not None), default=None)
    verdict = (
        "n/a"
        if worst is None
        else ("met" if worst < TARGET else "missed")
        + f": at most {100 * worst:.2f} % of the step, target under {100 * TARGET:.0f} %"
    )
    facts = [
        f"- Python {results['python']}, prometheus_client {results['prometheus_client']}",
        f"- {results['repeat']} runs per mode, {results['steps']} steps per run after "
        f"{WARMUP} warm-up steps, workers per run: {results['nproc']}",
    ]
    target = f"- Target (under {100 * TARGET:.0f} % of a 10 ms step with exported metrics): **{verdict}**"
    header = "mode | median step time | vs off | metrics calls per step | share of the step"
    rows = []
    for mode in MODES:
        row = summary[mode]
        share = pct(row["calls_fraction_of_step"]).lstrip("+")
        step = common.number(row["step_ms"], " ms", 3)
        calls = common.number(row["calls_us"], " µs", 1)
        rows.append([mode, step, pct(row["overhead_vs_off"]), calls, share, row["scrapes"]])
    table = common.table(header + " | scrapes", rows)
    return {"results": [*common.measured(results, *facts), target, "", *table]}


def main() -> None:
    if sys.argv[1:2] == ["--as-worker"]:  # --as-worker --steps N [--emit]: one job's worker
        work(int(sys.argv[3]), "--emit" in sys.argv)
        return
    options = common.options(__doc__, **OPTIONS)
    common.publish(options.parse_args(), "metrics", "benchmarks-metrics", measure, chart, render)


if __name__ == "__main__":
    main()

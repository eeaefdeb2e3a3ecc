"""What the goodput account costs where it is paid: in the Prometheus sink (each event it
takes, each scrape) and in ``rallypoint report``; the event-by-event accountant against
the code it replaced (issue 38), loaded from git and run side by side on the same
synthetic event stream. docs/benchmarks-scrape.md says how.

    .venv/bin/python benchmarks/bench_scrape.py [--sizes 10000,100000,1000000]
    .venv/bin/python benchmarks/bench_scrape.py --render-only
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import common
from common import ROOT
from scrape_stream import STEP_SECONDS, Shape, stopping, stream

from rallypoint import goodput, sdk
from rallypoint.events import Event
from rallypoint_prometheus.goodput import GoodputMetrics

#: The last commit with the account that was recomputed at every scrape.
REFERENCE = "66303c69734a8dc0c588d16b02b3793984a5ca10"
IMPLEMENTATIONS = ("reference", "accountant")
COLORS = {"reference": "#999999", "accountant": "#2b7bba"}
LABELS = {"run_id": "bench-38", "node": "node-0", "role": "trainer"}
OPTIONS = {
    "sizes": ("10000,100000,1000000", "events the sink has taken at each measured scrape"),
    "report_sizes": ("10000,1000000", "events of the job's logs for the report's account"),
    "scrapes": (7, "scrapes timed at each size"),
    "nodes": (4, "nodes of the job"),
    "ranks": (8, "workers per node, each saving"),
    "save_every": (100, "steps between checkpoints"),
    "fail_every": (8_000, "steps between failures, on average"),
    "reference": (REFERENCE, "git revision of the code measured against"),
}
Sink = Any  # a GoodputMetrics of either implementation


# --- the code measured against ----------------------------------------------------------


def load_reference(revision: str, directory: Path) -> tuple[types.ModuleType, type]:
    """The account module and the sink's goodput collector of ``revision``, as modules of
    their own beside the current ones; the collector calls the account of its revision."""

    def load(path: str, name: str) -> types.ModuleType:
        source = subprocess.run(
            ["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, text=True,
            check=True,
        ).stdout  # fmt: skip
        file = directory / f"{name}.py"
        file.write_text(source)
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        return module

    account = load("core/rallypoint/goodput.py", "reference_goodput")
    sink = load("plugins/metrics_prometheus/rallypoint_prometheus/goodput.py", "reference_sink")
    names = {name: getattr(sdk, name) for name in sdk.__all__}
    sink.sdk = types.SimpleNamespace(  # type: ignore[attr-defined]
        **{**names, "goodput_account": account.account, "goodput_stall": account.stall}
    )
    return account, sink.GoodputMetrics


def sink(name: str, reference: type) -> Sink:
    """A goodput collector of the sink, ``reference`` or ``accountant``."""
    return (reference if name == "reference" else GoodputMetrics)(LABELS, tuple(LABELS))


# --- measuring ----------------------------------------------------------------------------


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(args.nodes, args.ranks, args.save_every, args.fail_every)


def node_events(shape: Shape, count: int) -> Iterator[Event]:
    """The first ``count`` events of node 0, the ones its agent's sink gets, ending about
    now (a scrape's ``now`` is the clock's)."""
    per_step = 1 + shape.ranks / shape.save_every
    start = time.time() - count / per_step * STEP_SECONDS
    mine = (e for e in stream(shape, start) if e.run.node_id == LABELS["node"])
    return itertools.islice(mine, count)


def sink_figures(
    args: argparse.Namespace, reference: type, account: types.ModuleType
) -> list[dict[str, Any]]:
    """Feed both sinks node 0's events, alternately one then the other, timing each call;
    at each size, time scrapes of both, alternately, and check that they agree."""
    sizes = sorted(int(s) for s in args.sizes.split(","))
    measured = {name: sink(name, reference) for name in IMPLEMENTATIONS}
    fed = dict.fromkeys(IMPLEMENTATIONS, 0.0)
    figures: list[dict[str, Any]] = []
    for index, event in enumerate(node_events(shape_of(args), sizes[-1]), start=1):
        for name in IMPLEMENTATIONS if index % 2 else IMPLEMENTATIONS[::-1]:
            began = time.perf_counter()
            measured[name].emit(event)
            fed[name] += time.perf_counter() - began
        if index in sizes:
            figures.append(
                {
                    "events": index,
                    "feed_seconds": dict(fed),
                    **scrapes(measured, account, args.scrapes),
                }
                | {"agree": agree(measured, account), "kept": kept(measured)}
                | {"failures": len(measured["accountant"]._accountant.snapshot().incidents)}
            )
            print(f"{index} events: {figures[-1]}", flush=True)
    return figures


def scrapes(measured: dict[str, Sink], account: types.ModuleType, count: int) -> dict[str, Any]:
    """Median seconds of a whole collection (what a scrape waits for) and of the account's
    part of it alone, ``count`` times each, the two implementations by turns."""
    accounts: dict[str, Callable[[float], object]] = {
        "reference": lambda now: account.account(measured["reference"]._records.records, now=now),
        "accountant": measured["accountant"]._accountant.snapshot,
    }
    times: dict[str, dict[str, list[float]]] = {"scrape": {}, "account": {}}
    for round_ in range(count):
        for name in IMPLEMENTATIONS if round_ % 2 else IMPLEMENTATIONS[::-1]:
            began = time.perf_counter()
            list(measured[name].collect())
            middle = time.perf_counter()
            accounts[name](time.time())
            ended = time.perf_counter()
            times["scrape"].setdefault(name, []).append(middle - began)
            times["account"].setdefault(name, []).append(ended - middle)
    return {
        f"{part}_seconds": {name: statistics.median(t) for name, t in by_name.items()}
        for part, by_name in times.items()
    }


def agree(measured: dict[str, Sink], account: types.ModuleType) -> bool:
    """Whether both give the same account at the same moment: phases, failures."""
    now = time.time()
    old = account.account(measured["reference"]._records.records, now=now)
    new = measured["accountant"]._accountant.snapshot(now)
    phases = all(math.isclose(old.phases[p], new.phases[p], abs_tol=1e-6) for p in new.phases)
    return phases and [vars(i) for i in old.incidents] == [vars(i) for i in new.incidents]


def kept(measured: dict[str, Sink]) -> dict[str, int]:
    """What each keeps: the reference its records; the accountant its attempts and the
    spans of its stalls."""
    accountant = measured["accountant"]._accountant
    runs = sum(len(t.runs) for t in accountant._nodes.values())
    return {
        "reference": len(measured["reference"]._records.records),
        "accountant": runs + len(accountant._stalls),
    }


def memory_figures(args: argparse.Namespace, reference: type) -> dict[str, list[int]]:
    """The bytes each sink holds after each size (tracemalloc), one sink at a time."""
    sizes = sorted(int(s) for s in args.sizes.split(","))
    held: dict[str, list[int]] = {name: [] for name in IMPLEMENTATIONS}
    for name in IMPLEMENTATIONS:
        gc.collect()
        tracemalloc.start()
        measured = sink(name, reference)
        for index, event in enumerate(node_events(shape_of(args), sizes[-1]), start=1):
            measured.emit(event)
            if index in sizes:
                gc.collect()
                held[name].append(tracemalloc.get_traced_memory()[0])
        tracemalloc.stop()
        del measured
    return held


def report_figures(args: argparse.Namespace, account: types.ModuleType) -> list[dict[str, Any]]:
    """Both accounts of the whole job's logs (every node's events, as records)."""
    figures = []
    for size in sorted(int(s) for s in args.report_sizes.split(",")):
        records, runs, last = [], {}, 0.0
        for event in itertools.islice(stream(shape_of(args), 1.0e9), size):
            records.append(json.loads(event.to_json()))
            runs[event.run.node_id], last = event.run, event.wall_time
        records += [json.loads(e.to_json()) for e in stopping(list(runs.values()), last + 1)]
        repeat = 3 if size <= 100_000 else 1
        seconds: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
        results: dict[str, Any] = {}
        functions: dict[str, Callable[..., Any]] = {
            "reference": account.account,
            "accountant": goodput.account,
        }
        for round_ in range(repeat):
            for name in IMPLEMENTATIONS if round_ % 2 else IMPLEMENTATIONS[::-1]:
                gc.collect()
                began = time.perf_counter()
                results[name] = functions[name](records)
                seconds[name].append(time.perf_counter() - began)
        old, new = results["reference"], results["accountant"]
        same = all(math.isclose(old.phases[p], new.phases[p], abs_tol=1e-6) for p in new.phases)
        same = same and [vars(i) for i in old.incidents] == [vars(i) for i in new.incidents]
        figures.append(
            {"events": len(records), "seconds": {n: statistics.median(s) for n, s in seconds.items()},
             "agree": same, "failures": len(new.incidents), "goodput": new.goodput}
        )  # fmt: skip
        print(f"report of {len(records)} events: {figures[-1]}", flush=True)
        del records, results, old, new
    return figures


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-scrape-") as directory:
        account, reference = load_reference(args.reference, Path(directory))
        sink = sink_figures(args, reference, account)
        memory = memory_figures(args, reference)
        report = report_figures(args, account)
    return {
        "git": common.git_state("core", "rallypoint/goodput/accountant.py"),
        "reference": args.reference,
        "settings": {k: getattr(args, k) for k in OPTIONS if k != "reference"},
        "sink": sink,
        "memory": memory,
        "report": report,
    }


# --- the page -----------------------------------------------------------------------------


def chart(results: dict[str, Any]) -> None:
    figure, axes = common.figure(1, 2, figsize=(10, 3.2))
    rows = results["sink"]
    events = [row["events"] for row in rows]
    for name in IMPLEMENTATIONS:
        scrape = [row["account_seconds"][name] * 1e3 for row in rows]
        feed = [row["feed_seconds"][name] / row["events"] * 1e6 for row in rows]
        axes[0].plot(events, scrape, "o-", color=COLORS[name], label=name)
        axes[1].plot(events, feed, "o-", color=COLORS[name], label=name)
    for axis, label in zip(
        axes, ("the account at a scrape, ms (median)", "taking an event, µs (mean)"), strict=True
    ):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("events the sink has taken")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle("The Prometheus sink's goodput account, one node's events", fontsize=10)
    common.save(figure, "bench_scrape.png")


def _times(value: float) -> str:
    return f"{value:.0f}x" if value >= 10 else f"{value:.1f}x"


def _duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def render(results: dict[str, Any]) -> dict[str, list[str]]:
    settings = results["settings"]
    setup = common.measured(
        results,
        f"- Python {results['python']}; rallypoint {results['git']}, against "
        f"{results['reference'][:7]} (the reference)",
        f"- Load average (1, 5, 15 min) before / after: {results['load_before']} / "
        f"{results['load_after']}",
        f"- The stream: {settings['nodes']} nodes of {settings['ranks']} workers, progress "
        f"every {STEP_SECONDS} s step, every rank saving every {settings['save_every']} "
        f"steps, a failure every {settings['fail_every']} steps on average; "
        f"{settings['scrapes']} scrapes timed at each size",
    )
    scrape_rows, feed_rows = [], []
    memory = results["memory"]
    for index, row in enumerate(results["sink"]):
        account, scrape, feed, kept = (
            row["account_seconds"], row["scrape_seconds"], row["feed_seconds"], row["kept"],
        )  # fmt: skip
        scrape_rows.append([
            f"{row['events']:,}", row["failures"],
            _duration(account["reference"]), _duration(account["accountant"]),
            _times(account["reference"] / account["accountant"]),
            _duration(scrape["reference"]), _duration(scrape["accountant"]),
            _times(scrape["reference"] / scrape["accountant"]),
            "yes" if row["agree"] else "**no**",
        ])  # fmt: skip
        each = {name: feed[name] / row["events"] for name in IMPLEMENTATIONS}
        feed_rows.append([
            f"{row['events']:,}",
            f"{each['reference'] * 1e6:.1f} µs", f"{each['accountant'] * 1e6:.1f} µs",
            _times(each["reference"] / each["accountant"]),
            f"{memory['reference'][index] / 1e6:.2f} MB ({kept['reference']:,} records)",
            f"{memory['accountant'][index] / 1e6:.2f} MB "
            f"({kept['accountant']:,} attempts and stalls)",
        ])  # fmt: skip
    scrape_header = (
        "events taken | failures | account, reference | account, accountant | ratio | whole scrape, "
        "reference | whole scrape, accountant | ratio | same account"
    )
    feed_header = (
        "events taken | per event, reference | per event, accountant | ratio | held, reference"
        " | held, accountant"
    )
    report_rows = [
        [f"{row['events']:,}", _duration(row["seconds"]["reference"]),
         _duration(row["seconds"]["accountant"]),
         _times(row["seconds"]["reference"] / row["seconds"]["accountant"]),
         row["failures"], "yes" if row["agree"] else "**no**"]
        for row in results["report"]
    ]  # fmt: skip
    report_header = "events in the logs | reference | accountant | ratio | failures | same account"
    return {
        "setup": setup,
        "scrape": common.table(scrape_header, scrape_rows),
        "feed": common.table(feed_header, feed_rows),
        "report": common.table(report_header, report_rows),
    }


def main() -> None:
    args = common.options(__doc__, **OPTIONS).parse_args()
    common.publish(args, "scrape", "benchmarks-scrape", measure, chart, render)


if __name__ == "__main__":
    main()

"""The tables and chart of ``docs/benchmarks-rendezvous.md``, and its verdicts against the
targets, written from the rendezvous benchmark's results (by ``bench_rendezvous.py``).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import common

#: Everything --backends can name, in the order of the page's columns and the chart's
#: legend. ``-sealed``: the same store, every node holding a job token (its records sealed).
IMPLEMENTATIONS = (
    "c10d", "c10d-sealed", "etcd", "etcd-sealed", "redis", "redis-sealed", "torch"
)  # fmt: skip
#: The ones that run rallypoint's protocol over a backend plugin's store; torch is torch's own.
STORE_BACKENDS = ("c10d", "etcd", "redis")
LABELS = {
    "c10d": "rallypoint on c10d",
    "etcd": "rallypoint on etcd",
    "redis": "rallypoint on Redis",
    "torch": "torch c10d",
}
LABELS |= {f"{name}-sealed": f"{LABELS[name]}, sealed" for name in STORE_BACKENDS}
STYLES: dict[str, dict[str, Any]] = {
    "c10d": {"color": "#2b7bba", "marker": "o", "offset": (6, -12)},
    "etcd": {"color": "#2ca02c", "marker": "^", "offset": (-14, 8)},
    "redis": {"color": "#d1780f", "marker": "D", "offset": (8, -6)},
    "torch": {"color": "#777777", "marker": "s", "offset": (-12, 8)},
}
STYLES |= {
    f"{name}-sealed": {**STYLES[name], "linestyle": ":", "offset": (6, 6)}
    for name in STORE_BACKENDS
}


def store_of(name: str) -> str:
    """The store an implementation runs on: ``c10d-sealed`` runs on c10d's."""
    return name.removesuffix("-sealed")


def sealed(name: str) -> bool:
    return name.endswith("-sealed")


@dataclass(frozen=True)
class Target:
    """What an implementation should reach: ``seconds`` for ``TARGET_NODES`` nodes, and
    (``linear``) growth no worse than linear between successive N."""

    seconds: float
    issue: int
    linear: bool = False


TARGET_NODES = 1024
TARGETS = {
    "c10d": Target(2.0, issue=4, linear=True),
    "etcd": Target(3.0, issue=6),
    "redis": Target(2.0, issue=7),
}


def ok_points(table: dict[str, Any], sizes: Sequence[int]) -> list[tuple[int, float]]:
    """(N, median seconds) of every size where every run succeeded."""
    runs = [(n, table[str(n)]) for n in sizes]
    return [(n, record["median_seconds"]) for n, record in runs if record["status"] == "ok"]


def target_row(name: str, table: dict[str, Any], sizes: Sequence[int]) -> list[object]:
    """Did ``name`` form a round of ``TARGET_NODES`` within its target, at every size?"""
    target, points = TARGETS[name], ok_points(table, sizes)
    slopes = [
        (a, b, math.log(tb / ta) / math.log(b / a))
        for (a, ta), (b, tb) in itertools.pairwise(points)
    ]
    at_target = next((t for n, t in points if n == TARGET_NODES), None)
    every_size = all(table[str(n)]["status"] == "ok" for n in sizes)
    linear = bool(slopes) and all(slope <= 1.0 for *_, slope in slopes)
    met = every_size and at_target is not None and at_target < target.seconds
    met = met and (linear or not target.linear)
    wanted = f"under {target.seconds:g} s" + ", growth at most linear" * target.linear
    growth = ", ".join(f"{a}→{b}: {slope:.2f}" for a, b, slope in slopes)
    if growth:
        growth += " (at most linear)" if linear else " (not at most linear)"
    return [
        LABELS[name],
        target.issue,
        wanted,
        "no result" if at_target is None else f"{at_target:.3f} s",
        growth or "n/a",
        f"**{'met' if met else 'not met'}**",
    ]


def chart(results: dict[str, Any]) -> None:
    sizes = results["sizes"]
    figure, axis = common.figure(figsize=(7.0, 4.8))

    def note(text: str, at: tuple[float, float], offset: tuple[int, int], **style: Any) -> None:
        axis.annotate(text, at, textcoords="offset points", xytext=offset, **style)

    for name, table in results["table"].items():
        style = STYLES[name]
        color = style["color"]
        ok = ok_points(table, sizes)
        if ok:
            axis.plot(
                *zip(*ok, strict=True),
                linewidth=2,
                linestyle=style.get("linestyle", "-"),
                color=color,
                marker=style["marker"],
                label=LABELS[name],
            )
            for n, seconds in ok:
                note(f"{seconds:.3g}", (n, seconds), style["offset"], fontsize=7, color=color)
        for n in sizes:
            record = table[str(n)]
            if record["status"] == "timed out":
                cap = record["cap_seconds"]
                axis.plot([n], [cap], marker="x", markersize=10, color=color)
                note(f"timed out (> {cap:.0f} s)", (n, cap), (-30, 8), fontsize=8, color=color)
    low, high = min(sizes), max(sizes)
    for name, target in TARGETS.items():
        if target.linear and name in results["table"]:
            axis.plot(
                [low, high],
                [target.seconds * n / TARGET_NODES for n in (low, high)],
                linestyle="--",
                color="#d62728",
                linewidth=1,
                label=f"linear to {target.seconds:g} s at {TARGET_NODES} ({LABELS[name]} target)",
            )
    measured = {n: t for n, t in TARGETS.items() if n in results["table"]}
    for seconds in sorted({t.seconds for t in measured.values()}):
        who = (
            LABELS[n].removeprefix("rallypoint on ")
            for n, t in measured.items()
            if t.seconds == seconds
        )
        axis.plot([TARGET_NODES], [seconds], marker="*", markersize=12, color="#d62728")
        text = f"target {', '.join(who)}: {seconds:g} s"
        note(text, (TARGET_NODES, seconds), (-95, 3), fontsize=7, color="#d62728")
    axis.set_xscale("log", base=2)
    axis.set_xlim(low / 1.4, high * 1.6)
    axis.set_yscale("log")
    axis.set_ylim(top=axis.get_ylim()[1] * 3)  # room for the labels of the highest points
    axis.set_xticks(list(sizes))
    axis.set_xticklabels([str(n) for n in sizes])
    axis.set_xlabel("nodes (N)")
    axis.set_ylabel("seconds to form one round (median)")
    axis.set_title("Rendezvous: time to form one round")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7, loc="upper left")
    common.save(figure, "bench_rdzv_round_time.png")


def cell(record: dict[str, Any]) -> str:
    if record["status"] == "ok":
        return f"{record['median_seconds']:.3f}"
    if record["status"] == "timed out":
        return f"timed out (> {record['cap_seconds']:.0f} s)"
    if record["status"] == "not run":
        return f"not run ({record['reason']})"
    return "failed"


def detail_row(n: int, name: str, record: dict[str, Any]) -> str:
    """Where the time of a round of ``n`` nodes on store ``name`` went."""
    if record["status"] != "ok":
        return f"{n} | {name} | {cell(record)}" + " | " * 6
    samples = record["samples"]
    ops = statistics.median(sum(s["store_requests"].values()) for s in samples)
    nodes_cpu = statistics.median(s["nodes_cpu"] for s in samples)
    server_cpu = statistics.median(s["server_cpu"] for s in samples)
    cells = [record["median_first_done"], record["median_seconds"], ops, ops / n]
    cells += [nodes_cpu, nodes_cpu / n * 1000, server_cpu]
    formats = (".3f", ".3f", ".0f", ".1f", ".2f", ".2f", ".2f")
    return f"{n} | {name} | " + " | ".join(
        f"{value:{spec}}" for value, spec in zip(cells, formats, strict=True)
    )


def render(results: dict[str, Any]) -> dict[str, list[str]]:
    tables: dict[str, dict[str, Any]] = results["table"]
    sizes, names = results["sizes"], list(tables)
    stores = [name for name in names if store_of(name) in STORE_BACKENDS]
    dns, servers = results["dns"], results["servers"]
    facts = [f"- Python {results['python']}, torch {results['torch']}; rallypoint {results['git']}"]
    if servers:
        facts.append("- Servers: " + ", ".join(servers[name] for name in sorted(servers)))
    summary = [
        *common.measured(results, *facts),
        f"- Reverse DNS of the store address (torch's TCPStore client looks it up on every "
        f"connect): median {dns['median_ms']:.1f} ms, slowest {dns['max_ms']:.0f} ms of "
        f"{dns['lookups']}",
        "",
        "Seconds to form one rendezvous round of N nodes, min = max = N, median of "
        f"{results['repeat']} runs",
        "",
        *common.table(
            " | ".join(["N", *(f"{LABELS[name]} s" for name in names)]),
            [[n, *(cell(tables[name][str(n)]) for name in names)] for n in sizes],
        ),
    ]
    retried = []
    for name in names:
        for n in sizes:
            if count := sum(s["setup_retries"] for s in tables[name][str(n)]["samples"]):
                retried.append(f"{name} at {n} nodes ({count})")
    if retried:
        summary += ["", "Runs set up again (nothing of them timed): " + ", ".join(retried) + "."]
    detail = [detail_row(n, name, tables[name][str(n)]) for n in sizes for name in stores]
    decode = []
    for n in sizes:
        size, seconds = results["decode"][str(n)]["bytes"], results["decode"][str(n)]["seconds"]
        decode.append(f"{n} | {size / 1024:.0f} KiB | {seconds * 1e3:.2f} ms | {seconds * n:.2f} s")
    processes, load = results["processes"], results["load_average"]
    settings = [
        f"- Worker processes: P = min({processes}, N), each with a GIL switch interval of "
        f"{results['switch_interval_s'] * 1000:g} ms",
        "- rallypoint's `--rdzv-conf`, by backend:",
        *(f"  - {name}: `{conf}`" for name, conf in results["rdzv_conf"].items()),
        f"- Cap of one run: rallypoint {results['rallypoint_timeout']:.0f} s, torch "
        f"{results['torch_timeout']:.0f} s (also its `join_timeout`)",
        f"- rallypoint's heartbeat thread: wakes every {results['heartbeat_wakeup_s']:g} s while "
        f"its node joins, then waits on the store in calls of at most {results['wake_slice_s']:g} s",
        f"- One-minute load average: {load[0]:.1f} when the run began, {load[1]:.1f} when it ended",
    ]
    targets = [target_row(name, tables[name], sizes) for name in stores if name in TARGETS]
    header = f"store | issue | target at {TARGET_NODES} nodes | measured | growth (log-log slope)"
    details = "N | store | first node done s | last node done s | store operations per round"
    details += " | per node | nodes' CPU s | per node ms | server's CPU s"
    return {
        "results": summary,
        "targets": common.table(header + " | verdict", targets),
        "detail": common.table(details, detail),
        "decode": common.table("N | round record | decoding it, per node | for all N", decode),
        "settings": settings,
        "sealing": common.table(
            "N | store | unsealed s | sealed s | sealed ÷ unsealed", sealing_rows(tables, sizes)
        ),
    }


def sealing_rows(tables: dict[str, Any], sizes: Sequence[int]) -> list[list[object]]:
    """What sealing every record with a job token costs a round, store by store."""
    rows: list[list[object]] = []
    for name in STORE_BACKENDS:
        if name not in tables or f"{name}-sealed" not in tables:
            continue
        for n in sizes:
            plain, signed = tables[name][str(n)], tables[f"{name}-sealed"][str(n)]
            ratio = "-"
            if plain["status"] == signed["status"] == "ok":
                ratio = f"{signed['median_seconds'] / plain['median_seconds']:.2f}x"
            rows.append(
                [n, LABELS[name].removeprefix("rallypoint on "), cell(plain), cell(signed), ratio]
            )
    return rows

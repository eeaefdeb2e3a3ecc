"""The rendezvous benchmark's results: what they say against the targets, and the page and
chart written from them (``docs/benchmarks-rendezvous.md``, its chart). Used by
``bench_rendezvous.py`` after a run and for ``--render-only``, which rewrites both from the
saved JSON alone.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import common
from common import IMAGES, ROOT

REPORT = ROOT / "docs" / "benchmarks-rendezvous.md"
CHART = IMAGES / "bench_rdzv_round_time.png"
#: Everything --backends can name, in the order of the page's columns and the chart's legend.
IMPLEMENTATIONS = ("c10d", "etcd", "redis", "torch")
#: The ones that run rallypoint's protocol over a backend plugin's store; torch is torch's own.
STORE_BACKENDS = ("c10d", "etcd", "redis")
LABELS = {
    "c10d": "rallypoint on c10d",
    "etcd": "rallypoint on etcd",
    "redis": "rallypoint on Redis",
    "torch": "torch c10d",
}
#: Results written before --backends existed name rallypoint on the c10d store "rallypoint".
OLD_NAMES = {"rallypoint": "c10d"}


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


# --- what the results say -----------------------------------------------------------------


def verdict(table: dict[str, Any], sizes: Sequence[int], target: Target) -> dict[str, Any]:
    """Did the implementation form a round of ``TARGET_NODES`` within ``target``?"""
    points = [
        (n, table[str(n)]["median_seconds"])
        for n in sizes
        if table.get(str(n), {}).get("status") == "ok"
    ]
    slopes = [
        {"from": a, "to": b, "slope": math.log(tb / ta) / math.log(b / a)}
        for (a, ta), (b, tb) in itertools.pairwise(points)
    ]
    at_target = next((t for n, t in points if n == TARGET_NODES), None)
    failed = [n for n in sizes if table.get(str(n), {}).get("status") != "ok"]
    under = at_target is not None and at_target < target.seconds
    linear = bool(slopes) and all(s["slope"] <= 1.0 for s in slopes)
    return {
        "target_seconds": target.seconds,
        "linear_required": target.linear,
        "seconds_at_target": at_target,
        "under_target": under,
        "slopes": slopes,
        "at_most_linear": linear,
        "failed_sizes": failed,
        "met": not failed and under and (linear or not target.linear),
    }


def verdicts(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: verdict(table, results["sizes"], TARGETS[name])
        for name, table in results["table"].items()
        if name in TARGETS
    }


def upgrade(results: dict[str, Any]) -> dict[str, Any]:
    """Results of any version of this script, in this version's terms."""
    table = {OLD_NAMES.get(name, name): runs for name, runs in results["table"].items()}
    order = [name for name in IMPLEMENTATIONS if name in table]
    results["table"] = {name: table[name] for name in [*order, *sorted(set(table) - set(order))]}
    results.setdefault("backends", list(results["table"]))
    results.setdefault("counted", "TCPStore requests")
    results["verdicts"] = verdicts(results)
    return results


# --- the report ---------------------------------------------------------------------------

STYLES: dict[str, dict[str, Any]] = {
    "c10d": {"color": "#2b7bba", "marker": "o", "offset": (6, -12)},
    "etcd": {"color": "#2ca02c", "marker": "^", "offset": (-14, 8)},
    "redis": {"color": "#d1780f", "marker": "D", "offset": (8, -6)},
    "torch": {"color": "#777777", "marker": "s", "offset": (-12, 8)},
}


def chart(results: dict[str, Any], sizes: Sequence[int]) -> str:
    plt = common.pyplot()
    figure, axis = plt.subplots(figsize=(7.0, 4.8))
    for name, table in results["table"].items():
        style = STYLES.get(name, {"color": "#9467bd", "marker": "v", "offset": (6, 0)})
        color = style["color"]
        ok = [
            (n, table[str(n)]["median_seconds"])
            for n in sizes
            if table.get(str(n), {}).get("status") == "ok"
        ]
        if ok:
            axis.plot(
                *zip(*ok, strict=True),
                linewidth=2,
                color=color,
                marker=style["marker"],
                label=LABELS.get(name, name),
            )
            for n, seconds in ok:
                axis.annotate(
                    f"{seconds:.3g}",
                    (n, seconds),
                    textcoords="offset points",
                    xytext=style["offset"],
                    fontsize=7,
                    color=color,
                )
        for n in sizes:
            record = table.get(str(n), {})
            if record.get("status") != "timed out":
                continue
            cap = record["cap_seconds"]
            axis.plot([n], [cap], marker="x", markersize=10, color=color)
            axis.annotate(
                f"timed out (> {cap:.0f} s)",
                (n, cap),
                textcoords="offset points",
                xytext=(-30, 8),
                fontsize=8,
                color=color,
            )
    low, high = min(sizes), max(sizes)
    linear = [(name, t) for name, t in TARGETS.items() if t.linear and name in results["table"]]
    for name, target in linear:
        axis.plot(
            [low, high],
            [target.seconds * n / TARGET_NODES for n in (low, high)],
            linestyle="--",
            color="#d62728",
            linewidth=1,
            label=f"linear to {target.seconds:g} s at {TARGET_NODES} ({LABELS[name]} target)",
        )
    for seconds in sorted({t.seconds for n, t in TARGETS.items() if n in results["table"]}):
        who = ", ".join(
            LABELS[n].removeprefix("rallypoint on ")
            for n, t in TARGETS.items()
            if t.seconds == seconds and n in results["table"]
        )
        axis.plot([TARGET_NODES], [seconds], marker="*", markersize=12, color="#d62728")
        axis.annotate(
            f"target {who}: {seconds:g} s",
            (TARGET_NODES, seconds),
            textcoords="offset points",
            xytext=(-95, 3),
            fontsize=7,
            color="#d62728",
        )
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
    return common.save_chart(figure, CHART)


def cpu_cell(record: dict[str, Any], name: str, nodes: int | None = None) -> str:
    """The median CPU seconds ``name`` of a record's samples, or milliseconds per node of
    ``nodes`` ("" before they were measured)."""
    values = [s.get(name) for s in record["samples"]]
    if any(value is None for value in values):
        return ""
    median = statistics.median(values)
    return f"{median:.2f}" if nodes is None else f"{median / nodes * 1000:.2f}"


def cell(record: dict[str, Any] | None) -> str:
    if record is None:
        return "not measured"
    if record["status"] == "ok":
        return f"{record['median_seconds']:.3f}"
    if record["status"] == "timed out":
        return f"timed out (> {record['cap_seconds']:.0f} s)"
    if record["status"] == "not run":
        return f"not run ({record['reason']})"
    return "failed"


def method(results: dict[str, Any]) -> list[str]:
    """What one simulated node is, and where it runs."""
    processes = results.get("processes")
    if not processes:  # results written before the nodes were spread over processes
        return [
            "Every simulated node is a thread of one process with its own store client. A",
            "barrier releases all nodes at once; a run's time is from the release until the",
            "last node's call returned, and each run is checked (ranks 0..N-1 once each; for",
            "rallypoint, one member list). Sizes run in increasing order, every implementation",
            "at one N before the next N. All nodes share one Python process and its GIL, so",
            "per-node Python work that real nodes do in parallel is serialised here.",
            "",
        ]
    return [
        "What is simulated: N nodes, each running the real rendezvous code (rallypoint's",
        "`StoreRendezvous`, or torch's handler) with its own store client, as N agents on N",
        "machines would; no workers are started. What is not: the machines. The N nodes are",
        f"spread over P = min({processes}, N) worker processes of this one machine (node i in",
        "process i mod P, one thread per node), so that each interpreter's GIL is shared by",
        "N/P nodes rather than by all N; all of them, the store server and the harness share",
        f"this machine's {results.get('cpus') or '?'} CPUs, where real nodes would each have their own.",
        "",
        *switch_interval(results),
        "Each node builds its client and handler first (not timed; connections are opened",
        "a few at a time per process). When every node of every process is ready, the",
        "harness releases them all at once (one event shared by the processes); a run's time",
        "is from the release until the last node's call returned (`time.perf_counter`, the",
        "system-wide monotonic clock). Each run is checked: ranks 0..N-1 once each; for",
        "rallypoint also one member list (compared by digest), one round, and each node at",
        "its own rank in that list.",
        *order(results),
        "The worker processes are reused from run to run (replaced after a run that left",
        "nodes behind).",
        "",
    ]


def order(results: dict[str, Any]) -> list[str]:
    """In what order the runs were made."""
    if results.get("order") != "interleaved":  # results written before runs were interleaved
        return ["Sizes run in increasing order, every implementation at one N before the next N."]
    return [
        "Order: rallypoint's backends first, each repetition going through every size and",
        "backend in turn, so that this machine's drift (a fifth or more within an hour) falls",
        "on every size alike rather than into the growth between sizes; then torch's handler,",
        "whose runs at 256 nodes and more load the machine for minutes (a c10d round of 1024",
        "nodes measured 0.78 s before one, 0.92 s right after, 0.79 s 20 s later).",
    ]


def switch_interval(results: dict[str, Any]) -> list[str]:
    """The worker processes' GIL switch interval, and why it is not Python's default."""
    seconds = results.get("switch_interval_s")
    if seconds is None:  # results written before the harness set it: Python's default
        return []
    return [
        f"Each worker process sets Python's switch interval to {seconds * 1000:g} ms",
        "(`sys.setswitchinterval`; Python's default is 5 ms, `--switch-interval` sets it).",
        "A worker process runs 2N/P threads (each node's and its heartbeat thread): at 5 ms",
        "each thread waiting for the GIL wakes every 5 ms to make the running one let go; at",
        "1024 nodes on Redis those forced switches took about a third of the worker processes'",
        "CPU ([the Redis page](plugins/redis.md#benchmark) has the A/B). A real agent has a",
        "few threads in its interpreter. Threads still hand the GIL on at every blocking call,",
        "so every store request is still a switch.",
        "",
    ]


def growth_beyond_linear(results: dict[str, Any], sizes: Sequence[int]) -> list[str]:
    """Why a store whose time grew faster than N between the two largest sizes did so, and
    why that is accepted; nothing when every required growth was at most linear."""
    grew = [
        name
        for name, check in results["verdicts"].items()
        if TARGETS[name].linear and check["slopes"] and not check["at_most_linear"]
    ]
    if not grew or len(sizes) < 2:
        return []
    small, large = sizes[-2], sizes[-1]
    records = [results["table"][name].get(str(n)) for name in grew for n in (small, large)]
    if any(
        r is None or r["status"] != "ok" or r["samples"][0].get("nodes_cpu") is None
        for r in records
    ):
        return []
    decode = results["decode"]
    per_node = ", ".join(
        f"{LABELS[name]} {cpu_cell(results['table'][name][str(small)], 'nodes_cpu', small)} ms "
        f"at {small} and {cpu_cell(results['table'][name][str(large)], 'nodes_cpu', large)} ms "
        f"at {large}"
        for name in grew
    )
    record_bytes = decode[str(large)]["bytes"]
    return [
        "",
        "### Growth beyond linear",
        "",
        f"From {small} to {large} nodes ({large / small:g} times as many) the round here "
        "took more than as many times as long. It is bound by this machine's CPU (above), "
        "so it takes about the CPU of all N simulated nodes over the machine's CPUs, which "
        f"grows as N times the CPU per node; and that grows with N ({per_node}). About half "
        "of that growth is each node decoding the N-member round record "
        f"({decode[str(small)]['seconds'] * 1e3:.2f} ms alone at {small}, "
        f"{decode[str(large)]['seconds'] * 1e3:.2f} ms at {large}; under load 1.5 to 2 times "
        "as long). Most of the rest is the kernel's: the worker processes' system CPU per "
        "node roughly doubles, with more context switches and page faults, as this one "
        "machine runs N nodes at once, with their N records in its memory where a real node "
        "holds one (measured with per-thread CPU timing on 2026-11-30). It is not the "
        "threads per interpreter: the same N over 4, 16 or 64 worker processes took about "
        "as long, or longer. The store's side is linear in operations (a constant number "
        "per node, above), and it sends the record to every node: "
        f"{record_bytes * large / 2**20:.0f} MiB in all at {large} nodes.",
        "",
        "On a cluster every node decodes its own copy on its own CPU, at the same time as "
        "the others, so what grows as N squared here is, per node, a fraction of a "
        "millisecond. This is accepted rather than designed away: every node gets the "
        "members of its round, in order, because the agent needs them: the "
        "`rendezvous_completed` and `workers_started` events carry them, and after a failure "
        "the next round's members tell whether a node of the failed round was lost (then "
        "the restart does not count against `--max-restarts`). Sending each node only its "
        "own ranks would move the decoding to every node that needs the list, not remove it.",
    ]


def render(results: dict[str, Any], sizes: Sequence[int]) -> str:
    tables: dict[str, dict[str, Any]] = results["table"]
    names = list(tables)
    stores = [name for name in names if name in STORE_BACKENDS]
    servers = results.get("servers") or {}
    lines = [
        "# Rendezvous benchmark",
        "",
        "Generated by `benchmarks/bench_rendezvous.py`; do not edit by hand.",
        "",
        f"- Measured: {results['date']} on {results['machine']}",
        f"- Python {results['python']}, torch {results['torch']}; rallypoint {results['git']}",
    ]
    if servers:
        lines.append("- Servers: " + ", ".join(servers[name] for name in sorted(servers)))
    lines += [
        f"- Command: `{results['command']}`",
        f"- Reverse DNS of the store address (torch's TCPStore client looks it up on every "
        f"connect): median {results['dns']['median_ms']:.1f} ms, slowest "
        f"{results['dns']['max_ms']:.0f} ms of {results['dns']['lookups']}",
        "",
        "Seconds to form one rendezvous round of N nodes, min = max = N, median of "
        f"{results['repeat']} runs",
        "(a size where one run failed or timed out is not run again, nor are larger sizes).",
        "",
        "| N | " + " | ".join(f"{LABELS.get(name, name)} s" for name in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for n in sizes:
        lines.append(f"| {n} | " + " | ".join(cell(tables[m].get(str(n))) for m in names) + " |")

    retried = [
        f"{name} at {n} nodes ({sum(s.get('setup_retries', 0) for s in record['samples'])})"
        for name in names
        for n in sizes
        if (record := tables[name].get(str(n))) is not None
        and any(s.get("setup_retries") for s in record["samples"])
    ]
    if retried:
        lines += [
            "",
            "Runs whose nodes could not all connect were set up again (nothing of them was",
            "timed; torch's TCPStore server looks each client's address up in DNS as it",
            "accepts it, which stalls while the resolver does not answer): "
            + ", ".join(retried)
            + ".",
        ]

    lines += ["", "## Targets", ""]
    for name in stores:
        target, check = TARGETS[name], results["verdicts"][name]
        at = check["seconds_at_target"]
        slopes = ", ".join(f"{s['from']}→{s['to']}: {s['slope']:.2f}" for s in check["slopes"])
        growth = (
            f"growth (log-log slope of the median time) {slopes}"
            + (" — at most linear" if check["at_most_linear"] else " — worse than linear somewhere")
            if slopes
            else "growth n/a"
        )
        wanted = f"{TARGET_NODES} nodes in under {target.seconds:g} s" + (
            ", growing no worse than linearly (every log-log slope between successive N at most 1)"
            if target.linear
            else ""
        )
        measured = (
            f"{at:.3f} s, {'under' if check['under_target'] else 'over'} {target.seconds:g} s"
            if at is not None
            else f"no result at {TARGET_NODES} nodes"
        )
        outcome = f"**{'met' if check['met'] else 'not met'}**"
        if not check["met"] and check["under_target"] and not check["failed_sizes"]:
            outcome += " on growth, accepted ([growth beyond linear](#growth-beyond-linear))"
        lines.append(
            f"- **{LABELS[name]}** (issue {target.issue}): {wanted}. Measured: {measured}; "
            f"{growth}. Verdict: {outcome}."
        )

    counted = results["counted"]
    lines += [
        "",
        "## rallypoint in detail",
        "",
        "The first node returns once the leader has closed the round; the rest of the time is",
        "every node reading the round's record (N members) and returning. "
        + (
            "Store operations are calls of the `CoordinationStore` methods by the round's "
            "handlers, counted by a proxy around each node's store client (`get_many` of N "
            "keys is one; `add_and_get`, with which every node takes its join number and "
            "reads the job's round, is one: a transaction on etcd, a script on Redis, an add "
            "and a read on c10d; `wait_value`, which every node reads the round's record "
            "with, is one: on etcd and Redis the watch event or message carries the value, on "
            "c10d it is a wait and a read); the heartbeat thread's connection is not counted."
            if counted == "store operations"
            else "Store requests are TCPStore requests of the round's handlers; heartbeat "
            "connections are not counted."
        ),
        "",
        f"| N | store | first node done s | last node done s | {counted} per round | per node "
        "| nodes' CPU s | per node ms | server's CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in sizes:
        for name in stores:
            record = tables[name].get(str(n))
            if record is not None and record["status"] == "ok":
                counts = [sum(s["store_requests"].values()) for s in record["samples"]]
                requests = statistics.median(counts)
                measured = (
                    f"{record['median_first_done']:.3f} | {record['median_seconds']:.3f} | "
                    f"{requests:.0f} | {requests / n:.1f} | "
                    f"{cpu_cell(record, 'nodes_cpu')} | {cpu_cell(record, 'nodes_cpu', n)} | "
                    f"{cpu_cell(record, 'server_cpu')}"
                )
            else:
                measured = f"{cell(record)} | | | | | |"
            lines.append(f"| {n} | {name} | {measured} |")
    lines += [
        "",
        "CPU: user and system seconds from the release until the last node returned, median "
        "of the runs: of the worker processes (the nodes, their heartbeat threads and client "
        "libraries), and of the store's server (etcd, redis-server; for c10d the harness "
        f"process, which hosts the TCPStore). This machine has {results.get('cpus', '?')} "
        "CPUs: where the two add up to about CPUs x seconds, the round was bound by this "
        "machine's CPU, shared by all N simulated nodes and the server, rather than by waiting."
        " Per node: the nodes' CPU divided by N.",
    ]
    lines += [
        "",
        "Decoding is `records.decode_round` of an N-member record, timed alone: every node",
        "does it once per round, so the processes simulating N nodes do it N times in all.",
        "",
        "| N | round record | decoding it, per node | for all N |",
        "|---|---|---|---|",
    ]
    for n in sizes:
        decode = results["decode"][str(n)]
        lines.append(
            f"| {n} | {decode['bytes'] / 1024:.0f} KiB | {decode['seconds'] * 1e3:.2f} ms | "
            f"{decode['seconds'] * n:.2f} s |"
        )
    lines += growth_beyond_linear(results, sizes)
    conf = results.get("rdzv_conf") or {}
    lines += ["", "## Method", "", *method(results)]
    lines += [
        "- rallypoint (`c10d`, `etcd`, `redis`): `StoreRendezvous.next_round()`, rank assigner",
        "  `ordered`, over the store that the backend plugin's registered `connect` returns for",
        "  a `RendezvousRequest` (looked up by name in the plugin registry, as `--rdzv-backend`",
        "  does). Its options are the backend's declared defaults but for these `--rdzv-conf`",
        "  values, parsed as the CLI parses them: generous timeouts, so that no simulated node",
        "  is given up on or declared dead while thousands of threads share a few CPUs",
        "  (`last_call_timeout` is not waited: the round closes when N nodes are in).",
    ]
    for name in stores:
        if name in conf:
            lines.append(f"  - {name}: `{conf[name]}`")
    processes = results.get("processes")
    lines += [
        "- c10d: a TCPStore server hosted by the benchmark's own process as an agent hosts",
        "  it (libuv), a fresh one on a fresh port for every run, listening on an IPv4",
        "  socket on 127.0.0.1 that the benchmark hands it: on its default dual-stack socket",
        "  it looks every client's address (::ffff:127.0.0.1) up in DNS as it accepts it,",
        "  and this machine's resolver stops answering after a few thousand lookups.",
        "- etcd and Redis: one real server each (`tests/servers.py`, as the tests start them:",
        "  etcd with fsync on, Redis without persistence) on the same machine, started once",
        "  for the whole run; every run has its own run id, so its own keys. The etcd plugin",
        "  shares one gRPC connection (and one watch per key range) among the clients of one",
        "  process, so here the nodes of one worker process share one; real nodes have one",
        "  each.",
        "- torch: `DynamicRendezvousHandler.next_rendezvous()` built by",
        "  `dynamic_rendezvous.create_handler` over `c10d_rendezvous_backend.create_backend`,",
        f"  `last_call_timeout=1`, `join_timeout` = the per-run cap ({results['torch_timeout']:.0f} s),",
        "  in the same worker processes.",
        "",
        "A rallypoint node also runs a heartbeat thread, which wakes "
        + (
            f"every {results['heartbeat_wakeup_s']:g} s"
            if results.get("heartbeat_wakeup_s")
            else "every few seconds"
        )
        + " while its node",
        "joins (to report progress) and, once its node's call has returned, waits on the store",
        "for the round's end "
        + (
            f"in calls of at most {results['wake_slice_s']:g} s"
            if results.get("wake_slice_s")
            else "in short calls"
        )
        + ", so "
        + (
            f"each of the P = min({processes}, N) worker processes runs 2N/P threads."
            if processes
            else "the process runs 2N threads."
        ),
        "At large N, the nodes still reading the round record, their decodes of it and the",
        "heartbeat threads of the nodes done compete for the interpreters' GILs, and with the",
        f"store servers for the machine's {results.get('cpus') or '?'} CPUs. Stores differ in how much of",
        "a call is Python work: little for TCPStore's C++ client, more for the Redis plugin",
        "(redis-py) and most for the etcd plugin (gRPC, and a watch per key range shared in",
        "a process).",
        "",
    ]
    load = results.get("load_average")
    if load:
        lines += [
            f"One-minute load average: {load[0]:.1f} when the run began, {load[1]:.1f} when it",
            "ended (this run's own threads count in it). The machine was shared with other",
            "work; expect noise between runs.",
            "",
        ]
    lines += [
        "![Rendezvous: time to form one round](" + results["chart"] + ")",
        "",
    ]
    return "\n".join(lines)

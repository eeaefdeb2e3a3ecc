"""Time to form one rendezvous round: rallypoint's protocol against torch's c10d rendezvous.

    .venv/bin/python benchmarks/bench_rendezvous.py [--nodes 8,64,256,1024] [--repeat 3]
        [--torch-timeout 120] [--rallypoint-timeout 600]

N simulated nodes run as N threads of one process, each with its own TCPStore connection
to one TCPStore server this process hosts (a fresh one, on a fresh port, per measurement,
so clients left over from a run that timed out cannot disturb the next). Every thread
builds its client and its rendezvous handler, waits on a barrier, and then joins the round:

* rallypoint: ``StoreRendezvous.next_round()`` over ``TCPStoreClient`` (``--rdzv-backend
  c10d``), min = max = N nodes;
* torch: ``DynamicRendezvousHandler.next_rendezvous()`` with the ``c10d`` backend, as
  torchrun's agent calls it, min = max = N nodes, ``last_call_timeout=1``.

The time runs from the barrier's release until the last thread's call returned. Each run
is checked: every node got a distinct group rank in ``0..N-1`` and (rallypoint) the same
member list. torch runs up to the N where a run exceeds ``--torch-timeout`` (its
``join_timeout`` too); larger N are recorded as not run.

All nodes share one process and so one GIL: per-node Python work (decoding the round's
record, for instance) is serialised here, where real nodes would do it in parallel. The
numbers are therefore an upper bound for both implementations.

Results go to ``benchmarks/results/rendezvous.json`` and ``docs/benchmarks-rendezvous.md``
with a chart in ``docs/img/bench_rdzv_round_time.png``.
"""

from __future__ import annotations

import os

# torch's C++ log prints a line for every store wait that times out; set before torch loads.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse
import contextlib
import gc
import hashlib
import itertools
import json
import math
import platform
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "rendezvous.json"
REPORT = ROOT / "docs" / "benchmarks-rendezvous.md"
IMAGES = ROOT / "docs" / "img"
CHART = IMAGES / "bench_rdzv_round_time.png"
HOST = "127.0.0.1"
IMPLEMENTATIONS = ("rallypoint", "torch")
TARGET_NODES = 1024
TARGET_SECONDS = 2.0
SETUP_TIMEOUT = 300.0  # seconds for all N threads to connect and reach the barrier
STORE_TIMEOUT = 300.0  # TCPStore read timeout of every client
LEFTOVER_GRACE = 60.0  # seconds to wait for the threads of a run that timed out


@dataclass
class Sample:
    """One measured round."""

    nodes: int
    seconds: float | None  # None: not every node returned within the cap
    first_done: float | None  # when the first node's call returned
    ok: bool  # every node returned and they all agree
    error: str | None = None
    finished: int = 0  # nodes whose call returned (with a result or an error)
    leftover_threads: int = 0  # threads still alive after the grace period
    store_requests: dict[str, int] = field(default_factory=dict)


# --- the harness --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


@dataclass
class Threads:
    """N node threads: set up, released together by a barrier, then each joins the round."""

    started: float = 0.0
    ends: dict[int, float] = field(default_factory=dict)
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)


def run_nodes(
    n: int, setup: Callable[[int], Callable[[], Any]], cap: float
) -> tuple[Threads, str | None]:
    """Start ``n`` threads; thread ``i`` calls ``setup(i)`` (not timed), then the function
    it returned (timed). Waits at most ``cap`` seconds after the release."""
    state = Threads()

    def release() -> None:
        state.started = time.perf_counter()

    barrier = threading.Barrier(n + 1, action=release, timeout=SETUP_TIMEOUT)

    def node(i: int) -> None:
        try:
            join = setup(i)
        except BaseException as error:  # reported, and the run is aborted
            state.errors[i] = f"setup: {error!r}"
            barrier.abort()
            return
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return
        try:
            state.results[i] = join()
        except BaseException as error:  # reported per node
            state.errors[i] = repr(error)
        finally:
            state.ends[i] = time.perf_counter()

    for i in range(n):
        # Daemon threads: a node stuck in a rendezvous that never completes must not keep
        # the benchmark alive.
        thread = threading.Thread(target=node, args=(i,), name=f"node{i}", daemon=True)
        state.threads.append(thread)
        thread.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        first = next(iter(state.errors.values()), "the barrier broke")
        return state, f"setup failed ({len(state.errors)} nodes): {first}"
    deadline = state.started + cap
    for thread in state.threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    return state, None


def summarise(n: int, state: Threads, failure: str | None) -> Sample:
    finished = len(state.ends)
    if failure is not None:
        return Sample(n, None, None, False, failure, finished)
    first = min(state.ends.values()) - state.started if state.ends else None
    if finished < n:
        return Sample(n, None, first, False, f"{n - finished} of {n} nodes still waiting", finished)
    seconds = max(state.ends.values()) - state.started
    if state.errors:
        kinds = Counter(error.split("(")[0] for error in state.errors.values())
        example = next(iter(state.errors.values()))
        return Sample(
            n, seconds, first, False, f"{len(state.errors)} nodes failed {dict(kinds)}: {example}",
            finished,
        )  # fmt: skip
    return Sample(n, seconds, first, True, None, finished)


def wait_for_leftovers(state: Threads) -> int:
    deadline = time.monotonic() + LEFTOVER_GRACE
    for thread in state.threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sum(thread.is_alive() for thread in state.threads)


# --- rallypoint ---------------------------------------------------------------------------


def measure_rallypoint(n: int, cap: float) -> Sample:
    from rallypoint.builtins.rank_assigners import ordered
    from rallypoint.extensions import NodeSpec, RankAssigner
    from rallypoint.rendezvous.protocol import Settings, StoreRendezvous
    from rallypoint.rendezvous.tcpstore import TCPStoreClient

    requests: Counter[str] = Counter()
    lock = threading.Lock()

    class CountingClient(TCPStoreClient):
        """Counts the store requests of the round (heartbeat clones are not counted)."""

        def _call(self, name: str, *args: Any) -> Any:
            with lock:
                requests[name] += 1
            return super()._call(name, *args)

        def wait(self, keys: Sequence[str], timeout: float) -> bool:
            with lock:
                requests["wait"] += 1
            return super().wait(keys, timeout)

    port = free_port()
    host = TCPStoreClient(HOST, port, is_host=True, timeout=STORE_TIMEOUT)
    run_id = f"bench-{uuid.uuid4().hex[:12]}"
    settings = Settings(
        min_nodes=n,
        max_nodes=n,
        join_timeout=600,
        last_call_timeout=30,
        close_timeout=60,
        heartbeat_timeout=600,  # no node is ever declared dead during a measurement
    )
    assigner = RankAssigner("ordered", "", ordered)
    handlers: dict[int, StoreRendezvous] = {}

    def setup(i: int) -> Callable[[], Any]:
        store = CountingClient(HOST, port, is_host=False, timeout=STORE_TIMEOUT)
        handler = StoreRendezvous(
            store, run_id, NodeSpec(f"node{i}", host=HOST), 1, assigner, settings
        )
        handlers[i] = handler
        return handler.next_round

    with lock:
        requests.clear()
    state, failure = run_nodes(n, setup, cap)
    sample = summarise(n, state, failure)
    sample.store_requests = dict(requests)
    if sample.ok:
        check_rallypoint(n, state.results, sample)
    for handler in handlers.values():
        handler.close()
    if sample.seconds is None:
        sample.leftover_threads = wait_for_leftovers(state)
    host.close()
    return sample


def check_rallypoint(n: int, results: dict[int, Any], sample: Sample) -> None:
    infos = {i: assignment.info for i, assignment in results.items()}
    members = {info.members for info in infos.values()}
    ranks = sorted(info.group_rank for info in infos.values())
    problems = []
    if len(members) != 1:
        problems.append(f"{len(members)} different member lists")
    if ranks != list(range(n)):
        problems.append("group ranks are not 0..N-1 once each")
    if any(info.members[info.group_rank] != f"node{i}" for i, info in infos.items()):
        problems.append("a node's rank does not match its place in the member list")
    if any(info.group_world_size != n for info in infos.values()):
        problems.append("a node's group world size is not N")
    if len({info.round for info in infos.values()}) != 1:
        problems.append("nodes disagree on the round number")
    if problems:
        sample.ok = False
        sample.error = "; ".join(problems)


# --- torch c10d ---------------------------------------------------------------------------


def measure_torch(n: int, cap: float) -> Sample:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    port = free_port()
    server = dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False, multi_tenant=True)
    run_id = f"bench-{uuid.uuid4().hex[:12]}"
    handlers: dict[int, Any] = {}

    def setup(i: int) -> Callable[[], Any]:
        params = RendezvousParameters(
            backend="c10d",
            endpoint=f"{HOST}:{port}",
            run_id=run_id,
            min_nodes=n,
            max_nodes=n,
            local_addr=HOST,
            is_host=False,
            join_timeout=max(1, math.ceil(cap)),
            last_call_timeout=1,
        )
        backend, store = create_backend(params)
        handler = create_handler(store, backend, params)
        handlers[i] = handler
        return handler.next_rendezvous

    state, failure = run_nodes(n, setup, cap)
    sample = summarise(n, state, failure)
    if sample.ok:
        ranks = sorted(info.rank for info in state.results.values())
        if ranks != list(range(n)) or any(i.world_size != n for i in state.results.values()):
            sample.ok = False
            sample.error = "ranks are not 0..N-1 once each, or a world size is not N"
    for handler in handlers.values():
        # What shutdown() does first, without then marking the rendezvous closed in the
        # store (N more compare-and-sets of the whole state, possibly against stuck nodes).
        handler._stop_heartbeats()
    handlers.clear()
    del server  # stuck clients now fail instead of waiting out join_timeout
    gc.collect()
    if sample.seconds is None:
        sample.leftover_threads = wait_for_leftovers(state)
    return sample


# --- context ------------------------------------------------------------------------------


def decode_cost(n: int) -> dict[str, float]:
    """What every node spends decoding an N-member round record (records.decode_round)."""
    from rallypoint.rendezvous import records

    ids = tuple(f"node{i}" for i in range(n))
    raw = records.encode(records.RoundRecord(0, ids, (HOST,) * n, (1,) * n, HOST, 20000))
    times = []
    for _ in range(7):
        began = time.perf_counter()
        records.decode_round("closed", raw)
        times.append(time.perf_counter() - began)
    return {"bytes": len(raw), "seconds": statistics.median(times)}


def reverse_dns(lookups: int = 20) -> dict[str, float]:
    """torch's TCPStore client formats the store's address with getnameinfo on every
    connect; a slow resolver makes each connection slow (5 s per dropped DNS query)."""
    times = []
    for _ in range(lookups):
        began = time.perf_counter()
        with contextlib.suppress(OSError):
            socket.getnameinfo((f"::ffff:{HOST}", 0, 0, 0), 0)
        times.append(time.perf_counter() - began)
    return {
        "lookups": lookups,
        "median_ms": statistics.median(times) * 1e3,
        "max_ms": max(times) * 1e3,
    }


def git_state() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if not git("status", "--porcelain", "--", "core/rallypoint/rendezvous"):
        return commit
    protocol = ROOT / "core" / "rallypoint" / "rendezvous" / "protocol.py"
    digest = hashlib.sha256(protocol.read_bytes()).hexdigest()[:12]
    return f"{commit} + uncommitted changes to rendezvous/ (protocol.py sha256 {digest})"


def heartbeat_wakeup() -> float | None:
    """How often a joining node's heartbeat thread wakes with this benchmark's settings."""
    from rallypoint.rendezvous import protocol

    progress = getattr(protocol, "PROGRESS_INTERVAL", None)
    return min(600 / 3, progress) if isinstance(progress, (int, float)) else 600 / 3


# --- the run ------------------------------------------------------------------------------


def measure(
    sizes: Sequence[int], repeat: int, rallypoint_cap: float, torch_cap: float
) -> dict[str, dict[str, Any]]:
    measures = {
        "rallypoint": (measure_rallypoint, rallypoint_cap),
        "torch": (measure_torch, torch_cap),
    }
    gave_up: dict[str, int | None] = {name: None for name in IMPLEMENTATIONS}
    table: dict[str, dict[str, Any]] = {name: {} for name in IMPLEMENTATIONS}
    for n in sizes:
        for name in IMPLEMENTATIONS:
            function, cap = measures[name]
            if gave_up[name] is not None:
                table[name][str(n)] = {
                    "status": "not run",
                    "reason": f"timed out at {gave_up[name]} nodes",
                    "samples": [],
                }
                continue
            samples: list[Sample] = []
            for index in range(repeat):
                gc.collect()
                time.sleep(0.5)
                sample = function(n, cap)
                samples.append(sample)
                shown = f"{sample.seconds:.3f} s" if sample.seconds is not None else "timed out"
                extra = f" ({sample.error})" if sample.error else ""
                print(f"{name:10} N={n:5} run {index + 1}/{repeat}: {shown}{extra}", flush=True)
                if not sample.ok:
                    break  # a failed or stuck run is not retried at this size
            table[name][str(n)] = entry(samples, cap)
            if table[name][str(n)]["status"] != "ok":
                gave_up[name] = n
    return table


def entry(samples: list[Sample], cap: float) -> dict[str, Any]:
    record: dict[str, Any] = {"samples": [asdict(s) for s in samples], "cap_seconds": cap}
    if all(s.ok for s in samples):
        record["status"] = "ok"
        record["median_seconds"] = statistics.median(s.seconds for s in samples)  # type: ignore[type-var]
        record["median_first_done"] = statistics.median(s.first_done for s in samples)  # type: ignore[type-var]
    elif any(s.seconds is None for s in samples):
        record["status"] = "timed out"
    else:
        record["status"] = "failed"
    return record


def verdict(table: dict[str, Any], sizes: Sequence[int]) -> dict[str, Any]:
    """Did rallypoint form a 1024-node round in under 2 s, growing no worse than linearly?"""
    points = [
        (n, table[str(n)]["median_seconds"]) for n in sizes if table[str(n)]["status"] == "ok"
    ]
    slopes = [
        {
            "from": a,
            "to": b,
            "slope": math.log(tb / ta) / math.log(b / a),
        }
        for (a, ta), (b, tb) in itertools.pairwise(points)
    ]
    at_target = next((t for n, t in points if n == TARGET_NODES), None)
    failed = [n for n in sizes if table[str(n)]["status"] != "ok"]
    return {
        "seconds_at_target": at_target,
        "under_target": at_target is not None and at_target < TARGET_SECONDS,
        "slopes": slopes,
        "at_most_linear": bool(slopes) and all(s["slope"] <= 1.0 for s in slopes),
        "failed_sizes": failed,
        "met": not failed
        and at_target is not None
        and at_target < TARGET_SECONDS
        and all(s["slope"] <= 1.0 for s in slopes),
    }


# --- the report ---------------------------------------------------------------------------


def chart(results: dict[str, Any], sizes: Sequence[int]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMAGES.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    styles = {
        "rallypoint": {"color": "#2b7bba", "marker": "o", "label": "rallypoint"},
        "torch": {"color": "#777777", "marker": "s", "label": "torch c10d"},
    }
    for name in IMPLEMENTATIONS:
        table = results["table"][name]
        ok = [
            (n, table[str(n)]["median_seconds"]) for n in sizes if table[str(n)]["status"] == "ok"
        ]
        if ok:
            axis.plot(*zip(*ok, strict=True), linewidth=2, **styles[name])  # type: ignore[arg-type]
            for n, seconds in ok:
                axis.annotate(
                    f"{seconds:.3g} s",
                    (n, seconds),
                    textcoords="offset points",
                    xytext=(6, -12) if name == "rallypoint" else (-12, 8),
                    fontsize=8,
                    color=styles[name]["color"],
                )
        timed_out = [n for n in sizes if table[str(n)]["status"] == "timed out"]
        for n in timed_out:
            cap = table[str(n)]["cap_seconds"]
            axis.plot([n], [cap], marker="x", markersize=10, color=styles[name]["color"])
            axis.annotate(
                f"timed out (> {cap:.0f} s)",
                (n, cap),
                textcoords="offset points",
                xytext=(-30, 8),
                fontsize=8,
                color=styles[name]["color"],
            )
    low, high = min(sizes), max(sizes)
    reference = [TARGET_SECONDS * n / TARGET_NODES for n in (low, high)]
    axis.plot(
        [low, high],
        reference,
        linestyle="--",
        color="#d62728",
        linewidth=1,
        label=f"linear: {TARGET_SECONDS:g} s at {TARGET_NODES} nodes (target)",
    )
    axis.plot([TARGET_NODES], [TARGET_SECONDS], marker="*", markersize=12, color="#d62728")
    axis.set_xscale("log", base=2)
    axis.set_xlim(low / 1.4, high * 1.6)
    axis.set_yscale("log")
    axis.set_xticks(list(sizes))
    axis.set_xticklabels([str(n) for n in sizes])
    axis.set_xlabel("nodes (N)")
    axis.set_ylabel("seconds to form one round (median)")
    axis.set_title("Rendezvous: time to form one round")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(CHART, dpi=100)
    plt.close(figure)
    return f"img/{CHART.name}"


def render(results: dict[str, Any], sizes: Sequence[int]) -> str:
    ours, theirs = results["table"]["rallypoint"], results["table"]["torch"]
    check = results["verdict"]

    def cell(record: dict[str, Any]) -> str:
        if record["status"] == "ok":
            return f"{record['median_seconds']:.3f}"
        if record["status"] == "timed out":
            return f"timed out (> {record['cap_seconds']:.0f} s)"
        if record["status"] == "not run":
            return f"not run ({record['reason']})"
        return "failed"

    lines = [
        "# Rendezvous benchmark",
        "",
        "Generated by `benchmarks/bench_rendezvous.py`; do not edit by hand.",
        "",
        f"- Measured: {results['date']} on {results['machine']}",
        f"- Python {results['python']}, torch {results['torch']}; rallypoint {results['git']}",
        f"- Command: `{results['command']}`",
        f"- Reverse DNS of the store address (torch's TCPStore client looks it up on every "
        f"connect): median {results['dns']['median_ms']:.1f} ms, slowest "
        f"{results['dns']['max_ms']:.0f} ms of {results['dns']['lookups']}",
        "",
        "Time to form one rendezvous round of N nodes, min = max = N, median of "
        f"{results['repeat']} runs. The ratio is rallypoint / torch c10d.",
        "",
        "| N | rallypoint s | torch c10d s | ratio |",
        "|---|---|---|---|",
    ]
    for n in sizes:
        a, b = ours[str(n)], theirs[str(n)]
        ratio = (
            f"{a['median_seconds'] / b['median_seconds']:.3f}x"
            if a["status"] == "ok" and b["status"] == "ok" and b["median_seconds"]
            else ""
        )
        lines.append(f"| {n} | {cell(a)} | {cell(b)} | {ratio} |")
    slopes = ", ".join(f"{s['from']}→{s['to']}: {s['slope']:.2f}" for s in check["slopes"])
    at = check["seconds_at_target"]
    lines += [
        "",
        f"**Target:** {TARGET_NODES} nodes in under {TARGET_SECONDS:g} s, growing no worse than "
        "linearly (every log-log slope between successive N at most 1).",
        "",
        f"- {TARGET_NODES} nodes: "
        + (
            f"{at:.3f} s, {'under' if check['under_target'] else 'over'} the target"
            if at
            else "no result"
        ),
        f"- Growth (log-log slope of the median time): {slopes or 'n/a'}"
        + (" — at most linear" if check["at_most_linear"] else " — worse than linear somewhere"),
        f"- Verdict: **{'met' if check['met'] else 'not met'}**",
        "",
        "## rallypoint in detail",
        "",
        "The first node returns once the leader has closed the round; the rest of the time is",
        "every node reading the round's record (N members) and returning. Store requests are",
        "those of the round's handlers; heartbeat connections are not counted.",
        "Decoding is `records.decode_round` of an N-member record, timed alone: every node",
        "does it once per round, so one process simulating N nodes does it N times.",
        "",
        "| N | first node done s | last node done s | store requests per round | per node "
        "| round record | decoding it, per node | for all N |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in sizes:
        record = ours[str(n)]
        decode = results["decode"][str(n)]
        if record["status"] == "ok":
            counts = [sum(s["store_requests"].values()) for s in record["samples"]]
            requests = statistics.median(counts)
            measured = (
                f"{record['median_first_done']:.3f} | {record['median_seconds']:.3f} | "
                f"{requests:.0f} | {requests / n:.1f}"
            )
        else:
            measured = f"{cell(record)} | | |"
        lines.append(
            f"| {n} | {measured} | {decode['bytes'] / 1024:.0f} KiB | "
            f"{decode['seconds'] * 1e3:.2f} ms | {decode['seconds'] * n:.2f} s |"
        )
    lines += [
        "",
        "## Method",
        "",
        "Every simulated node is a thread of one process with its own TCPStore connection to a",
        "TCPStore server the benchmark hosts (a fresh one on a fresh port for every run). A",
        "barrier releases all nodes at once; a run's time is from the release until the last",
        "node's call returned, and each run is checked (ranks 0..N-1 once each; for rallypoint,",
        "one member list).",
        "",
        "- rallypoint: `StoreRendezvous.next_round()` over `TCPStoreClient` (the `c10d`",
        "  backend's store), rank assigner `ordered`, `join_timeout=600`,",
        "  `last_call_timeout=30` (not waited: the round closes when N nodes are in),",
        "  `heartbeat_timeout=600`.",
        "- torch: `DynamicRendezvousHandler.next_rendezvous()` built by",
        "  `dynamic_rendezvous.create_handler` over `c10d_rendezvous_backend.create_backend`,",
        f"  `last_call_timeout=1`, `join_timeout` = the per-run cap ({results['torch_timeout']:.0f} s).",
        "  Once one N runs past the cap, larger N are not run.",
        "",
        "All nodes share one Python process and its GIL, so per-node Python work that real",
        "nodes do in parallel is serialised here: the times are an upper bound for both. A",
        "rallypoint node also runs a heartbeat thread, which wakes "
        + (
            f"every {results['heartbeat_wakeup_s']:g} s"
            if results.get("heartbeat_wakeup_s")
            else "every few seconds"
        )
        + " while it",
        "waits (to bump its counter and report progress), so at N nodes the process runs 2N",
        "threads; at large N, these and the N decodes of the round record compete for one GIL.",
        f"The machine has {os.cpu_count()} CPUs and was not otherwise idle; expect noise.",
        "",
        "![Rendezvous: time to form one round](" + results["chart"] + ")",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nodes",
        default="8,64,256,1024",
        help="comma-separated node counts (default: %(default)s)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per N and implementation")
    parser.add_argument(
        "--torch-timeout", type=float, default=120.0, help="seconds before a torch run is abandoned"
    )
    parser.add_argument(
        "--rallypoint-timeout",
        type=float,
        default=600.0,
        help="seconds before a rallypoint run is abandoned",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help=f"measure nothing: rewrite the report and chart from {RESULTS.relative_to(ROOT)}",
    )
    args = parser.parse_args()
    if args.render_only:
        results = json.loads(RESULTS.read_text())
        results["chart"] = chart(results, results["sizes"])
        REPORT.write_text(render(results, results["sizes"]) + "\n")
        print(f"wrote {REPORT.relative_to(ROOT)} and docs/{results['chart']}")
        return
    sizes = sorted({int(n) for n in args.nodes.split(",") if n.strip()})

    # Every node holds a few sockets (its store connection, its heartbeat's, a port).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    import torch

    command = " ".join(["python", "benchmarks/bench_rendezvous.py", *sys.argv[1:]])
    dns = reverse_dns()
    git = git_state()  # before measuring: the code measured is the code imported now
    began = time.time()
    table = measure(sizes, args.repeat, args.rallypoint_timeout, args.torch_timeout)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began)),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git": git,
        "heartbeat_wakeup_s": heartbeat_wakeup(),
        "dns": dns,
        "decode": {str(n): decode_cost(n) for n in sizes},
        "command": command,
        "repeat": args.repeat,
        "sizes": sizes,
        "torch_timeout": args.torch_timeout,
        "rallypoint_timeout": args.rallypoint_timeout,
        "wall_seconds": time.time() - began,
        "table": table,
        "verdict": verdict(table["rallypoint"], sizes),
    }
    results["chart"] = chart(results, sizes)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    REPORT.write_text(render(results, sizes) + "\n")
    print(json.dumps(results["verdict"], indent=2))
    print(
        f"wrote {RESULTS.relative_to(ROOT)}, {REPORT.relative_to(ROOT)} and docs/{results['chart']}"
    )
    # Threads of abandoned torch runs may still be blocked in C++; do not wait for them.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

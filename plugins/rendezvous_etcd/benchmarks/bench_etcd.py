"""Time to form one rendezvous round of N simulated nodes on one etcd, beside the built-in
c10d backend and torch's c10d rendezvous, in the harness of benchmarks/bench_rendezvous.py.

    .venv/bin/python plugins/rendezvous_etcd/benchmarks/bench_etcd.py \
        [--nodes 8,64,256,1024] [--c10d 8,64,256] [--torch 8,64] [--repeat 3]

Every simulated node is a thread of this process with its own etcd connection (an
``EtcdStore``, whose clone serves its heartbeat thread), joining with
``StoreRendezvous.next_round()``, min = max = N; one fresh etcd server (Debian's binary,
started as the tests start it) per N. The time runs from the barrier's release until the
last node's call returned, and each run is checked (ranks 0..N-1 once each, one member
list). Results are printed as JSON and as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

import bench_rendezvous as harness  # noqa: E402

from servers import start_etcd  # noqa: E402


def measure_etcd(n: int, cap: float, endpoint: tuple[str, int]) -> harness.Sample:
    from rallypoint.builtins.rank_assigners import ordered
    from rallypoint.extensions import NodeSpec, RankAssigner
    from rallypoint.rendezvous.protocol import Settings, StoreRendezvous
    from rallypoint_etcd.store import EtcdConfig, EtcdStore

    requests: Counter[str] = Counter()
    lock = threading.Lock()

    class Counting(EtcdStore):
        """Counts the store operations of the round (heartbeat clones are not counted)."""

        def __getattribute__(self, name: str) -> Any:
            if name in ("add", "get", "get_many", "set", "compare_set", "wait", "alive"):
                with lock:
                    requests[name] += 1
            return super().__getattribute__(name)

        def clone(self) -> EtcdStore:
            return EtcdStore.clone(self)

    config = EtcdConfig(endpoints=(endpoint,), connect_timeout=60, request_timeout=120)
    run_id = f"bench-{uuid.uuid4().hex[:12]}"
    settings = Settings(
        min_nodes=n, max_nodes=n, join_timeout=600, last_call_timeout=30, close_timeout=60,
        heartbeat_timeout=600,
    )  # fmt: skip
    assigner = RankAssigner("ordered", "", ordered)
    handlers: dict[int, StoreRendezvous] = {}

    def setup(i: int) -> Callable[[], Any]:
        handler = StoreRendezvous(
            Counting(config), run_id, NodeSpec(f"node{i}", host="127.0.0.1"), 1, assigner,
            settings,
        )  # fmt: skip
        handlers[i] = handler
        return handler.next_round

    state, failure = harness.run_nodes(n, setup, cap)
    with lock:
        counted = dict(requests)
    sample = harness.summarise(n, state, failure)
    sample.store_requests = counted
    if sample.ok:
        harness.check_rallypoint(n, state.results, sample)
    closers = [threading.Thread(target=h.close, daemon=True) for h in handlers.values()]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(60)
    return sample


def median(samples: list[harness.Sample]) -> float | None:
    times = [s.seconds for s in samples if s.ok and s.seconds is not None]
    return statistics.median(times) if len(times) == len(samples) else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", default="8,64,256,1024")
    parser.add_argument("--c10d", default="8,64")
    parser.add_argument("--torch", default="8,64")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cap", type=float, default=120.0)
    args = parser.parse_args()
    sizes = [int(x) for x in args.nodes.split(",") if x]
    results: dict[str, dict[int, Any]] = {"etcd": {}, "c10d": {}, "torch": {}}
    for n in sizes:
        with tempfile.TemporaryDirectory() as where:
            server = start_etcd(where)
            try:
                endpoint = ("127.0.0.1", server.client_port)
                samples = [measure_etcd(n, args.cap, endpoint) for _ in range(args.repeat)]
            finally:
                server.stop()
        results["etcd"][n] = samples
        print(f"etcd N={n}: {[s.seconds for s in samples]} {samples[0].error or ''}", flush=True)
    for name, measure, text in (
        ("c10d", harness.measure_rallypoint, args.c10d),
        ("torch", harness.measure_torch, args.torch),
    ):
        for n in [int(x) for x in text.split(",") if x]:
            samples = [measure(n, args.cap) for _ in range(args.repeat)]
            results[name][n] = samples
            print(f"{name} N={n}: {[s.seconds for s in samples]}", flush=True)
    print("\n| N | etcd s | c10d (rallypoint) s | torch c10d s | etcd requests per node |")
    print("|---|---|---|---|---|")
    for n in sorted({n for runs in results.values() for n in runs}):
        cells = []
        for name in ("etcd", "c10d", "torch"):
            samples = results[name].get(n)
            value = median(samples) if samples else None
            cells.append("not run" if not samples else f"{value:.3f}" if value else "failed")
        etcd = results["etcd"].get(n)
        per_node = f"{sum(etcd[0].store_requests.values()) / n:.1f}" if etcd else ""
        print(f"| {n} | {' | '.join(cells)} | {per_node} |")
    raw = {
        name: {n: [vars(s) for s in samples] for n, samples in runs.items()}
        for name, runs in results.items()
    }
    print(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **raw}))


if __name__ == "__main__":
    main()

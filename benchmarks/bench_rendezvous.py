"""Time to form one rendezvous round of N simulated nodes: rallypoint's protocol over each
rendezvous backend's store, side by side with torch's c10d rendezvous; the method is on
docs/benchmarks-rendezvous.md, whose tables and chart ``rendezvous_report.py`` writes.

    .venv/bin/python benchmarks/bench_rendezvous.py [--backends c10d,etcd,redis,torch]
        [--nodes 8,64,256,1024] [--repeat 3] [--processes 16] [--torch-timeout 120]
        [--rallypoint-timeout 600]
    .venv/bin/python benchmarks/bench_rendezvous.py --render-only
"""

from __future__ import annotations

import os

# torch's C++ log prints a line for every store wait that times out; set before torch loads.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse
import contextlib
import datetime
import gc
import hashlib
import math
import multiprocessing
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import common
import rendezvous_report as report
from common import HOST, ROOT

if TYPE_CHECKING:
    from rallypoint.extensions import RendezvousBackend
    from rallypoint.interfaces import CoordinationStore

#: The job token of the sealed variants (``c10d-sealed``...): any secret costs the same.
SEALING_TOKEN = b"a job token of 32 bytes, or so.."
SETUP_TIMEOUT = 180.0  # seconds for all N nodes to connect and be ready
STORE_TIMEOUT = 300.0  # TCPStore read timeout of every c10d client
LEFTOVER_GRACE = 60.0  # seconds to wait for the threads of a run that timed out
PROCESSES = 16
#: ``sys.setswitchinterval`` of the worker processes (Python's default is 0.005): with 2N/P
#: threads each, every waiting thread would otherwise force a switch every 5 ms.
SWITCH_INTERVAL = 0.05
#: Nodes of one worker process that connect at the same time: thousands of simultaneous
#: connects can overrun a server's accept queue (torch's TCPStore server has stalled on it).
SETUP_CONCURRENCY = 4
#: Times a run whose nodes could not all set up is tried again, and the pause before.
SETUP_RETRIES = 2
SETUP_RETRY_PAUSE = 30.0
#: ``--rdzv-conf`` of every rallypoint run, parsed against the backend's declared options:
#: generous timeouts, so that no simulated node is given up on while 2N threads share a GIL.
PROTOCOL_CONF = "join_timeout=600,last_call_timeout=30,close_timeout=60,heartbeat_timeout=600"
BACKEND_CONF = {
    "c10d": f"is_host=false,read_timeout={STORE_TIMEOUT:g}",  # the harness hosts the store
    # connect_timeout also sets etcd's request timeout (2x), which one request can need
    # at 1024 simulated nodes in one process.
    "etcd": "lease_ttl=600,connect_timeout=60",
    "redis": "key_ttl=600,connect_timeout=60",
}


@dataclass
class Sample:
    """One measured round."""

    nodes: int
    seconds: float | None = None  # None: not every node returned within the cap
    first_done: float | None = None  # when the first node's call returned
    ok: bool = False  # every node returned and they all agree
    error: str | None = None
    finished: int = 0  # nodes whose call returned (with a result or an error)
    leftover_threads: int = 0  # threads still alive after the grace period
    store_requests: dict[str, int] = field(default_factory=dict)
    setup_retries: int = 0  # runs before this one that failed to set up (not timed)
    # CPU seconds (user + system) from the release until every node returned: of the
    # worker processes, and of the store's server (the harness process hosting TCPStore).
    nodes_cpu: float | None = None
    server_cpu: float | None = None


@dataclass(frozen=True)
class Job:
    """One measurement, as each worker process sets up its share of the N nodes."""

    name: str  # one of report.IMPLEMENTATIONS
    endpoint: str
    run_id: str
    n: int
    cap: float


@dataclass
class Nodes:
    """What the N nodes of one measurement did, gathered from the worker processes.

    Times are ``time.perf_counter()`` values: on Linux the system-wide monotonic clock, so
    that those of different processes compare.
    """

    started: float = 0.0  # when the nodes were released
    ends: dict[int, float] = field(default_factory=dict)  # when each node's call returned
    results: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # see outcome()
    errors: dict[int, str] = field(default_factory=dict)
    requests: Counter[str] = field(default_factory=Counter)
    leftover_threads: int = 0
    nodes_cpu: float = 0.0  # see Sample
    server_cpu: float | None = None

    def add(self, share: Nodes) -> None:
        """What one worker process's nodes did."""
        self.ends.update(share.ends)
        self.results.update(share.results)
        self.errors.update(share.errors)
        self.requests.update(share.requests)
        self.nodes_cpu += share.nodes_cpu


class HarnessError(Exception):
    """A worker process died or stopped answering."""


def raise_file_limit() -> None:
    """Every node holds a few sockets (its store connection, its heartbeat's, a port)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (this process if None), all threads."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    with open(f"/proc/{pid}/stat") as stat:
        fields_ = stat.read().rsplit(")", 1)[1].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


# --- the worker processes -----------------------------------------------------------------


def worker(conn: Connection, go: Any, abort: Any, switch_interval: float) -> None:
    """A worker process: runs its share of the nodes of each job the harness sends it."""
    raise_file_limit()
    sys.setswitchinterval(switch_interval)
    while (message := conn.recv()) is not None:
        job, indices = message
        run_share(conn, go, abort, job, indices)
        gc.collect()


def run_share(conn: Connection, go: Any, abort: Any, job: Job, indices: list[int]) -> None:
    """One thread per node of ``indices``: set up (not timed), then, once the harness sets
    ``go``, join the round (timed). Report, then close the nodes when told to."""
    nodes = Nodes()
    handlers: dict[int, Any] = {}
    returned: dict[int, Any] = {}  # what each node's call returned, checked after the run
    make = node_factory(job, nodes.requests, threading.Lock(), handlers)
    ready = threading.Semaphore(0)
    release = threading.Event()
    setup_errors: list[str] = []
    connecting = threading.Semaphore(SETUP_CONCURRENCY)

    def node(i: int) -> None:
        try:
            with connecting:
                join = make(i)
        except BaseException as error:  # reported, and the run is aborted
            setup_errors.append(f"setup: {error!r}")
            ready.release()
            return
        ready.release()
        release.wait()
        if abort.value:
            return
        try:
            result = join()
        except BaseException as error:  # reported per node
            nodes.ends[i] = time.perf_counter()
            nodes.errors[i] = repr(error)
            return
        nodes.ends[i] = time.perf_counter()
        # Digested once every node is done: here it would take the GIL from the nodes
        # still reading the round.
        returned[i] = result

    # Daemon threads: a node stuck in a round that never completes must not keep us alive.
    threads = [
        threading.Thread(target=node, args=(i,), name=f"node{i}", daemon=True) for i in indices
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + SETUP_TIMEOUT
    for _ in threads:
        if not ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
            setup_errors.append(f"setup: not done within {SETUP_TIMEOUT:g} s")
            break
    conn.send(("ready", setup_errors[0] if setup_errors else None))
    go.wait()
    release.set()
    began = cpu_seconds()
    end = time.monotonic() + job.cap
    for thread in threads if not abort.value else ():  # an aborted run is not waited for
        thread.join(max(0.0, end - time.monotonic()))
    nodes.nodes_cpu = cpu_seconds() - began
    nodes.results = {i: outcome(job.name, i, result) for i, result in returned.items()}
    conn.send(("done", nodes))
    conn.recv()  # "close"
    close_nodes(job.name, handlers)
    handlers.clear()
    end = time.monotonic() + LEFTOVER_GRACE
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    conn.send(("closed", sum(thread.is_alive() for thread in threads)))


def node_factory(
    job: Job, requests: Counter[str], lock: threading.Lock, handlers: dict[int, Any]
) -> Callable[[int], Callable[[], Any]]:
    """``setup(i)``: build node ``i``'s store client and handler; return its timed call."""
    if job.name == "torch":
        return torch_node_factory(job, handlers)
    from rallypoint.builtins.rank_assigners import ordered
    from rallypoint.extensions import NodeSpec, RankAssigner, RendezvousRequest
    from rallypoint.rendezvous.protocol import StoreRendezvous
    from rallypoint.rendezvous.settings import Settings

    backend = store_backend(report.store_of(job.name))
    connect = backend.connect
    assert connect is not None
    options = rdzv_options(backend)
    settings = Settings.from_conf(job.n, job.n, options)  # prefix too: the backend's default
    assigner = RankAssigner("ordered", "", ordered)
    # A sealed variant: every node holds the job token, and seals and checks every record.
    token = SEALING_TOKEN if report.sealed(job.name) else None

    def setup(i: int) -> Callable[[], Any]:
        node = NodeSpec(f"node{i}", host=HOST)
        request = RendezvousRequest(
            job.run_id, job.endpoint, options, job.n, job.n, node=node, rank_assigner=assigner
        )
        store = CountingStore(connect(request), requests, lock)
        handler = StoreRendezvous(store, job.run_id, node, 1, assigner, settings, token=token)
        handlers[i] = handler
        return handler.next_round

    return setup


def torch_node_factory(job: Job, handlers: dict[int, Any]) -> Callable[[int], Callable[[], Any]]:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    def setup(i: int) -> Callable[[], Any]:
        params = RendezvousParameters(
            backend="c10d",
            endpoint=job.endpoint,
            run_id=job.run_id,
            min_nodes=job.n,
            max_nodes=job.n,
            local_addr=HOST,
            is_host=False,
            join_timeout=max(1, math.ceil(job.cap)),
            last_call_timeout=1,
        )
        backend, store = create_backend(params)
        handler = create_handler(store, backend, params)
        handlers[i] = handler
        return handler.next_rendezvous

    return setup


def outcome(name: str, i: int, result: Any) -> tuple[Any, ...]:
    """What the harness checks of node ``i``'s result (small, to send between processes):
    its round, rank, world size, the digest of the member list, whether it is in it at its
    rank (torch's handler returns only a rank and a world size)."""
    if name == "torch":
        return (0, result.rank, result.world_size, "", True)
    info = result.info
    members = hashlib.sha1("\n".join(info.members).encode()).hexdigest()
    placed = info.members[info.group_rank] == f"node{i}"
    return (info.round, info.group_rank, info.group_world_size, members, placed)


def close_nodes(name: str, handlers: dict[int, Any]) -> None:
    if name == "torch":
        for handler in handlers.values():
            # What shutdown() does first, without then marking the rendezvous closed in the
            # store (N more compare-and-sets of the whole state, possibly against stuck nodes).
            handler._stop_heartbeats()
        return
    # Closing waits for each heartbeat thread's current store call: close them all at once.
    with ThreadPoolExecutor(max_workers=64) as pool:
        list(pool.map(lambda handler: handler.close(), handlers.values()))


class CountingStore:
    """Any backend's ``CoordinationStore``, counting calls of its operations in ``counts``.

    A proxy rather than a subclass, so every backend's client is counted alike: one count
    per operation the protocol asks of the store (``get_many`` of N keys is one), not per
    wire request. ``clone`` is the store's own: the heartbeat thread's calls are not counted.
    """

    OPERATIONS = frozenset(
        {"add", "add_and_get", "get", "get_many", "set", "compare_set", "wait", "wait_value"}
        | {"keep_alive", "alive"}
    )

    def __init__(
        self, store: CoordinationStore, counts: Counter[str], lock: threading.Lock
    ) -> None:
        self._store = store
        self._counts = counts
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if name not in self.OPERATIONS:
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._counts[name] += 1
            return attribute(*args, **kwargs)

        return counted


def store_backend(name: str) -> RendezvousBackend:
    """The backend that ``--rdzv-backend NAME`` would choose, from the plugin registry."""
    from rallypoint.plugins import get_plugin_manager
    from rallypoint.registry import RENDEZVOUS_BACKENDS

    backend = get_plugin_manager().registry.get(RENDEZVOUS_BACKENDS, name)
    if backend.connect is None:
        raise SystemExit(f"--backends {name}: the backend has no store to run the protocol on")
    return backend


def rdzv_conf(name: str) -> str:
    return f"{PROTOCOL_CONF},{BACKEND_CONF[report.store_of(name)]}"


def rdzv_options(backend: RendezvousBackend) -> dict[str, Any]:
    """The backend's declared options, defaults but for ``rdzv_conf``, as the CLI parses them."""
    from rallypoint.config import parse_options

    flag = f"--rdzv-backend {backend.name}"
    return parse_options(rdzv_conf(backend.name), backend.options, "--rdzv-conf", flag)


# --- the harness --------------------------------------------------------------------------


class Workers:
    """The worker processes that run the simulated nodes: node ``i`` of N runs in process
    ``i mod P``, P = min(``count``, N). They are kept from one measurement to the next, and
    replaced after one that left nodes behind or went wrong."""

    def __init__(self, count: int, switch_interval: float) -> None:
        self.count = count
        self.switch_interval = switch_interval
        self.context = multiprocessing.get_context("spawn")  # no fork of gRPC or torch threads
        self.go = self.context.Event()
        self.abort = self.context.Value("b", 0)
        self.processes: list[tuple[Any, Connection]] = []
        self.used: list[Connection] = []
        self.clean = True

    def _start(self, count: int) -> None:
        while len(self.processes) < count:
            ours, theirs = self.context.Pipe()
            process = self.context.Process(
                target=worker,
                args=(theirs, self.go, self.abort, self.switch_interval),
                daemon=True,
            )
            process.start()
            theirs.close()
            self.processes.append((process, ours))

    def _receive(self, conn: Connection, timeout: float, kind: str) -> tuple[Any, ...]:
        try:
            if conn.poll(max(0.0, timeout)):
                message = conn.recv()
                if message[0] == kind:
                    return tuple(message)
        except (EOFError, OSError):
            raise HarnessError(f"a worker process died before {kind!r}") from None
        raise HarnessError(f"a worker process did not report {kind!r} in time")

    def run(self, job: Job, server_cpu: Callable[[], float]) -> tuple[Nodes, str | None]:
        """Set the job's nodes up, release them together, gather what they did (and the
        CPU time ``server_cpu`` counts meanwhile)."""
        if not self.clean:
            self.stop()
        self._start(min(self.count, job.n))
        self.clean = False  # until finish() says otherwise
        self.used = [conn for _, conn in self.processes[: min(self.count, job.n)]]
        self.go.clear()
        self.abort.value = 0
        for k, conn in enumerate(self.used):
            conn.send((job, list(range(k, job.n, len(self.used)))))
        nodes = Nodes()
        failure: str | None = None
        try:
            for conn in self.used:
                try:
                    _, error = self._receive(conn, SETUP_TIMEOUT + 60, "ready")
                except HarnessError as lost:
                    error = f"setup: {lost}"
                failure = failure or error
            if failure is not None:
                self.abort.value = 1
            server_began = server_cpu()
            nodes.started = time.perf_counter()
            self.go.set()
            for conn in self.used:
                wait = nodes.started + job.cap + 60 - time.perf_counter()
                nodes.add(self._receive(conn, wait, "done")[1])
            nodes.server_cpu = server_cpu() - server_began
        except HarnessError as error:
            failure = failure or str(error)
        return nodes, failure

    def finish(self, nodes: Nodes) -> None:
        """Close the nodes; count those still stuck after the grace period."""
        try:
            for conn in self.used:
                conn.send("close")
            for conn in self.used:
                nodes.leftover_threads += self._receive(conn, LEFTOVER_GRACE + 120, "closed")[1]
        except (HarnessError, OSError):
            return
        returned = len(nodes.results) + len(nodes.errors)
        self.clean = nodes.leftover_threads == 0 and len(nodes.ends) == returned

    def stop(self) -> None:
        for _, conn in self.processes:
            with contextlib.suppress(OSError):
                conn.send(None)
        for process, conn in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
            conn.close()
        self.processes = []
        self.clean = True


class Servers:
    """Where each implementation's nodes connect: etcd and Redis started once for the whole
    run (``tests/servers.py``, as the tests start them), a fresh TCPStore per measurement."""

    def __init__(self, names: Sequence[str], tmp_dir: str) -> None:
        sys.path.insert(0, str(ROOT / "tests"))
        import servers

        self.running: dict[str, Any] = {}
        try:
            stores = {report.store_of(name) for name in names}
            if "etcd" in stores:
                self.running["etcd"] = servers.start_etcd(tmp_dir)
            if "redis" in stores:
                self.running["redis"] = servers.start_redis(tmp_dir)
        except BaseException:
            self.stop()
            raise

    @contextlib.contextmanager
    def endpoint(self, name: str) -> Iterator[str]:
        """The ``--rdzv-endpoint`` of one measurement of ``name``."""
        name = report.store_of(name)
        if name in self.running:
            started = self.running[name]  # etcd or Redis
            yield str(started.endpoint) if name == "etcd" else f"{HOST}:{started.port}"
            return
        import torch.distributed as dist

        if name == "torch":
            port = common.free_port()
            server = dist.TCPStore(  # type: ignore[attr-defined]
                HOST, port, is_master=True, wait_for_workers=False, multi_tenant=True
            )
        else:
            # The server an agent hosts (libuv, no waiting for workers), handed an IPv4
            # socket to listen on: on its own dual-stack socket it looks every client
            # (::ffff:127.0.0.1) up in DNS as it accepts it, and this machine's resolver
            # stops answering after a few thousand lookups (5 s per connection then).
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((HOST, 0))
            listener.listen(4096)
            port = int(listener.getsockname()[1])
            server = dist.TCPStore(  # type: ignore[attr-defined]
                HOST,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=STORE_TIMEOUT),
                use_libuv=True,
                master_listen_fd=listener.detach(),  # the server's now: it closes it
            )
        try:
            yield f"{HOST}:{port}"
        finally:
            del server  # torch: stuck clients now fail instead of waiting out join_timeout

    def pid(self, name: str) -> int | None:
        """The process of ``name``'s server; None where this one hosts it (TCPStore)."""
        name = report.store_of(name)
        return int(self.running[name].pid) if name in self.running else None

    def stop(self) -> None:
        for server in self.running.values():
            server.stop()
        self.running.clear()


def summarise(n: int, nodes: Nodes, failure: str | None) -> Sample:
    """The measured round of ``n`` nodes, checked."""
    sample = Sample(n, error=failure, finished=len(nodes.ends), store_requests=dict(nodes.requests))
    sample.leftover_threads = nodes.leftover_threads
    sample.nodes_cpu, sample.server_cpu = nodes.nodes_cpu, nodes.server_cpu
    if failure is not None:
        return sample
    ends = nodes.ends.values()
    sample.first_done = min(ends) - nodes.started if ends else None
    if sample.finished < n:
        sample.error = f"{n - sample.finished} of {n} nodes still waiting"
        return sample
    sample.seconds = max(ends) - nodes.started
    if nodes.errors:
        kinds = Counter(error.split("(")[0] for error in nodes.errors.values())
        example = next(iter(nodes.errors.values()))
        sample.error = f"{len(nodes.errors)} nodes failed {dict(kinds)}: {example}"
    elif wrong := problems(n, nodes.results):
        sample.error = "; ".join(wrong)
    sample.ok = sample.error is None
    return sample


def problems(n: int, results: dict[int, tuple[Any, ...]]) -> list[str]:
    """What is wrong with the results of a run where every node returned."""
    rounds, ranks, sizes, members, placed = zip(*results.values(), strict=True)
    found = [
        (len(set(members)) != 1, "different member lists"),
        (sorted(ranks) != list(range(n)), "group ranks are not 0..N-1 once each"),
        (not all(placed), "a node's rank does not match its place in the member list"),
        (any(size != n for size in sizes), "a node's group world size is not N"),
        (len(set(rounds)) != 1, "nodes disagree on the round number"),
    ]
    return [problem for wrong, problem in found if wrong]


def measure_once(name: str, n: int, cap: float, servers: Servers, workers: Workers) -> Sample:
    with servers.endpoint(name) as endpoint:
        job = Job(name, endpoint, f"bench-{uuid.uuid4().hex[:12]}", n, cap)
        nodes, failure = workers.run(job, lambda: cpu_seconds(servers.pid(name)))
        if name != "torch":  # the nodes leave through the store
            workers.finish(nodes)
    if name == "torch":  # after its server is gone: its stuck nodes fail rather than wait
        gc.collect()
        workers.finish(nodes)
    return summarise(n, nodes, failure)


def record(runs: list[Sample], cap: float, n: int, stop: int | None) -> dict[str, Any]:
    """The results' entry of one implementation at ``n`` nodes (``stop``: where it gave up)."""
    kept: dict[str, Any] = {"samples": [asdict(s) for s in runs], "cap_seconds": cap}
    if stop is not None and n > stop:
        return {"status": "not run", "reason": f"failed or timed out at {stop} nodes", **kept}
    if not all(s.ok for s in runs):
        timed_out = any(s.seconds is None for s in runs)
        return {"status": "timed out" if timed_out else "failed", **kept}
    seconds = statistics.median(s.seconds or 0.0 for s in runs)
    first = statistics.median(s.first_done or 0.0 for s in runs)
    return {"status": "ok", "median_seconds": seconds, "median_first_done": first, **kept}


# --- context ------------------------------------------------------------------------------


def decode_cost(n: int) -> dict[str, float]:
    """What every node spends decoding an N-member round record (records.decode_round)."""
    from rallypoint.extensions import DEFAULT_PREFIX
    from rallypoint.rendezvous import records
    from rallypoint.rendezvous.keys import Keys

    ids = tuple(f"node{i}" for i in range(n))
    keys = Keys(DEFAULT_PREFIX, "bench-decode")
    record = records.RoundRecord(0, ids, (HOST,) * n, (1,) * n, HOST, 20000, run_id=keys.run_id)
    raw, key = records.encode(record), keys.of_round(0, "closed")
    times = []
    for _ in range(7):
        began = time.perf_counter()
        records.decode_round(key, raw)
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
    median, slowest = statistics.median(times) * 1e3, max(times) * 1e3
    return {"lookups": lookups, "median_ms": median, "max_ms": slowest}


def server_versions(names: Sequence[str]) -> dict[str, str]:
    """``etcd 3.4.23``, ``redis-server 7.0.15``: the servers the run talks to."""
    versions = {}
    for name, binary in (("etcd", "etcd"), ("redis", "redis-server")):
        path = shutil.which(binary)
        if name not in names or path is None:
            continue
        done = subprocess.run([path, "--version"], capture_output=True, text=True)
        found = re.search(r"(?:Version: |v=)(\S+)", done.stdout)
        versions[name] = f"{binary} {found.group(1) if found else 'unknown version'}"
    return versions


# --- the run ------------------------------------------------------------------------------


def measure(
    names: Sequence[str],
    sizes: Sequence[int],
    repeat: int,
    caps: dict[str, float],
    servers: Servers,
    workers: Workers,
) -> dict[str, dict[str, Any]]:
    """Every implementation at every size, ``repeat`` runs each, up to the size where one
    fails or times out. rallypoint's backends first, each repetition going through every
    size and backend in turn, so that the machine's drift within the hour does not go into
    the growth between sizes; torch's handler last, whose large runs load the machine for
    minutes after."""
    gave_up: dict[str, int] = {}  # the size of a name's failed run: no more runs there or larger

    def once(key: str) -> Sample:
        name, size = key.split()
        n = int(size)
        gc.collect()
        time.sleep(0.5)
        sample = measure_once(name, n, caps[name], servers, workers)
        retries = 0
        while (sample.error or "").startswith("setup") and retries < SETUP_RETRIES:
            # Nothing was timed yet: the nodes could not connect (torch's TCPStore server
            # looks every client up in DNS as it accepts it, and a resolver that stops
            # answering stalls it). Set up again after a pause.
            retries += 1
            print(f"{key}: {sample.error}; set up again", flush=True)
            time.sleep(SETUP_RETRY_PAUSE)
            sample = measure_once(name, n, caps[name], servers, workers)
        sample.setup_retries = retries
        if not sample.ok:
            gave_up[name] = n
        return sample

    def show(sample: Sample) -> str:
        shown = f"{sample.seconds:.3f} s" if sample.seconds is not None else "timed out"
        return shown + (f" ({sample.error})" if sample.error else "")

    def given_up(key: str, _: int) -> bool:
        name, size = key.split()
        return int(size) >= gave_up.get(name, math.inf)

    keys = [f"{name} {n}" for n in sizes for name in names if name != "torch"]
    samples = common.rounds(repeat, keys, once, show, rotate=False, skip=given_up)
    for n in sizes if "torch" in names else ():
        samples |= common.rounds(repeat, [f"torch {n}"], once, show, rotate=False, skip=given_up)
    return {
        name: {
            str(n): record(samples[f"{name} {n}"], caps[name], n, gave_up.get(name)) for n in sizes
        }
        for name in names
    }


def measure_all(args: argparse.Namespace) -> dict[str, Any]:
    from rallypoint.rendezvous import heartbeat

    names, sizes = args.names, args.sizes
    stores = [name for name in names if report.store_of(name) in report.STORE_BACKENDS]
    for name in stores:
        rdzv_options(
            store_backend(report.store_of(name))
        )  # a missing plugin or a bad option: fail now
    raise_file_limit()
    dns = reverse_dns()
    # Before measuring: the code measured is the code imported now.
    git = common.git_state("core/rallypoint/rendezvous", "protocol.py")
    load_before = os.getloadavg()[0]
    caps = {name: args.rallypoint_timeout for name in stores}
    caps["torch"] = args.torch_timeout
    with tempfile.TemporaryDirectory(prefix="bench-rdzv-") as tmp_dir:
        servers = Servers(names, tmp_dir)
        workers = Workers(args.processes, args.switch_interval)
        try:
            table = measure(names, sizes, args.repeat, caps, servers, workers)
        finally:
            workers.stop()
            servers.stop()
    del workers  # its semaphores unregister as they go, rather than warn at os._exit
    gc.collect()
    kept = ("repeat", "processes", "sizes", "torch_timeout", "rallypoint_timeout")
    return {
        "git": git,
        "servers": server_versions(names),
        # How often a joining node's heartbeat thread wakes, and its longest store wait
        # once its node is in a round, with this benchmark's settings.
        "heartbeat_wakeup_s": min(600 / 3, heartbeat.PROGRESS_INTERVAL),
        "wake_slice_s": heartbeat.WAKE_SLICE,
        "dns": dns,
        "load_average": [load_before, os.getloadavg()[0]],
        "decode": {str(n): decode_cost(n) for n in sizes},
        "backends": names,
        "rdzv_conf": {name: rdzv_conf(name) for name in stores},
        "switch_interval_s": args.switch_interval,
        **{key: getattr(args, key) for key in kept},
        "table": table,
    }


def main() -> None:
    implementations = ", ".join(report.IMPLEMENTATIONS)
    parser = common.options(
        __doc__,
        backends=(",".join(report.IMPLEMENTATIONS), f"comma-separated, of {implementations}"),
        nodes=("8,64,256,1024", "comma-separated node counts"),
        repeat=(3, "runs per N and implementation"),
        processes=(PROCESSES, "worker processes the N simulated nodes are spread over"),
        torch_timeout=(120.0, "seconds before a torch run is abandoned"),
        rallypoint_timeout=(600.0, "seconds before a rallypoint run is abandoned"),
        switch_interval=(SWITCH_INTERVAL, "sys.setswitchinterval of the worker processes"),
    )
    args = parser.parse_args()
    if not 0 < args.switch_interval <= 1:
        parser.error(f"--switch-interval {args.switch_interval:g}: give seconds in (0, 1]")
    wanted = {name.strip().lower() for name in args.backends.split(",") if name.strip()}
    if not wanted or wanted - set(report.IMPLEMENTATIONS):
        parser.error(f"--backends {args.backends!r}: choose from {implementations}")
    args.names = [name for name in report.IMPLEMENTATIONS if name in wanted]
    args.sizes = sorted({int(n) for n in args.nodes.split(",") if n.strip()})
    common.publish(
        args, "rendezvous", "benchmarks-rendezvous", measure_all, report.chart, report.render
    )
    if not args.render_only:
        # Threads of abandoned torch runs may still be blocked in C++; do not wait for them.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()

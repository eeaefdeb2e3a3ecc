"""Time to form one rendezvous round: rallypoint's protocol over each rendezvous backend's
store, side by side with torch's c10d rendezvous.

    .venv/bin/python benchmarks/bench_rendezvous.py [--backends c10d,etcd,redis,torch]
        [--nodes 8,64,256,1024] [--repeat 3] [--processes 16] [--torch-timeout 120]
        [--rallypoint-timeout 600]

N simulated nodes are spread over P = min(--processes, N) worker processes (node ``i`` in
process ``i mod P``), one thread per node, each node with its own store client and
handler. Real nodes are separate machines, each agent its own interpreter: putting a
thousand nodes in one interpreter would mostly measure them queueing for its one GIL.
For the same reason the worker processes set a GIL switch interval of 50 ms
(``--switch-interval``; Python's default of 5 ms makes each of a process's waiting threads
force a switch every 5 ms).
Every node thread builds its client and its rendezvous handler (not timed), then waits
until the harness releases all nodes of all processes at once, and joins the round:

* ``c10d``, ``etcd``, ``redis``: ``StoreRendezvous.next_round()``, rallypoint's protocol,
  over the store that the backend plugin's registered ``connect`` returns (looked up by name
  in the plugin registry, as ``--rdzv-backend NAME`` does), min = max = N nodes. The c10d
  store is a TCPStore server this process hosts, a fresh one on a fresh port per
  measurement (clients left over from a run that timed out cannot disturb the next); etcd
  and Redis are real servers (``tests/servers.py``) started once for the whole run, each
  measurement under its own run id;
* ``torch``: ``DynamicRendezvousHandler.next_rendezvous()`` with torch's ``c10d`` backend,
  as torchrun's agent calls it, min = max = N nodes, ``last_call_timeout=1``.

The time runs from the release until the last node's call returned (``perf_counter``,
the system-wide monotonic clock, so the processes' times compare). Each run is checked:
every node got a distinct group rank in ``0..N-1`` and (rallypoint) the same member list
and round. An implementation runs up to the N where a run fails or exceeds its cap
(``--torch-timeout``, which is also torch's ``join_timeout``, or ``--rallypoint-timeout``);
larger N are recorded as not run.

All processes, the store servers and the harness share this machine's CPUs: per-node work
that real nodes do on their own CPUs (their store calls, decoding the round's record) is
done here by N/P threads per interpreter on a few cores. The numbers are therefore an
upper bound for every implementation.

Results go to ``benchmarks/results/rendezvous.json`` and ``docs/benchmarks-rendezvous.md``
with a chart in ``docs/img/bench_rdzv_round_time.png``; ``--render-only`` rewrites the page
and chart from the JSON (also from results written before ``--backends`` existed, whose
``rallypoint`` column is the c10d backend).
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
import itertools
import json
import math
import multiprocessing
import platform
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
from common import IMAGES, ROOT

if TYPE_CHECKING:
    from rallypoint.extensions import RendezvousBackend
    from rallypoint.rendezvous.store import CoordinationStore

RESULTS = ROOT / "benchmarks" / "results" / "rendezvous.json"
REPORT = ROOT / "docs" / "benchmarks-rendezvous.md"
CHART = IMAGES / "bench_rdzv_round_time.png"
HOST = "127.0.0.1"
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
SETUP_TIMEOUT = 180.0  # seconds for all N nodes to connect and be ready
STORE_TIMEOUT = 300.0  # TCPStore read timeout of every c10d client
LEFTOVER_GRACE = 60.0  # seconds to wait for the threads of a run that timed out
#: Worker processes the simulated nodes are spread over, each with its own interpreter.
PROCESSES = 16
#: Seconds a thread of a worker process may run before a thread waiting for the GIL makes
#: it let go (``sys.setswitchinterval``; Python's default is 0.005): see ``switch_interval``.
SWITCH_INTERVAL = 0.05
#: Nodes of one worker process that set up (connect) at the same time.
SETUP_CONCURRENCY = 4
#: Times a run whose nodes could not all set up is tried again, and the pause before.
SETUP_RETRIES = 2
SETUP_RETRY_PAUSE = 30.0


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

#: ``--rdzv-conf`` of every rallypoint run, parsed against the backend's declared options
#: (the rest keep their defaults): generous timeouts, so that no simulated node is given up
#: on or declared dead while 2N threads share one GIL.
PROTOCOL_CONF = "join_timeout=600,last_call_timeout=30,close_timeout=60,heartbeat_timeout=600"
BACKEND_CONF = {
    # The harness hosts the store; every node is a client of it.
    "c10d": f"is_host=false,read_timeout={STORE_TIMEOUT:g}",
    # Liveness outlives heartbeat_timeout / 3 (what both plugins check); connect_timeout
    # also sets etcd's request timeout (2x), which one request can need at 1024 simulated
    # nodes in one process.
    "etcd": "lease_ttl=600,connect_timeout=60",
    "redis": "key_ttl=600,connect_timeout=60",
}


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
    setup_retries: int = 0  # runs before this one that failed to set up (not timed)
    # CPU seconds (user + system) from the release until every node returned: of the
    # worker processes (the nodes, their heartbeat threads, their client libraries), and
    # of the store's server (etcd, redis-server; the harness process hosting TCPStore).
    nodes_cpu: float | None = None
    server_cpu: float | None = None


# --- the harness --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def raise_file_limit() -> None:
    """Every node holds a few sockets (its store connection, its heartbeat's, a port)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass(frozen=True)
class Job:
    """One measurement, as each worker process sets up its share of the N nodes."""

    name: str  # one of IMPLEMENTATIONS
    endpoint: str
    run_id: str
    n: int
    cap: float


@dataclass
class Nodes:
    """What the N nodes of one measurement did, gathered from the worker processes.

    Times are ``time.perf_counter()`` values, which on Linux read the system-wide
    monotonic clock, so that those of different processes compare.
    """

    started: float = 0.0  # when the nodes were released
    ends: dict[int, float] = field(default_factory=dict)  # when each node's call returned
    results: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # see outcome()
    errors: dict[int, str] = field(default_factory=dict)
    requests: Counter[str] = field(default_factory=Counter)
    leftover_threads: int = 0
    nodes_cpu: float = 0.0  # see Sample
    server_cpu: float | None = None


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (this process if None), all threads."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    with open(f"/proc/{pid}/stat") as stat:
        fields_ = stat.read().rsplit(")", 1)[1].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


class HarnessError(Exception):
    """A worker process died or stopped answering."""


def worker(conn: Connection, go: Any, abort: Any, switch_interval: float) -> None:
    """A worker process: runs its share of the nodes of each job the harness sends it."""
    raise_file_limit()
    sys.setswitchinterval(switch_interval)
    while True:
        message = conn.recv()
        if message is None:
            return
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
    # Not every node connects at once: thousands of simultaneous connects can overrun a
    # server's accept queue (torch's TCPStore server has stalled on it), and setting up
    # is not timed.
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
        # Summarised once every node is done: digesting the N-member list here would
        # take the GIL from the nodes still reading the round.
        returned[i] = result

    # Daemon threads: a node stuck in a rendezvous that never completes must not keep the
    # process alive.
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
    cpu = cpu_seconds() - began
    nodes.results = {i: outcome(job.name, i, result) for i, result in returned.items()}
    conn.send(("done", nodes.ends, nodes.results, nodes.errors, dict(nodes.requests), cpu))
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
    from rallypoint.rendezvous.protocol import Settings, StoreRendezvous

    backend = store_backend(job.name)
    connect = backend.connect
    assert connect is not None
    options = rdzv_options(backend)
    settings = Settings.from_conf(job.n, job.n, options)  # prefix too: the backend's default
    assigner = RankAssigner("ordered", "", ordered)

    def setup(i: int) -> Callable[[], Any]:
        node = NodeSpec(f"node{i}", host=HOST)
        request = RendezvousRequest(
            job.run_id, job.endpoint, options, job.n, job.n, node=node, rank_assigner=assigner
        )
        store = CountingStore(connect(request), requests, lock)
        handler = StoreRendezvous(store, job.run_id, node, 1, assigner, settings)
        handlers[i] = handler
        return handler.next_round

    return setup


def outcome(name: str, i: int, result: Any) -> tuple[Any, ...]:
    """What the harness checks of node ``i``'s result (small, to send between processes)."""
    if name == "torch":
        return (result.rank, result.world_size)
    info = result.info
    members = hashlib.sha1("\n".join(info.members).encode()).hexdigest()
    return (
        info.round,
        info.group_rank,
        info.group_world_size,
        members,
        info.members[info.group_rank] == f"node{i}",
    )


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


class Workers:
    """The worker processes that run the simulated nodes: node ``i`` of N runs in process
    ``i mod P``, P = min(``count``, N). They are kept from one measurement to the next, and
    replaced after one that left nodes behind or went wrong."""

    def __init__(
        self,
        count: int,
        switch_interval: float = SWITCH_INTERVAL,
        target: Callable[..., None] = worker,
    ) -> None:
        self.count = count
        self.switch_interval = switch_interval
        self.target = target
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
                target=self.target,
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

    def run(
        self, job: Job, server_cpu: Callable[[], float] | None = None
    ) -> tuple[Nodes, str | None]:
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
            server_began = server_cpu() if server_cpu is not None else None
            nodes.started = time.perf_counter()
            self.go.set()
            for conn in self.used:
                _, ends, results, errors, requests, cpu = self._receive(
                    conn, nodes.started + job.cap + 60 - time.perf_counter(), "done"
                )
                nodes.ends.update(ends)
                nodes.results.update(results)
                nodes.errors.update(errors)
                nodes.requests.update(requests)
                nodes.nodes_cpu += cpu
            if server_cpu is not None and server_began is not None:
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
        self.clean = nodes.leftover_threads == 0 and len(nodes.ends) == len(nodes.results) + len(
            nodes.errors
        )

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


def summarise(n: int, state: Nodes, failure: str | None) -> Sample:
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


# --- rallypoint on a backend's store --------------------------------------------------------


class CountingStore:
    """Any backend's ``CoordinationStore``, counting calls of its operations in ``counts``.

    A proxy rather than a subclass, so every backend's client is counted the same way: one
    count per operation the protocol asks of the store (``get_many`` of N keys is one), not
    per wire request. ``clone`` is the store's own, so the heartbeat thread's connection is
    not counted.
    """

    OPERATIONS = frozenset(
        {
            "add",
            "add_and_get",
            "get",
            "get_many",
            "set",
            "compare_set",
            "wait",
            "wait_value",
            "keep_alive",
            "alive",
        }
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
    return ",".join(part for part in (PROTOCOL_CONF, BACKEND_CONF.get(name, "")) if part)


def rdzv_options(backend: RendezvousBackend) -> dict[str, Any]:
    """The backend's declared options, defaults but for ``rdzv_conf``, as the CLI parses them."""
    from rallypoint.config import parse_options

    flag = f"--rdzv-backend {backend.name}"
    return parse_options(rdzv_conf(backend.name), backend.options, "--rdzv-conf", flag)


def measure_store(
    name: str, endpoint: str, n: int, cap: float, workers: Workers, server_pid: int | None
) -> Sample:
    """rallypoint's protocol over the store of backend ``name`` at ``endpoint``, whose
    server is process ``server_pid`` (None: this process hosts it)."""
    job = Job(name, endpoint, f"bench-{uuid.uuid4().hex[:12]}", n, cap)
    nodes, failure = workers.run(job, lambda: cpu_seconds(server_pid))
    sample = summarise(n, nodes, failure)
    sample.store_requests = dict(nodes.requests)
    sample.nodes_cpu, sample.server_cpu = nodes.nodes_cpu, nodes.server_cpu
    if sample.ok:
        check_rallypoint(n, nodes.results, sample)
    workers.finish(nodes)
    sample.leftover_threads = nodes.leftover_threads
    return sample


def check_rallypoint(n: int, results: dict[int, tuple[Any, ...]], sample: Sample) -> None:
    problems = []
    if len({members for _, _, _, members, _ in results.values()}) != 1:
        problems.append("different member lists")
    if sorted(rank for _, rank, _, _, _ in results.values()) != list(range(n)):
        problems.append("group ranks are not 0..N-1 once each")
    if not all(placed for *_, placed in results.values()):
        problems.append("a node's rank does not match its place in the member list")
    if any(size != n for _, _, size, _, _ in results.values()):
        problems.append("a node's group world size is not N")
    if len({round_ for round_, *_ in results.values()}) != 1:
        problems.append("nodes disagree on the round number")
    if problems:
        sample.ok = False
        sample.error = "; ".join(problems)


class Servers:
    """Where each backend's nodes connect: etcd and Redis started once for the whole run
    (``tests/servers.py``, as the tests start them), a fresh c10d store per measurement."""

    def __init__(self, names: Sequence[str], tmp_dir: str) -> None:
        sys.path.insert(0, str(ROOT / "tests"))
        import servers

        self.running: dict[str, Any] = {}
        try:
            if "etcd" in names:
                self.running["etcd"] = servers.start_etcd(tmp_dir)
            if "redis" in names:
                self.running["redis"] = servers.start_redis(tmp_dir)
        except BaseException:
            self.stop()
            raise

    @contextlib.contextmanager
    def endpoint(self, name: str) -> Iterator[str]:
        """The ``--rdzv-endpoint`` of one measurement of backend ``name``."""
        if name == "c10d":
            import torch.distributed as dist

            # The server an agent hosts (TCPStoreClient with is_host: libuv, no waiting
            # for workers), handed an IPv4 socket on 127.0.0.1 to listen on. On its own
            # it listens on a dual-stack socket, where clients appear as ::ffff:127.0.0.1,
            # and it looks each one up in DNS as it accepts it (for its log): this
            # machine's resolver stops answering after a few thousand such lookups, and
            # the server's only thread then waits 5 s per connection.
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
                del server
        elif name == "etcd":
            yield str(self.running["etcd"].endpoint)
        elif name == "redis":
            yield f"{HOST}:{self.running['redis'].port}"
        else:
            raise ValueError(f"no server for backend {name!r}")

    def pid(self, name: str) -> int | None:
        """The process of backend ``name``'s server; None for c10d (this one hosts it)."""
        return None if name == "c10d" else int(self.running[name].pid)

    def stop(self) -> None:
        for server in self.running.values():
            server.stop()
        self.running.clear()


# --- torch c10d ---------------------------------------------------------------------------


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


def measure_torch(n: int, cap: float, workers: Workers) -> Sample:
    import torch.distributed as dist

    port = free_port()
    server = dist.TCPStore(  # type: ignore[attr-defined]
        HOST, port, is_master=True, wait_for_workers=False, multi_tenant=True
    )
    job = Job("torch", f"{HOST}:{port}", f"bench-{uuid.uuid4().hex[:12]}", n, cap)
    nodes, failure = workers.run(job, cpu_seconds)  # this process hosts the TCPStore
    sample = summarise(n, nodes, failure)
    sample.nodes_cpu, sample.server_cpu = nodes.nodes_cpu, nodes.server_cpu
    if sample.ok:
        results = nodes.results.values()
        if sorted(rank for rank, _ in results) != list(range(n)) or any(
            size != n for _, size in results
        ):
            sample.ok = False
            sample.error = "ranks are not 0..N-1 once each, or a world size is not N"
    del server  # stuck clients now fail instead of waiting out join_timeout
    gc.collect()
    workers.finish(nodes)
    sample.leftover_threads = nodes.leftover_threads
    return sample


# --- context ------------------------------------------------------------------------------


def decode_cost(n: int) -> dict[str, float]:
    """What every node spends decoding an N-member round record (records.decode_round)."""
    from rallypoint.rendezvous import records
    from rallypoint.rendezvous.protocol import DEFAULT_PREFIX, Keys

    ids = tuple(f"node{i}" for i in range(n))
    keys = Keys(DEFAULT_PREFIX, "bench-decode")
    fields: dict[str, Any] = {"run_id": keys.run_id} if hasattr(keys, "run_id") else {}
    raw = records.encode(records.RoundRecord(0, ids, (HOST,) * n, (1,) * n, HOST, 20000, **fields))
    key = keys.of_round(0, "closed")
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
    return {
        "lookups": lookups,
        "median_ms": statistics.median(times) * 1e3,
        "max_ms": max(times) * 1e3,
    }


def heartbeat_wakeup() -> float | None:
    """How often a joining node's heartbeat thread wakes with this benchmark's settings."""
    from rallypoint.rendezvous import protocol

    progress = getattr(protocol, "PROGRESS_INTERVAL", None)
    return min(600 / 3, progress) if isinstance(progress, (int, float)) else 600 / 3


def wake_slice() -> float | None:
    """The longest one store wait of a heartbeat thread once its node is in a round."""
    from rallypoint.rendezvous import protocol

    value = getattr(protocol, "WAKE_SLICE", None)
    return float(value) if isinstance(value, (int, float)) else None


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
    rallypoint_cap: float,
    torch_cap: float,
    servers: Servers,
    workers: Workers,
) -> dict[str, dict[str, Any]]:
    """Every implementation at every size, ``repeat`` runs each.

    rallypoint's backends first, each repetition going through every size and backend in
    turn: this machine's speed drifts by a fifth or more within an hour, and runs of one
    size taken minutes apart from those of the next would put that drift into the growth
    between sizes. torch's handler comes after them: its runs at 256 nodes and more load
    the machine for minutes, and a run right after one of them measured slower (a c10d
    round of 1024 nodes: 0.78 s before, 0.92 s right after, 0.79 s 20 s later).
    """

    def once(name: str, n: int, cap: float) -> Sample:
        if name == "torch":
            return measure_torch(n, cap, workers)
        with servers.endpoint(name) as endpoint:
            return measure_store(name, endpoint, n, cap, workers, servers.pid(name))

    samples: dict[str, dict[int, list[Sample]]] = {name: {n: [] for n in sizes} for name in names}
    gave_up: dict[str, int | None] = {name: None for name in names}

    def run(name: str, n: int, index: int) -> bool:
        """One run of ``name`` at ``n``; whether to go on with larger sizes."""
        cap = torch_cap if name == "torch" else rallypoint_cap
        gc.collect()
        time.sleep(0.5)
        sample = once(name, n, cap)
        retries = 0
        while (sample.error or "").startswith("setup") and retries < SETUP_RETRIES:
            # Nothing was timed yet: the nodes could not connect (torch's TCPStore
            # server looks up every client's address in DNS as it accepts it, and a
            # resolver that stops answering stalls it). Set up again after a pause.
            retries += 1
            print(f"{name:6} N={n:5} run {index + 1}/{repeat}: {sample.error}; again")
            time.sleep(SETUP_RETRY_PAUSE)
            sample = once(name, n, cap)
        sample.setup_retries = retries
        samples[name][n].append(sample)
        shown = f"{sample.seconds:.3f} s" if sample.seconds is not None else "timed out"
        extra = f" ({sample.error})" if sample.error else ""
        print(f"{name:6} N={n:5} run {index + 1}/{repeat}: {shown}{extra}", flush=True)
        if not sample.ok:
            gave_up[name] = n  # a failed or stuck run is not retried, nor larger sizes
        return sample.ok

    ours = [name for name in names if name != "torch"]
    for index in range(repeat):
        for n in sizes:
            for name in ours:
                stop = gave_up[name]
                if stop is None or n < stop:
                    run(name, n, index)
    if "torch" in names:
        for n in sizes:
            if not all(run("torch", n, index) for index in range(repeat)):
                break  # a failed or stuck run: no more runs at this size, nor larger sizes

    table: dict[str, dict[str, Any]] = {name: {} for name in names}
    for name in names:
        cap = torch_cap if name == "torch" else rallypoint_cap
        stop = gave_up[name]
        for n in sizes:
            if stop is not None and n > stop:
                table[name][str(n)] = {
                    "status": "not run",
                    "reason": f"failed or timed out at {stop} nodes",
                    "samples": [asdict(sample) for sample in samples[name][n]],
                }
            else:
                table[name][str(n)] = entry(samples[name][n], cap)
    return table


def entry(samples: list[Sample], cap: float) -> dict[str, Any]:
    record: dict[str, Any] = {"samples": [asdict(s) for s in samples], "cap_seconds": cap}
    if all(s.ok for s in samples):
        record["status"] = "ok"
        record["median_seconds"] = statistics.median(s.seconds or 0.0 for s in samples)
        record["median_first_done"] = statistics.median(s.first_done or 0.0 for s in samples)
    elif any(s.seconds is None for s in samples):
        record["status"] = "timed out"
    else:
        record["status"] = "failed"
    return record


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
        f"this machine's {os.cpu_count()} CPUs, where real nodes would each have their own.",
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
        lines.append(
            f"- **{LABELS[name]}** (issue {target.issue}): {wanted}. Measured: {measured}; "
            f"{growth}. Verdict: **{'met' if check['met'] else 'not met'}**."
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
        " Per node: the nodes' CPU divided by N. About half of its growth from 256 to 1024 "
        "nodes is each node decoding an N-member record (below; under load it takes 1.5 to 2 "
        "times as long as alone). The rest has no single cause found; the threads per "
        "interpreter are not it: the same N over 4, 16 or 64 worker processes took the same "
        "time within the runs' spread.",
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
        f"store servers for the machine's {os.cpu_count()} CPUs. Stores differ in how much of",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backends",
        default=",".join(IMPLEMENTATIONS),
        help="comma-separated implementations to measure, of "
        f"{', '.join(IMPLEMENTATIONS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--nodes",
        default="8,64,256,1024",
        help="comma-separated node counts (default: %(default)s)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per N and implementation")
    parser.add_argument(
        "--processes",
        type=int,
        default=PROCESSES,
        help="worker processes the N simulated nodes are spread over (default: %(default)s)",
    )
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
        "--switch-interval",
        type=float,
        default=SWITCH_INTERVAL,
        help="sys.setswitchinterval of the worker processes, in seconds (default: "
        "%(default)s; Python's own is 0.005)",
    )
    common.add_render_only(parser, RESULTS)
    args = parser.parse_args()
    if not 0 < args.switch_interval <= 1:
        parser.error(f"--switch-interval {args.switch_interval:g}: give seconds in (0, 1]")
    if args.render_only:
        saved = upgrade(json.loads(RESULTS.read_text()))
        saved["chart"] = chart(saved, saved["sizes"])
        REPORT.write_text(render(saved, saved["sizes"]) + "\n")
        common.wrote(REPORT, CHART)
        return
    names = [name.strip().lower() for name in args.backends.split(",") if name.strip()]
    unknown = [name for name in names if name not in IMPLEMENTATIONS]
    if unknown or not names:
        parser.error(f"--backends {args.backends!r}: choose from {', '.join(IMPLEMENTATIONS)}")
    names = [name for name in IMPLEMENTATIONS if name in names]
    sizes = sorted({int(n) for n in args.nodes.split(",") if n.strip()})
    for name in names:
        if name in STORE_BACKENDS:
            rdzv_options(store_backend(name))  # a missing plugin or a bad option: fail now

    raise_file_limit()

    import torch

    command = " ".join(["python", "benchmarks/bench_rendezvous.py", *sys.argv[1:]])
    dns = reverse_dns()
    # Before measuring: the code measured is the code imported now.
    git = common.git_state("core/rallypoint/rendezvous", "protocol.py")
    load_before = os.getloadavg()[0]
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-rdzv-") as tmp_dir:
        servers = Servers(names, tmp_dir)
        workers = Workers(args.processes, args.switch_interval)
        try:
            table = measure(
                names,
                sizes,
                args.repeat,
                args.rallypoint_timeout,
                args.torch_timeout,
                servers,
                workers,
            )
        finally:
            workers.stop()
            servers.stop()
    del workers  # its semaphores unregister as they go, rather than warn at os._exit
    gc.collect()
    results: dict[str, Any] = {
        **common.measured_on(began),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "git": git,
        "servers": server_versions(names),
        "heartbeat_wakeup_s": heartbeat_wakeup(),
        "wake_slice_s": wake_slice(),
        "dns": dns,
        "load_average": [load_before, os.getloadavg()[0]],
        "decode": {str(n): decode_cost(n) for n in sizes},
        "command": command,
        "backends": names,
        "rdzv_conf": {name: rdzv_conf(name) for name in names if name in STORE_BACKENDS},
        "counted": "store operations",
        "repeat": args.repeat,
        "processes": args.processes,
        "switch_interval_s": args.switch_interval,
        "order": "interleaved",
        "sizes": sizes,
        "torch_timeout": args.torch_timeout,
        "rallypoint_timeout": args.rallypoint_timeout,
        "wall_seconds": time.time() - began,
        "table": table,
    }
    results["verdicts"] = verdicts(results)
    results["chart"] = chart(results, sizes)
    common.write_results(RESULTS, results)
    REPORT.write_text(render(results, sizes) + "\n")
    print(json.dumps(results["verdicts"], indent=2))
    common.wrote(RESULTS, REPORT, CHART)
    # Threads of abandoned torch runs may still be blocked in C++; do not wait for them.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

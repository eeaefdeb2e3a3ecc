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
with a chart in ``docs/img/bench_rdzv_round_time.png`` (``rendezvous_report.py`` judges
them against the targets and writes the page); ``--render-only`` rewrites the page and
chart from the JSON (also from results written before ``--backends`` existed, whose
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
from common import ROOT
from rendezvous_report import (
    CHART,
    IMPLEMENTATIONS,
    REPORT,
    STORE_BACKENDS,
    chart,
    render,
    upgrade,
    verdicts,
)

if TYPE_CHECKING:
    from rallypoint.extensions import RendezvousBackend
    from rallypoint.rendezvous.store import CoordinationStore

RESULTS = ROOT / "benchmarks" / "results" / "rendezvous.json"
HOST = "127.0.0.1"
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

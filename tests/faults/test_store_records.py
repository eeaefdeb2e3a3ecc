"""Store contents written by something else, on every backend: records that are not JSON,
of another version, huge, of another job, with a member listed twice or fields missing, or
a pickle. Each is put into a real store (etcd and Redis through their own clients, the
c10d TCPStore through torch's) with no rallypoint code involved, and then a node runs the
rendezvous protocol on it: the outcome is one clear error naming the key, or the record
left out with a warning; never a traceback, never a crash loop, never code execution.

Most run the protocol in this process (a node of ``--nnodes 1:2`` or ``2:4`` over the
real store); one runs a real ``rallypoint run`` agent per backend. One etcd and one
redis-server serve the whole module, each test under a run id of its own (a c10d store
lives in a process: each test hosts its own, on a free port).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from fault_setups import Backend, Recovery, etcd_backend, redis_backend

from launch import events, start_rallypoint, worker
from rallypoint.config import parse_options
from rallypoint.extensions import NodeSpec, RendezvousRequest
from rallypoint.interfaces import Assignment, CoordinationStore, StoreError
from rallypoint.plugins import get_plugin_manager
from rallypoint.registry import RANK_ASSIGNERS, RENDEZVOUS_BACKENDS
from rallypoint.rendezvous import records
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.protocol import StoreRendezvous
from rallypoint.rendezvous.settings import Settings
from rallypoint.rendezvous.store_handler import InAgent
from servers import free_port

#: The run id of the examples that need no store.
RUN = "job"
#: Short liveness and last call: every case ends in seconds.
COMMON = "heartbeat_timeout=1.5,last_call_timeout=0.3,join_timeout=15,close_timeout=3"
CONF = {
    "c10d": COMMON + ",read_timeout=10",
    "etcd": COMMON + ",lease_ttl=3,connect_timeout=5",
    "redis": COMMON + ",key_ttl=3,retry_timeout=5",
}
MIB = 1024 * 1024
#: As big as each store takes: etcd refuses a request over 1.5 MiB (--max-request-bytes),
#: torch's TCPStore (libuv) a value over 8 MiB; nothing can write more there.
HUGE = {"c10d": 6 * MIB, "etcd": 1 * MIB, "redis": 10 * MIB}
#: The longest error line any of these may give: it names the key, never the value.
LONGEST_LINE = 400


class Evil:
    """Unpickling this runs a command: what a pickled record could do to its reader."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (os.system, (f"touch {self.marker}",))


# --- the store, from rallypoint's side and from the other program's ----------------------


class Stores:
    """Connections to one backend's store for a run of its own (``run_id``): ``connect()``
    opens one as a node does; ``write(key, value)`` writes raw bytes with the store's own
    client."""

    def __init__(self, backend: Backend) -> None:
        if backend.name == "c10d":
            backend = Backend("c10d", f"127.0.0.1:{free_port()}", None)
        self.backend = backend
        self.run_id = f"job-{uuid.uuid4().hex[:8]}"
        entry = get_plugin_manager().registry.get(RENDEZVOUS_BACKENDS, backend.name)
        self.entry = entry
        self.options = parse_options(CONF[backend.name], entry.options, "--rdzv-conf", "test")
        self.keys = Keys(Settings.from_conf(1, 1, self.options).prefix, self.run_id)
        self._close: list[Callable[[], None]] = []
        self._raw: Any = None
        if backend.name == "c10d":
            # The store of a c10d job lives in a process; here, this one (agents join it).
            self._raw = _tcpstore(backend.store_port, is_master=True)
            # Marked as an agent that hosts it marks it: agents join only such a store.
            self._raw.set(self.keys.host_key, b"the test")

    def connect(self) -> CoordinationStore:
        assert self.entry.connect is not None
        request = RendezvousRequest(self.run_id, self.backend.endpoint, self.options, 1, 3)
        store = self.entry.connect(request)
        self._close.append(store.close)
        return store

    def node(self, node_id: str, min_nodes: int = 1, max_nodes: int = 1) -> StoreRendezvous:
        assigner = get_plugin_manager().registry.get(RANK_ASSIGNERS, "ordered")
        store = self.connect()
        # As store_handler tells it: where the store lives in an agent, whether it is this one.
        host = cast(InAgent, store).hosting if self.entry.store_in_agent else None
        node = StoreRendezvous(
            store, self.run_id, NodeSpec(node_id, host="127.0.0.1"), 1, assigner,
            Settings.from_conf(min_nodes, max_nodes, self.options), host=host,
        )  # fmt: skip
        self._close.append(node.close)
        return node

    def write(self, key: str, value: bytes) -> None:
        """Put ``value`` at ``key`` as another program would: the store's own client."""
        name = self.backend.name
        if name == "c10d":
            self._raw.set(key, value)
        elif name == "etcd":
            import pyetcd

            assert self.backend.server is not None
            client = pyetcd.client("127.0.0.1", self.backend.store_port, timeout=10)
            try:
                client.put(key, value)
            finally:
                client.close()
        else:
            import redis

            with redis.Redis(port=self.backend.store_port, socket_timeout=10) as client:
                client.set(key, value)

    def close(self) -> None:
        for close in reversed(self._close):
            with contextlib.suppress(Exception):
                close()
        self._raw = None


def _tcpstore(port: int, *, is_master: bool) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        port,
        is_master=is_master,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
        use_libuv=True,
    )


@pytest.fixture(scope="module", params=["c10d", "etcd", "redis"])
def backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Backend]:
    """The module's store of each kind (the suite's ``backend``, shared by the tests)."""
    if request.param == "c10d":  # a placeholder: Stores hosts one per test
        yield Backend("c10d", "127.0.0.1:0", None)
        return
    make = {"etcd": etcd_backend, "redis": redis_backend}[request.param]
    with make(tmp_path_factory.mktemp(request.param)) as made:
        yield made


@pytest.fixture
def stores(backend: Backend) -> Iterator[Stores]:
    made = Stores(backend)
    yield made
    made.close()


def node_record(node_id: str, run_id: str, **fields: Any) -> bytes:
    record = records.NodeRecord(node_id, "127.0.0.1", 1, 29500, run_id=run_id)
    data = json.loads(records.encode(record))
    data.update(fields)
    return json.dumps(data).encode()


def round_record(round_: int, node_ids: tuple[str, ...], run_id: str) -> bytes:
    size = len(node_ids)
    return records.encode(
        records.RoundRecord(
            round_, node_ids, ("127.0.0.1",) * size, (1,) * size, "127.0.0.1", 29500,
            run_id=run_id,
        )
    )  # fmt: skip


# --- records a node cannot use: one clear error -------------------------------------------


@dataclass(frozen=True)
class Case:
    """A record put at ``where`` (``state``; or ``closed``, with a dead leader's
    ``joined`` count and node record before it) and the error it must give."""

    name: str
    where: str
    value: Callable[[Stores, Path], bytes]
    error: str


CASES = [
    Case("not JSON", "state", lambda s, t: b'{"kind": "counter", "version": ', "is not JSON"),
    Case("not UTF-8", "state", lambda s, t: b"\xff\xfe\x00garbage", "is not JSON"),
    Case("a pickle", "state", lambda s, t: pickle.dumps(Evil(t / "pwned")), "is not JSON"),
    Case(
        "another version",
        "state",
        lambda s, t: json.dumps({"kind": "counter", "version": 1, "value": 0}).encode(),
        f"has version 1; this rallypoint reads version {records.VERSION}",
    ),
    Case("another kind", "state", lambda s, t: b'{"kind": "node"}', "not a rallypoint counter"),
    Case("a JSON list", "state", lambda s, t: b"[1, 2, 3]", "not a rallypoint counter"),
    Case("huge", "state", lambda s, t: b"x" * HUGE[s.backend.name], "is not JSON"),
    Case(
        "huge and valid",
        "closed",
        lambda s, t: round_record(
            0, tuple(f"n{i}" for i in range(HUGE[s.backend.name] // 64)), s.run_id
        ).replace(b'"master_port":29500', b'"master_port":-1'),
        "is malformed",
    ),
    Case(
        "another job's", "closed", lambda s, t: round_record(0, ("x", "y"), "other"), "run 'other'"
    ),
    Case("a member twice", "closed", lambda s, t: round_record(0, ("x", "x"), s.run_id), "twice"),
    Case(
        "another round's", "closed", lambda s, t: round_record(7, ("x", "y"), s.run_id), "round 7"
    ),
    Case(
        "fields missing",
        "closed",
        lambda s, t: json.dumps({"kind": "round", "version": records.VERSION, "round": 0}).encode(),
        "is malformed: KeyError('node_ids')",
    ),
    Case(
        "the leader's, fields missing",
        "leader",
        lambda s, t: json.dumps(
            {"kind": "node", "version": records.VERSION, "node_id": "ghost"}
        ).encode(),
        "is malformed: KeyError('host')",
    ),
    Case(
        "runs that count another number of members",
        "closed",
        lambda s, t: round_record(0, ("x", "y"), s.run_id).replace(
            b'"nprocs":[[2,1]]', b'"nprocs":[[1000000000000,1]]'
        ),
        "do not count the 2 members",
    ),
    Case(
        "the leader's, a space in its node id",
        "leader",
        lambda s, t: node_record("gh ost", s.run_id),
        "whitespace",
    ),
    Case(
        "the leader's, a wrong type",
        "leader",
        lambda s, t: node_record("ghost", s.run_id, nproc="eight"),
        "is malformed",
    ),
]


@pytest.mark.fault(
    "A malformed or foreign store record: not JSON, a pickle, another version, huge (10 MB), "
    "another job's or round's, a member twice, fields missing",
    expected="one error line naming the key, at once; the record is never executed",
)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_record_no_node_can_use_is_one_clear_error(
    stores: Stores, case: Case, tmp_path: Path, recovery: Recovery
) -> None:
    keys = stores.keys
    value = case.value(stores, tmp_path)
    if case.where == "state":
        stores.write(keys.state(), value)
    else:
        # A node took join number 1 (the leader's), and another program wrote the round
        # record (or the leader's record): this node, number 2, reads it.
        stores.write(keys.state(), records.encode_int(0))
        stores.write(keys.of_round(0, "joined"), b"1")
        leader = value if case.where == "leader" else node_record("ghost", stores.run_id)
        stores.write(keys.of_round(0, "node", 1), leader)
        # The ghost leader is alive: a run whose agents are all gone is set aside, unread.
        ghost = stores.connect()
        ghost.keep_alive(keys.heartbeat("ghost"), 60)
        if case.where == "closed":
            stores.write(keys.of_round(0, "closed"), value)
    node = stores.node("a", 1, 2)
    began = time.monotonic()
    with pytest.raises(StoreError) as raised:
        node.next_round()
    recovery.seconds = time.monotonic() - began
    message = str(raised.value)
    assert case.error in message, message
    assert "rendezvous record" in message and "\n" not in message
    assert len(message) < LONGEST_LINE, message[:1000]
    assert recovery.seconds < 10  # at once: not after join_timeout
    assert not (tmp_path / "pwned").exists()


# --- records the round can do without: left out, with a warning ---------------------------


@pytest.mark.fault(
    "A joiner's record that is garbage, or repeats another node's id",
    expected="the round closes with the real nodes, leaving it out with a warning",
)
def test_a_bad_joiner_record_is_left_out_with_a_warning(
    stores: Stores, caplog: pytest.LogCaptureFixture, recovery: Recovery
) -> None:
    """Join numbers 2 and 3 are taken by another program, which writes garbage and a copy
    of node a's record; a and b (numbers 1 and 4) form the round without them. The leader
    a waits for number 2 (MIN), written last: by then every join number has its record."""
    keys = stores.keys
    a, b = stores.node("a", 2, 4), stores.node("b", 2, 4)
    raw = stores.connect()
    results: dict[str, Assignment | BaseException] = {}

    def join(name: str, node: StoreRendezvous) -> None:
        try:
            results[name] = node.next_round()
        except BaseException as error:
            results[name] = error

    def until(done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 10
        while not done():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    caplog.set_level(logging.WARNING, "rallypoint.rendezvous")
    began = time.monotonic()
    threads = [threading.Thread(target=join, args=(n.state.node_id, n)) for n in (a, b)]
    threads[0].start()
    until(lambda: raw.add(keys.of_round(0, "joined"), 0) >= 1, "node a never joined")
    assert raw.add(keys.of_round(0, "joined"), 2) == 3
    threads[1].start()
    until(lambda: raw.get(keys.of_round(0, "node", 4)) is not None, "node b never joined")
    stores.write(keys.of_round(0, "node", 3), node_record("a", stores.run_id))
    stores.write(keys.of_round(0, "node", 2), b"\x00not a record")
    for thread in threads:
        thread.join(timeout=20)
    recovery.seconds = time.monotonic() - began
    for name in ("a", "b"):
        result = results[name]
        assert isinstance(result, Assignment), result
        assert result.info.members == ("a", "b")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("/0/node/2" in w and "is not JSON" in w for w in warnings), warnings
    assert any("/0/node/3" in w and "repeats node 'a'" in w for w in warnings), warnings


@pytest.mark.fault(
    "Garbage under other run ids' keys (`job2`, `jo`, `job-x` next to `job`)",
    expected="ignored: the job's own round completes",
)
def test_another_jobs_keys_are_never_read(stores: Stores, recovery: Recovery) -> None:
    run = stores.run_id
    root = stores.keys.root.removesuffix(f"{run}/")
    for other in (f"{run}2", run[:-1], f"{run}-x", f"{run}.", run.upper()):
        for key in ("state", "0/joined", "0/node/1", "0/closed", "hb/a"):
            stores.write(f"{root}{other}/{key}", b"\x80garbage")
    began = time.monotonic()
    assignment = stores.node("a").next_round()
    recovery.seconds = time.monotonic() - began
    assert assignment.info.members == ("a",)


# --- a real agent ---------------------------------------------------------------------------


@pytest.mark.fault(
    "Malformed JSON in the store, under a `rallypoint run` agent",
    expected="the agent exits 1 with one line naming the key; no restart loop, no traceback",
)
def test_an_agent_exits_with_one_line(stores: Stores, tmp_path: Path, recovery: Recovery) -> None:
    stores.write(stores.keys.state(), b"{not json")
    log = tmp_path / "agent.log"
    began = time.monotonic()
    agent = start_rallypoint(
        "run", "--nnodes", "2", "--rdzv-backend", stores.backend.name,
        "--rdzv-endpoint", stores.backend.endpoint, "--rdzv-id", stores.run_id,
        "--rdzv-conf", CONF[stores.backend.name], "--event-log", str(log.with_suffix(".jsonl")),
        worker("allreduce.py"), "1", log=log,
    )  # fmt: skip
    try:
        code = agent.wait(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    recovery.seconds = time.monotonic() - began
    output = log.read_text()
    assert code == 1, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("rallypoint: error: ")]
    assert len(errors) == 1, output
    assert f"{stores.keys.state()!r} is not JSON" in errors[0]
    assert len(events(log, "rendezvous_started")) == 1
    assert not events(log, "workers_started")


# --- nothing is ever unpickled ------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
SOURCES = [
    path
    for folder in ("core", "cli", "plugins")
    for path in sorted((REPO / folder).rglob("*.py"))
    if "build" not in path.relative_to(REPO).parts
]
#: Modules that turn bytes into objects by running code.
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
#: The one exec: the preloaded interpreter runs the worker's own script, as `python SCRIPT`.
RUNS_THE_SCRIPT = "core/rallypoint/agent/processes/zygote.py"


def test_no_source_can_unpickle() -> None:
    """No module of rallypoint or its plugins imports a deserialiser that runs code, calls
    eval or exec, or calls torch.load without weights_only (or with weights_only=False)."""
    import ast

    assert len(SOURCES) > 30, SOURCES
    found: list[str] = []
    for path in SOURCES:
        where = path.relative_to(REPO)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            else:
                names = []
            line = getattr(node, "lineno", 0)
            found += [f"{where}:{line}: imports {n}" for n in names if n in UNSAFE_MODULES]
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name == "eval" or (name == "exec" and str(where) != RUNS_THE_SCRIPT):
                found.append(f"{where}:{node.lineno}: calls {name}")
            if name.endswith("yaml.load") or name.endswith("yaml.unsafe_load"):
                found.append(f"{where}:{node.lineno}: calls {name}")
            if name == "torch.load" or name.endswith(".torch.load"):
                safe = [k for k in node.keywords if k.arg == "weights_only"]
                if not safe or (
                    isinstance(safe[0].value, ast.Constant) and safe[0].value.value is not True
                ):
                    found.append(f"{where}:{node.lineno}: torch.load without weights_only=True")
    assert not found, "\n".join(found)
    # Where torch.load's weights_only is passed on, the public default is the safe one.
    import inspect

    from rallypoint import checkpoint

    assert inspect.signature(checkpoint.load_latest).parameters["weights_only"].default is True


def test_records_round_trip_as_json_only() -> None:
    node = records.NodeRecord("a", "h", 2, 29500, {"rack": "r1"}, 0, run_id=RUN)
    closed = records.RoundRecord(3, ("a", "b"), ("h", "i"), (2, 1), "h", 29500, run_id=RUN)
    keys = Keys("/rallypoint", RUN)
    for record in (node, closed):
        data = json.loads(records.encode(record))  # plain JSON, all of it
        assert data["kind"] in ("node", "round") and data["version"] == records.VERSION
        assert data["run_id"] == RUN
    assert records.decode_node(keys.of_round(3, "node", 1), records.encode(node)) == node
    raw = records.encode(closed)
    assert records.decode_round(keys.of_round(3, "closed"), raw) == closed
    # Members compactly: ids and hosts as text, nprocs as [count, nproc] runs.
    data = json.loads(raw)
    assert (data["node_ids"], data["hosts"], data["nprocs"]) == ("a b", "h i", [[1, 2], [1, 1]])
    for shape in [
        records.RoundRecord(0, ("a",), ("",), (8,), "h", 1, run_id=RUN),  # a host unknown
        records.RoundRecord(0, ("a", "b", "c"), ("h", "", "h"), (8, 8, 4), "h", 1, run_id=RUN),
        records.RoundRecord(0, (), (), (), "", 0, error="no", run_id=RUN),
    ]:
        assert records.decode_round(keys.of_round(0, "closed"), records.encode(shape)) == shape
    with pytest.raises(ValueError, match="without spaces"):
        records.encode(records.RoundRecord(0, ("a b",), ("h",), (1,), "h", 1, run_id=RUN))
    assert records.decode_int(keys.state(), records.encode_int(5)) == 5
    # The same bytes under another job's keys are another job's record.
    with pytest.raises(StoreError, match="belongs to run 'job'"):
        records.decode_round(Keys("/rallypoint", "job2").of_round(3, "closed"), raw)
    with pytest.raises(StoreError, match="belongs to run 'job'"):
        records.decode_node(
            Keys("/rallypoint", "job2").of_round(3, "node", 1), records.encode(node)
        )

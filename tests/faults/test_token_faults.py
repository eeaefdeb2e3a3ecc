"""A job with a token (every job of the fault suite has one: ``fault_setups.TOKEN_FILE``)
against a stray client of its store, on every backend, with real agents: what the stray
writes takes no part in a round, and a node given another token is kept out in a sentence.
The stray's attacks on the peer port: tests/test_job_token.py."""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from pathlib import Path

from fault_setups import CONF, Backend, on_backends

from launch import kill, worker
from rallypoint.config import parse_options
from rallypoint.extensions import RendezvousRequest
from rallypoint.interfaces import CoordinationStore
from rallypoint.plugins import get_plugin_manager
from rallypoint.registry import RENDEZVOUS_BACKENDS
from rallypoint.rendezvous import records
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.liveness import _GONE
from rallypoint.rendezvous.settings import Settings

STEP = re.compile(r"step=(\d+) rank=0 world=(\d+) at=")


def stray_client(backend: Backend, run_id: str) -> tuple[CoordinationStore, Keys]:
    """A client of the job's store as any process that reaches it has one: no token."""
    entry = get_plugin_manager().registry.get(RENDEZVOUS_BACKENDS, backend.name)
    options = parse_options(CONF[backend.name], entry.options, "--rdzv-conf", "test")
    assert entry.connect is not None
    store = entry.connect(RendezvousRequest(run_id, backend.endpoint, options, 1, 3))
    return store, Keys(Settings.from_conf(1, 3, options).prefix, run_id)


def attack(store: CoordinationStore, keys: Keys, run_id: str) -> tuple[int, list[str]]:
    """Everything but deleting keys: say the job failed, mark every member leaving and
    (TCPStore) gone, and take join number 1 of the next round with a well-formed record,
    kept alive. The running round, and its members, read from its sealed record."""
    state = store.get(keys.state())
    round_ = 0 if state is None else records.decode_int(keys.state(), _value(state))
    closed = keys.of_round(round_, "closed")
    raw = store.get(closed)
    assert raw is not None, "the job's round record"
    members = list(records.decode_round(closed, _value(raw)).node_ids)
    store.set(keys.failed(), b'{"node": "stray", "reason": "forged"}')
    for member in members:
        store.set(keys.leaving(round_, member), b"1")
        store.add(keys.heartbeat(member), _GONE)  # gone at once, on TCPStore's counters
    store.add(keys.of_round(round_ + 1, "joined"), 1)
    forged = records.NodeRecord("stray", "10.9.9.9", 8, 29500, run_id=run_id, nnodes="2:3")
    store.set(keys.of_round(round_ + 1, "node", 1), records.encode(forged))
    store.keep_alive(keys.heartbeat("stray"), 3.0)
    return round_, members


def _value(raw: bytes) -> bytes:
    """A sealed value without its seal (``rp1.<tag>.<value>``): anyone can read it."""
    return raw.split(b".", 2)[2]


def world_steps(log: Path, world: int) -> int:
    return sum(1 for _, w in STEP.findall(log.read_text()) if int(w) == world)


def wait_for_world(log: Path, world: int, steps: int = 5, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while world_steps(log, world) < steps:
        assert time.monotonic() < deadline, f"no {steps} steps at world {world}:\n{log.read_text()}"
        time.sleep(0.1)


@on_backends("c10d", "etcd", "redis")
def test_a_stray_takes_no_part_and_another_token_is_kept_out(
    backend: Backend, tmp_path: Path
) -> None:
    run_id = f"token-{uuid.uuid4().hex[:8]}"
    script = (worker("notice_steps.py"), "0.1", "1000000", f"token-{uuid.uuid4().hex}")
    agents: list[subprocess.Popen[str]] = []
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "c", "w")}

    def start(name: str, conf: str = "") -> subprocess.Popen[str]:
        checkpoints = ("--checkpoint-dir", str(tmp_path / "ckpt"))
        agent = backend.start_agent(
            run_id, "2:3", *checkpoints, *script, log=logs[name], nproc=1, conf=conf
        )
        agents.append(agent)
        return agent

    start("a")  # first: on c10d its agent hosts the store the stray then reaches
    store, keys = stray_client(backend, run_id)
    try:
        start("b")
        wait_for_world(logs["a"], 2)
        _, members = attack(store, keys, run_id)
        # A node of the job comes: the job re-forms, at world 3, with its own nodes.
        start("c")
        wait_for_world(logs["a"], 3, timeout=120)
        # A node with another token is told so, at once, and the job never notices.
        other = tmp_path / "other.token"
        other.write_text("another job's secret")
        wrong = start("w", conf=f"token_file={other}")
        assert wrong.wait(timeout=60) == 1, logs["w"].read_text()
        steps = world_steps(logs["a"], 3)
        wait_for_world(logs["a"], 3, steps=steps + 5)
        for name in "abc":
            assert agents["abc".index(name)].poll() is None, logs[name].read_text()
    finally:
        kill(*agents)
        store.close()
    said = logs["w"].read_text()
    assert "this node's job token is not the one the job's nodes use" in said, said
    assert "Traceback" not in said and "world=" not in said
    text = "".join(logs[name].read_text() for name in "abc")
    assert "stray" not in text and "10.9.9.9" not in text and "forged" not in text, text
    assert "is gone" not in text, text  # neither the marks nor the counters' drop believed
    assert "not sealed with this job's token" in text  # what was ignored is in the log
    assert len(members) == 2, members


def round_members(store: CoordinationStore, keys: Keys) -> tuple[int, list[str]]:
    """The job's round and its members, read from its sealed record as anyone can."""
    state = store.get(keys.state())
    round_ = 0 if state is None else records.decode_int(keys.state(), _value(state))
    closed = keys.of_round(round_, "closed")
    raw = store.get(closed)
    assert raw is not None, "the job's round record"
    return round_, list(records.decode_round(closed, _value(raw)).node_ids)


@on_backends("etcd")
def test_a_stray_that_ends_the_members_liveness_ends_no_round(
    backend: Backend, tmp_path: Path
) -> None:
    """For three heartbeat timeouts a stray ends every member's liveness in the store, over
    and over (it renews each member's lease, key or counter as its own, then closes: etcd
    revokes the lease, Redis deletes the key, TCPStore's counter drops below zero). The
    members' sealed marks keep rising: nobody is taken for gone, the round trains on.
    Before marks, the first look at a revoked lease ended the round."""
    run_id = f"liveness-{uuid.uuid4().hex[:8]}"
    script = (worker("notice_steps.py"), "0.1", "1000000", f"live-{uuid.uuid4().hex}")
    logs = {name: tmp_path / f"{name}.log" for name in "ab"}
    checkpoints = ("--checkpoint-dir", str(tmp_path / "ckpt"))
    agents = [
        backend.start_agent(run_id, "2:3", *checkpoints, *script, log=logs[name], nproc=1)
        for name in "ab"
    ]
    store, keys = stray_client(backend, run_id)
    try:
        wait_for_world(logs["a"], 2)
        round_, members = round_members(store, keys)
        ends = time.monotonic() + 9  # three heartbeat_timeouts of fault_setups.CONF
        while time.monotonic() < ends:
            for member in members:
                touch = store.clone()
                touch.keep_alive(keys.heartbeat(member), 3.0)
                touch.close()
            time.sleep(0.3)
        steps = world_steps(logs["a"], 2)
        wait_for_world(logs["a"], 2, steps=steps + 5)
        assert round_members(store, keys)[0] == round_, "a round ended"
        assert all(agent.poll() is None for agent in agents)
    finally:
        kill(*agents)
        store.close()
    text = "".join(log.read_text() for log in logs.values())
    assert "is gone" not in text, text

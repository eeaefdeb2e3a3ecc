"""Memory checkpoints (``--checkpoint-memory``, docs/checkpointing.md "Memory
checkpoints"): real agents, real workers (tests/workers/mem_train.py, a save every step),
and the faults the tier is for; every wait bounded.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from launch import (
    RALLYPOINT,
    assert_no_worker_left,
    clean_environment,
    declared,
    kill,
    rallypoint,
    wait_for_text,
    worker,
)
from rallypoint.checkpoint import Checkpointer
from servers import RedisServer

TRAIN = worker("mem_train.py")
DONE = re.compile(r"done step=(\d+) world=(\d+)")
MEMORY = "64MB"
#: Liveness and rendezvous settings of the two-node jobs: a lost node is seen in seconds.
CONF = "heartbeat_timeout=3,last_call_timeout=1,join_timeout=60"


def loads(log: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(log) if e["event"] == "checkpoint_loaded"]


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        declared(record)
    return records


def memory_dirs(text: str) -> set[str]:
    return set(re.findall(r"memory=(\S+)", text))


def durable_steps(path: Path) -> list[int]:
    return Checkpointer(str(path), rank=0, world_size=1).steps() if path.exists() else []


def run_one_node(tmp_path: Path, *script: str, flags: tuple[str, ...] = ()) -> tuple[str, Path]:
    log = tmp_path / "events.jsonl"
    tag = str(tmp_path / "stop")  # never created: it makes the workers' command lines unique
    done = rallypoint(
        "run", "--nproc-per-node", "2", "--max-restarts", "1", "--checkpoint-memory", MEMORY,
        "--event-log", str(log), *flags, TRAIN, *script, "--stop-file", tag, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert_no_worker_left(tag)
    for directory in memory_dirs(done.stdout):  # the agent removed its shared memory
        assert not os.path.exists(directory), directory
    return done.stdout + done.stderr, log


def test_a_worker_sigkill_resumes_from_memory_losing_no_step(tmp_path: Path) -> None:
    """Rank 1 dies in step 6; rank 0 had returned from saving step 5 (its copy committed by
    then) and may have saved step 6: both resume from the newest, from memory, and no step
    that rank 0 finished is done twice."""
    out, log = run_one_node(tmp_path, "12", "--kill-rank", "1", "--kill-at", "6")
    resumed = [(e["step"], e["source"]) for e in loads(log)]
    first_attempt = out.split("resumed source=")[0]
    finished = max(int(step) for step in re.findall(r"\[default0\]:done step=(\d+)", first_attempt))
    assert resumed in ([(5, "memory")] * 2, [(6, "memory")] * 2), out
    assert resumed[0][0] >= finished, out
    assert "done step=11" in out
    assert "left running" not in out  # no process writes a copy: nothing to stop


def test_a_torn_memory_copy_is_never_loaded(tmp_path: Path) -> None:
    """Rank 0 is SIGKILLed in the middle of copying step 5's state (24 MB) into its arena:
    the copy was never committed, and the ranks resume from step 4."""
    out, log = run_one_node(tmp_path, "8", "--tear-at", "5", "--megabytes", "24")
    assert [(e["step"], e["source"]) for e in loads(log)] == [(4, "memory")] * 2, out


def test_a_damaged_copy_sent_or_made_durable_is_skipped(tmp_path: Path) -> None:
    """A memory copy in a checkpoint folder (a peer's, a durable one) carries its CRC-32: a
    flipped byte makes a load skip it for the one before."""
    import torch

    from rallypoint.checkpoint import FileStorage, slot
    from rallypoint.checkpoint.arena import Arena
    from rallypoint.checkpoint.copies import Copies
    from rallypoint.checkpoint.tier import Tier

    memory = Arena(tmp_path / "shm", 0, keep=2)
    durable = Tier(FileStorage(str(tmp_path / "ckpt")), 3)
    copies = Copies(tmp_path / "shm" / slot.ARENA)
    for step in (4, 5):
        memory.save({"w": torch.full((1000,), float(step))}, step, rank=0, world_size=1)
        with copies.hold(step) as held:
            durable.receive(held.manifest, held.open)
    memory.close()
    newest = tmp_path / "ckpt" / "step-000000000005" / "rank-00000.slot"
    data = bytearray(newest.read_bytes())
    data[-100] ^= 0xFF  # a tensor's byte, past the record and the header
    newest.write_bytes(bytes(data))
    loaded = Checkpointer(str(tmp_path / "ckpt"), rank=0, world_size=1).load_latest()
    assert (
        loaded is not None
        and loaded.step == 4
        and torch.equal(loaded.state["w"], torch.full((1000,), 4.0))
    )
    assert "does not match its checksum" in loaded.skipped[0]


def test_a_script_without_checkpoint_memory_saves_to_the_directory(tmp_path: Path) -> None:
    """The default: no memory tier, saves go to --checkpoint-dir as before."""
    ckpt = tmp_path / "ckpt"
    done = rallypoint(
        "run", "--nproc-per-node", "2", "--checkpoint-dir", str(ckpt), TRAIN, "6", timeout=120
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "memory= rank=0" in done.stdout
    assert durable_steps(ckpt)[-1] == 5


def test_every_kth_memory_checkpoint_is_made_durable_and_the_last(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    out, log = run_one_node(
        tmp_path, "23", flags=("--checkpoint-dir", str(ckpt), "--checkpoint-persist-every", "5")
    )
    persisted = [e["step"] for e in read_events(log) if e["event"] == "checkpoint_persisted"]
    # The 5th, 10th... save (step 4, 9...), or a newer copy when the worker had written over
    # it by the time the agent took it (saves here come every 0.05 s); and the last.
    *every_kth, last = persisted
    assert len(every_kth) >= 2 and "not copied" not in out, out
    assert all(step >= 5 * i + 4 for i, step in enumerate(every_kth)), out
    assert persisted == sorted(set(persisted)) and last == 22, out
    assert durable_steps(ckpt) == persisted[-3:], out


def test_sigterm_makes_the_newest_memory_checkpoint_durable(tmp_path: Path) -> None:
    """A preemption: the agent is told to stop; before it exits, --checkpoint-dir holds the
    newest checkpoint the workers saved to memory (none was copied before)."""
    ckpt, log, out = tmp_path / "ckpt", tmp_path / "events.jsonl", tmp_path / "out.log"
    with out.open("w") as handle:
        agent = subprocess.Popen(
            [RALLYPOINT, "run", "--nproc-per-node", "2", "--checkpoint-memory", MEMORY,
             "--checkpoint-dir", str(ckpt), "--checkpoint-persist-every", "100000",
             "--event-log", str(log), TRAIN, "100000", "--step-seconds", "0.02"],
            env=clean_environment(), stdout=handle, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        wait_for_text(out, "done step=20", 60)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 128 + signal.SIGTERM
    finally:
        kill(agent)
    saved = [e["step"] for e in read_events(log) if e["event"] == "checkpoint_saved"]
    assert durable_steps(ckpt) == [max(saved)], out.read_text()
    assert "received SIGTERM" in out.read_text() and "copying checkpoint" in out.read_text()


FULL_PLUGIN = '''
import errno
from rallypoint.checkpoint.storage import FileStorage
from rallypoint.sdk import CheckpointBackend, hookimpl


class FillingStorage(FileStorage):
    """A directory whose disk is full once it holds one complete checkpoint."""

    def writer(self, name):
        if any(self.root.glob("step-*/manifest.json")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().writer(name)


@hookimpl
def register_checkpoint_backends():
    return [CheckpointBackend("filling", "a disk that fills", schemes=("filling",),
                              open=lambda url: FillingStorage(url.removeprefix("filling://")))]
'''


def test_a_full_disk_while_persisting_keeps_the_last_durable_copy(
    tmp_path: Path, install_plugin: Any
) -> None:
    """The disk is full after the first durable copy: the agent says, in one line per copy,
    that it could not copy; the job finishes; the first copy stays whole and loadable."""
    site = install_plugin("filling", FULL_PLUGIN)
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "events.jsonl"
    with (tmp_path / "out.log").open("w") as handle:
        process = subprocess.Popen(
            [RALLYPOINT, "run", "--nproc-per-node", "2", "--checkpoint-memory", MEMORY,
             "--checkpoint-dir", f"filling://{ckpt}", "--checkpoint-persist-every", "5",
             "--event-log", str(log), TRAIN, "16", "--step-seconds", "0.1"],
            env=clean_environment({"PYTHONPATH": str(site)}), stdout=handle,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        assert process.wait(120) == 0
    finally:
        kill(process)
    text = (tmp_path / "out.log").read_text()
    assert re.search(r"checkpoint of step \d+ not copied to filling://.*No space left", text), text
    # The 5th save's copy, or a newer one if the slot was written over before it was read.
    (first,) = [e["step"] for e in read_events(log) if e["event"] == "checkpoint_persisted"]
    assert first >= 4 and f"training goes on; it keeps step {first}" in text, text
    loaded = Checkpointer(str(ckpt), rank=0, world_size=1).load_latest()
    assert loaded is not None and loaded.step == first and loaded.skipped == ()
    assert "done step=15" in text


def test_bad_checkpoint_memory_values_are_one_sentence(tmp_path: Path) -> None:
    for value, expected in (
        ("lots", "--checkpoint-memory 'lots': expected a size such as 512MB"),
        ("100000TB", "/dev/shm has"),
        ("0", "give a size above 0"),
    ):
        done = rallypoint("run", "--checkpoint-memory", value, TRAIN, "1", timeout=60)
        assert done.returncode == 2, done.stderr
        assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr
    done = rallypoint(
        "run", "--checkpoint-memory", "1MB", "--checkpoint-persist-every", "0", TRAIN, "1"
    )
    assert done.returncode == 2 and "--checkpoint-persist-every" in done.stderr, done.stderr


def test_a_save_that_does_not_fit_says_so(tmp_path: Path) -> None:
    """64 MB of state in 16 MB of node memory: one error naming the setting."""
    done = rallypoint(
        "run", "--checkpoint-memory", "16MB", TRAIN, "2", "--megabytes", "64", timeout=120
    )
    assert done.returncode == 1
    assert "does not fit in the node memory given to checkpoints" in done.stdout + done.stderr


# --- sharded state ------------------------------------------------------------------------

SHARDED_TRAIN = worker("dtensor_train.py")
RESUMED = re.compile(r"resumed source=(\w+) step=(\d+) world=(\d+)")


def test_a_sharded_state_resumes_from_memory_then_reshards_from_durable(tmp_path: Path) -> None:
    """``save_sharded`` of a DTensor: each rank's share goes to its arena. Rank 1 is
    SIGKILLed right after both ranks' saves of step 5 returned (a save returns once its
    copy is committed): both resume from their own shares in memory at step 5. The end's
    shares go to --checkpoint-dir, from which 3 ranks reshard: 2 rows each of the 6 that
    2 ranks saved 3 by 3."""
    ckpt, tag = tmp_path / "ckpt", str(tmp_path / "sharded-run")
    first = rallypoint(
        "run", "--nproc-per-node", "2", "--max-restarts", "1", "--checkpoint-memory", MEMORY,
        "--checkpoint-dir", str(ckpt), SHARDED_TRAIN, "10", "--kill-rank", "1", "--kill-at",
        "5", "--tag", tag, timeout=180,
    )  # fmt: skip
    out = first.stdout + first.stderr
    assert first.returncode == 0, out
    assert sorted(RESUMED.findall(out)) == [("memory", "5", "2")] * 2, out
    assert "done step=9 world=2 rows=3" in out
    for rank in (0, 1):
        shares = Checkpointer(str(ckpt / "sharded" / f"rank-{rank:05d}"), rank=rank).steps()
        assert shares[-1] == 9, out
    second = rallypoint(
        "run", "--nproc-per-node", "3", "--checkpoint-memory", MEMORY, "--checkpoint-dir",
        str(ckpt), SHARDED_TRAIN, "12", "--tag", tag, timeout=180,
    )  # fmt: skip
    out = second.stdout + second.stderr
    assert second.returncode == 0, out
    assert sorted(RESUMED.findall(out)) == [("durable", "9", "3")] * 3, out
    assert "done step=11 world=3 rows=2" in out
    assert_no_worker_left(tag)


# --- two nodes ----------------------------------------------------------------------------


class Nodes:
    """Agents of one 1:2 job on Redis, one worker each, saving every step."""

    def __init__(self, redis: RedisServer, tmp_path: Path, run_id: str) -> None:
        self.redis = redis
        self.tmp_path = tmp_path
        self.run_id = run_id
        self.ckpt = tmp_path / "ckpt"
        self.agents: dict[str, subprocess.Popen[str]] = {}
        self.dead: dict[str, subprocess.Popen[str]] = {}

    def start(self, name: str, *script: str, conf: str = CONF) -> None:
        out = self.tmp_path / f"{name}.log"
        with out.open("w") as handle:
            self.agents[name] = subprocess.Popen(
                [RALLYPOINT, "run", "--nnodes", "1:2", "--nproc-per-node", "1",
                 "--max-restarts", "3", "--rdzv-backend", "redis",
                 "--rdzv-endpoint", f"{self.redis.host}:{self.redis.port}",
                 "--rdzv-id", self.run_id, "--rdzv-conf", conf,
                 "--checkpoint-memory", MEMORY, "--checkpoint-dir", str(self.ckpt),
                 "--checkpoint-persist-every", "3", "--event-log", str(self.events(name)),
                 TRAIN, "100000", "--step-seconds", "0.1",
                 "--stop-file", str(self.tmp_path / "stop"), *script],
                env=clean_environment(), stdout=handle, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip

    def events(self, name: str) -> Path:
        return self.tmp_path / f"{name}.jsonl"

    def text(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text()

    def steps(self, name: str, world: int | None = None) -> list[int]:
        return [
            int(m[1]) for m in DONE.finditer(self.text(name)) if world is None or int(m[2]) == world
        ]

    def wait_steps(self, name: str, world: int, count: int = 1, after: int = -1) -> None:
        deadline = time.monotonic() + 90
        while len([s for s in self.steps(name, world) if s > after]) < count:
            for other, agent in self.agents.items():
                assert agent.poll() is None, f"{other} ended:\n{self.all_text()}"
            assert time.monotonic() < deadline, self.all_text()
            time.sleep(0.1)

    def rank_zero(self) -> str:
        """The agent whose node is group rank 0 (its worker saves) in the last round."""
        for name in self.agents:
            rounds = [
                e for e in read_events(self.events(name)) if e["event"] == "rendezvous_completed"
            ]
            if rounds and rounds[-1]["group_rank"] == 0:
                return name
        raise AssertionError(self.all_text())

    def kill(self, name: str) -> None:
        """SIGKILL agent ``name`` (its workers die with it); its log stays readable."""
        agent = self.agents.pop(name)
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        self.dead[name] = agent

    def all_text(self) -> str:
        return "\n".join(f"--- {n}\n{self.text(n)}" for n in [*self.agents, *self.dead])

    def stop(self) -> None:
        (self.tmp_path / "stop").touch()
        for agent in self.agents.values():
            if agent.poll() is None:
                assert agent.wait(90) == 0, self.all_text()

    def close(self) -> None:
        kill(*self.agents.values())


@pytest.fixture
def nodes(redis_server_session: RedisServer, tmp_path: Path, request: Any) -> Any:
    made = Nodes(redis_server_session, tmp_path, f"mem-{request.node.name[:40]}-{os.getpid()}")
    yield made
    made.close()  # SIGKILLs the agents that still run (a test that failed)
    assert_no_worker_left(str(tmp_path / "stop"), within=5)


def test_the_saving_node_sigkilled_resumes_from_the_peer_copy(nodes: Nodes) -> None:
    """The agent of group rank 0 (whose worker saves) is SIGKILLed with its worker: its
    memory is gone (its keeper removes it), and the survivor resumes from the copy it was
    sent, at most one step behind the newest step reached."""
    nodes.start("a")
    nodes.start("b")
    nodes.wait_steps("a", world=2, count=5)
    nodes.wait_steps("b", world=2, count=5)
    saver = nodes.rank_zero()
    survivor = "b" if saver == "a" else "a"
    memory = memory_dirs(nodes.text(saver))
    # A node that started a round alone loaded when the other joined: not counted here.
    before = len(loads(nodes.events(survivor)))
    nodes.kill(saver)
    reached = max(nodes.steps(saver) + nodes.steps(survivor))
    nodes.wait_steps(survivor, world=1)
    (loaded,) = loads(nodes.events(survivor))[before:]
    assert loaded["source"] == "peer" and reached - loaded["step"] <= 1, nodes.all_text()
    deadline = time.monotonic() + 10
    while any(os.path.exists(d) for d in memory) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(d) for d in memory), memory
    nodes.stop()


def test_a_node_that_comes_back_loads_the_round_s_step_from_a_peer(nodes: Nodes) -> None:
    """The node that does not save is SIGKILLed and started again with empty memory: in
    the scale-up round both nodes' ranks load the same step, the new one's fetched from the
    other node: before it joined, when the job saved nothing newer since (the newest
    checkpoint, fetched while it got ready), or once the round named the step."""
    nodes.start("a")
    nodes.start("b")
    nodes.wait_steps("a", world=2, count=3)
    saver = nodes.rank_zero()
    other = "b" if saver == "a" else "a"
    nodes.kill(other)
    nodes.wait_steps(saver, world=1, count=3)
    nodes.start("c")
    nodes.wait_steps("c", world=2)
    last = loads(nodes.events(saver))[-1]
    (new,) = loads(nodes.events("c"))
    assert new["step"] == last["step"] and new["source"] == "peer", nodes.all_text()
    # Which of the two fetches brought the step depends on whether the job saved between
    # c's prefetch and the round: the log names the step either way.
    step = new["step"]
    fetched = rf"fetched (the job's newest checkpoint \(step {step}\)|checkpoint of step {step} )"
    assert re.search(fetched, nodes.text("c")), nodes.all_text()
    nodes.stop()


def test_both_nodes_lost_resume_from_the_durable_copy(nodes: Nodes) -> None:
    nodes.start("a")
    nodes.start("b")
    nodes.wait_steps("a", world=2, count=8)
    for name in list(nodes.agents):
        nodes.kill(name)
    durable = durable_steps(nodes.ckpt)
    assert durable, nodes.all_text()
    time.sleep(3.5)  # their liveness lapses: the next agents start the run afresh
    # Both in the first round, which closes when the second joins: with the usual second
    # of last call, a busy machine may start one alone, whose next round loads anew.
    together = CONF.replace("last_call_timeout=1", "last_call_timeout=60")
    nodes.start("c", conf=together)
    nodes.start("d", conf=together)
    nodes.wait_steps("c", world=2)
    for name in ("c", "d"):
        (loaded,) = loads(nodes.events(name))
        assert (loaded["step"], loaded["source"]) == (durable[-1], "durable"), nodes.all_text()
    nodes.stop()


def test_the_memory_flags_reach_no_worker_without_the_tier(tmp_path: Path) -> None:
    """A memory directory inherited from the agent's environment (an agent started by a
    worker) is not the workers' tier: they get one only from their own agent's flag."""
    done = rallypoint(
        "run", "--checkpoint-dir", str(tmp_path / "ckpt"), TRAIN, "1",
        env={"RALLYPOINT_MEMORY_TIER_DIR": str(tmp_path / "nope")}, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "memory= rank=0" in done.stdout
    assert not (tmp_path / "nope").exists()


# --- the round's step, decided once ---------------------------------------------------------


def _memory(pm: Any, tmp_path: Path) -> Any:
    from rallypoint.agent.checkpoints.node_memory import NodeMemory
    from rallypoint.config import LaunchConfig

    script = tmp_path / "train.py"
    script.write_text("")
    config = LaunchConfig.from_flags(
        pm.registry, training_script=str(script), nnodes="1:2", rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0", checkpoint_memory="16MB",
    )  # fmt: skip
    return NodeMemory(config, "127.0.0.1", lambda *args, **kwargs: None)


def _save(memory: Any, step: int) -> None:
    """A worker's save into node ``memory``'s arena (local rank 0), as rank 0 makes it."""
    import torch

    from rallypoint.checkpoint.arena import Arena

    arena = Arena(memory.path, 0)
    arena.save({"w": torch.full((1000,), float(step))}, step, rank=0, world_size=2)
    arena.close()


def test_the_round_resumes_from_the_newest_step_any_member_holds(pm: Any, tmp_path: Path) -> None:
    """Two nodes disagree about the newest step (a holds 5, b only 4): both decide on 5 from
    the same round record, and b fetches it from a, checked against its manifest."""
    from rallypoint.events import RoundInfo
    from rallypoint.interfaces import Assignment

    a, b = _memory(pm, tmp_path), _memory(pm, tmp_path)
    try:
        for step in (3, 5):
            _save(a, step)
        _save(b, 4)
        offers = (a.offer(), b.offer())
        assert offers[0]["steps"] == "3 5" and offers[1]["steps"] == "4"  # both slots of a

        def assignment(rank: int) -> Assignment:
            info = RoundInfo(1, rank, 2, 2, "127.0.0.1", 1, ("a", "b"))
            return Assignment(info, (1, 1), offers)

        assert a.resume_step(assignment(0)) == 5
        assert b.resume_step(assignment(1)) == 5
        assert b.peer.complete_steps() == {5}
        loaded = Checkpointer(str(b.peer.storage.path("")), rank=0, world_size=2).load_latest()
        assert loaded is not None and loaded.step == 5 and loaded.state["w"][0] == 5.0
    finally:
        a.close("the test ends")
        b.close("the test ends")
    assert not a.path.exists() and not b.path.exists()


def test_a_step_fetched_before_joining_is_not_fetched_again_in_the_round(
    pm: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """b fetches the job's newest checkpoint (a's step 5) while it gets ready beside the
    running round; the job saves nothing newer before the round that takes b in: b holds
    the round's step already, and its one fetch is the one before joining."""
    from rallypoint.events import RoundInfo
    from rallypoint.interfaces import Assignment

    caplog.set_level(logging.INFO, "rallypoint.agent")
    a, b = _memory(pm, tmp_path), _memory(pm, tmp_path)
    try:
        _save(a, 5)
        deadline = time.monotonic() + 30
        while b.getting_ready((a.offer(),), last=True) is not None:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.01)
        offers = (a.offer(), b.offer())
        assert offers[1]["steps"] == "5"
        info = RoundInfo(2, 1, 2, 2, "127.0.0.1", 1, ("a", "b"))
        assert b.resume_step(Assignment(info, (1, 1), offers)) == 5
        fetches = [m for m in caplog.messages if m.startswith("fetched")]
        assert len(fetches) == 1 and "(step 5)" in fetches[0], caplog.text
    finally:
        a.close("the test ends")
        b.close("the test ends")


def test_a_round_record_carries_offers_only_when_there_are_some() -> None:
    from rallypoint.rendezvous import records

    bare = records.RoundRecord(0, ("a", "b"), ("h", "h"), (1, 1), "h", 1, run_id="job")
    assert b"offers" not in records.encode(bare)
    offered = records.RoundRecord(
        0, ("a", "b"), ("h", "h"), (1, 1), "h", 1, run_id="job",
        offers=({"steps": "4 5", "server": "h:1"}, {}),
    )  # fmt: skip
    key = "/rallypoint/job/0/closed"
    assert records.decode_round(key, records.encode(offered)).offers == offered.offers


def test_a_node_fetches_its_ranks_shares_from_the_member_that_holds_them(
    pm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node a's two workers saved their shares of step 5 (world size 2); in the next round
    b takes rank 1 with empty memory: both decide on 5, b fetches rank 1's share from a, and
    its worker loads it as the peer copy."""
    import torch

    from rallypoint.checkpoint.arena import Arena
    from rallypoint.events import RoundInfo
    from rallypoint.interfaces import Assignment

    a, b = _memory(pm, tmp_path), _memory(pm, tmp_path)
    try:
        for rank in (0, 1):
            arena = Arena(a.path, rank)
            state = {"w": torch.full((100,), 5.0 + rank)}
            arena.save(state, 5, rank=rank, world_size=2, format="sharded")
            arena.close()
        offers = (a.offer(), b.offer())
        assert offers[0]["shares"] == "5@2:0,1" and "shares" not in offers[1]

        def assignment(rank: int) -> Assignment:
            info = RoundInfo(1, rank, 2, 2, "127.0.0.1", 1, ("a", "b"))
            return Assignment(info, (1, 1), offers)

        assert a.resume_step(assignment(0)) == 5
        assert b.resume_step(assignment(1)) == 5
        assert b.shares() == {5: {1: 2}}
        worker = {"RALLYPOINT_MEMORY_TIER_DIR": str(b.path), "RALLYPOINT_CHECKPOINT_STEP": "5"}
        for name, value in {**worker, "RANK": "1", "WORLD_SIZE": "2"}.items():
            monkeypatch.setenv(name, value)
        target = {"w": torch.zeros(100)}
        loaded = Checkpointer().load_sharded(target)
        assert loaded is not None and (loaded.step, loaded.source) == (5, "peer")
        assert torch.equal(target["w"], torch.full((100,), 6.0))
    finally:
        a.close("the test ends")
        b.close("the test ends")

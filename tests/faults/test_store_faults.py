"""Store faults: the rendezvous store frozen (SIGSTOP) for less and for more than the
liveness TTL, killed and started again on its data, or cut off from one agent only (a TCP
proxy between that agent and the store, tests/faults/proxy.py), each while the nodes wait
to form a round and while two agents train with one gloo worker each
(tests/workers/train_until.py: an all-reduce every 0.2 s until the test says stop).

etcd and Redis are servers of their own; the c10d store lives in the first agent, so only
the proxy cut applies to it (between the store and the other agent).

What the job does (docs/user-guide.md, "The job ends"):

* a store that comes back within ``retry_timeout`` is ridden out: running workers are not
  touched, and no node is taken for dead because of the outage. Liveness keys may expire
  while nobody can renew them; a node that could not reach the store for longer than
  ``heartbeat_timeout`` takes no other node for dead until each had ``heartbeat_timeout``
  to renew, so the nodes never each decide that the other died;
* a node cut off from the store for longer than the TTL is taken for dead by the others,
  who re-form without it (``MIN`` allowing) and train on; once it reaches the store again
  it rejoins in a scale-up round;
* after a clean finish no key of the run is left in the store.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fault_setups import BACKENDS, Backend, Recovery
from proxy import Proxy

from launch import assert_no_worker_left, events, kill, wait_for_text, worker

#: heartbeat_timeout in fault_setups.CONF: liveness lapses this long after the last renewal.
TTL = 3.0
SHORT, LONG = 1.0, 6.0  # fault durations below and above the TTL
#: Bound of every wait for the job to reach a stage (agents start in about 3 s each).
WAIT = 60.0
STEP = re.compile(r"step rank=(\d+) world=(\d+) sum=\d+ at=([\d.]+)")

STORES = ("etcd", "redis")  # the backends whose store is a server of its own


class Job:
    """The agents of one test's job (run id ``job``), training with train_until.py until the
    test creates the stop file; the stop file's path makes their command lines unique."""

    def __init__(self, backend: Backend, tmp_path: Path) -> None:
        self.backend = backend
        self.tmp_path = tmp_path
        self.stop_file = tmp_path / "stop"
        self.agents: dict[str, subprocess.Popen[str]] = {}
        self.logs: dict[str, Path] = {}
        self.proxy: Proxy | None = None

    def start(self, name: str, nnodes: str, *, proxied: bool = False, nproc: int = 1) -> Path:
        """Start agent ``name``; ``proxied``: through the proxy (made on first use)."""
        endpoint = None
        if proxied:
            if self.proxy is None:
                self.proxy = Proxy(("127.0.0.1", self.backend.store_port))
            endpoint = self.proxy.endpoint
        log = self.tmp_path / f"{name}.log"
        self.agents[name] = self.backend.start_agent(
            "job", nnodes, worker("train_until.py"), str(self.stop_file),
            log=log, nproc=nproc, endpoint=endpoint,
        )  # fmt: skip
        self.logs[name] = log
        return log

    # --- what the workers printed -------------------------------------------------------

    def steps(self) -> list[tuple[str, int, float]]:
        """Every step printed so far: (agent, world size, wall time)."""
        found = []
        for name, log in self.logs.items():
            for match in STEP.finditer(log.read_text()):
                found.append((name, int(match[2]), float(match[3])))
        return sorted(found, key=lambda step: step[2])

    def wait_step(self, after: float, world: int, agent: str | None = None) -> float:
        """The wall time of the first step at ``world`` printed after ``after`` (by
        ``agent``, if given), waiting for it at most WAIT seconds."""
        deadline = time.monotonic() + WAIT
        while True:
            for name, size, at in self.steps():
                if at > after and size == world and agent in (None, name):
                    return at
            self.assert_running()
            assert time.monotonic() < deadline, f"no step at world size {world}:\n{self.text()}"
            time.sleep(0.1)

    def rounds(self, name: str) -> list[dict[str, Any]]:
        return events(self.logs[name], "rendezvous_completed")

    def wait_joined(self, name: str, count: int) -> None:
        """Until ``count`` nodes have joined round 0: the store's keys, or (c10d, whose store
        the test cannot read) agent ``name``'s progress line, printed every 5 s."""
        if self.backend.name == "c10d":
            wait_for_text(self.logs[name], f"round 0: {count} of", WAIT)
            return
        deadline = time.monotonic() + WAIT
        key = f"job/0/node/{count}"
        while not any(k.endswith(key) for k in self.backend.keys("job")):
            self.assert_running()
            assert time.monotonic() < deadline, f"{count} nodes never joined:\n{self.text()}"
            time.sleep(0.1)

    def text(self) -> str:
        return "\n".join(f"--- {n}\n{log.read_text()}" for n, log in self.logs.items())

    def assert_running(self) -> None:
        ended = {n: a.returncode for n, a in self.agents.items() if a.poll() is not None}
        assert not ended, f"agents ended early {ended}:\n{self.text()}"

    # --- the end ------------------------------------------------------------------------

    def finish(self) -> None:
        """Tell the workers to stop; every agent must exit 0, leaving no worker and (etcd,
        Redis) no key of the run in the store."""
        self.stop_file.touch()
        codes = {name: agent.wait(timeout=WAIT) for name, agent in self.agents.items()}
        assert set(codes.values()) == {0}, f"exit codes {codes}:\n{self.text()}"
        assert_no_worker_left(f"train_until.py {self.stop_file}")
        assert self.backend.keys("job") == [], "the finished run left keys in the store"
        self.assert_one_round_at_a_time()

    def assert_one_round_at_a_time(self) -> None:
        """No node completed a round after another had completed a later one: two rounds
        never ran at once (no split of the job, not even a stale round started late)."""
        completed = sorted(
            (float(e["wall_time"]), int(e["round"]), name)
            for name in self.logs
            for e in self.rounds(name)
        )
        rounds = [round_ for _, round_, _ in completed]
        assert rounds == sorted(rounds), f"rounds completed out of order {completed}"

    def close(self) -> None:
        """Kill what still runs (a failed test); its workers die with their agents."""
        kill(*self.agents.values())
        if self.proxy is not None:
            self.proxy.close()
        tag = f"train_until.py {self.stop_file}"
        deadline = time.monotonic() + 10  # SIGKILLed agents' workers get PDEATHSIG
        while workers_running(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert_no_worker_left(tag)

    def assert_no_restart(self, phase: str, fault: float) -> None:
        """rendezvous: every agent completed one round, round 0. training: no agent completed
        a round or restarted its workers after the ``fault`` began (wall time)."""
        for name, log in self.logs.items():
            if phase == "rendezvous":
                assert [r["round"] for r in self.rounds(name)] == [0], self.text()
                continue
            later = [e for e in events(log, "rendezvous_completed") if e["wall_time"] > fault]
            later += [e for e in events(log, "workers_restarted") if e["wall_time"] > fault]
            assert later == [], self.text()


def workers_running(tag: str) -> bool:
    found = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True, timeout=10)
    return bool(found.stdout.strip())


@pytest.fixture
def job(backend: Backend, tmp_path: Path) -> Iterator[Job]:
    made = Job(backend, tmp_path)
    try:
        yield made
    finally:
        made.close()


def fault(
    name: str,
    *,
    rendezvous: str,
    training: str,
    backends: tuple[str, ...],
    quick: dict[str, str],
) -> pytest.MarkDecorator:
    """The cases of one fault: each phase (its own row of docs/reliability.md) on each of
    ``backends``. ``quick`` names, for each phase, the backend that ``make test`` runs; the
    other cases are ``soak`` (``make soak``), so that the default run stays short."""
    cases = []
    for phase, expected in (("rendezvous", rendezvous), ("training", training)):
        for backend in backends:
            marks = [pytest.mark.fault(f"{name}, during {phase}", expected=expected)]
            if quick[phase] != backend:
                marks.append(pytest.mark.soak)
            cases.append(pytest.param(backend, phase, marks=marks, id=f"{backend}-{phase}"))
    return pytest.mark.parametrize(("backend", "phase"), cases, indirect=["backend"])


# --- the whole store down ----------------------------------------------------------------


def store_outage(
    job: Job, phase: str, recovery: Recovery, down: Callable[[], None], up: Callable[[], None]
) -> None:
    """``down()``, ``up()`` (which returns when the store answers again) and the checks of
    a fault that the job must ride out without restarting anything.

    rendezvous: a ``2`` job whose first node waits in round 0 when the store goes down;
    the second starts once it is back, and the round forms. Recovery: from the store's
    return to the round complete (the second agent's start-up included).

    training: both train at world size 2, and go on through the outage. Recovery: from the
    store's return to the next step (the workers never stopped).
    """
    job.start("a", "2")
    if phase == "rendezvous":
        job.wait_joined("a", 1)
        began = time.time()
        down()
        up()
        back = time.time()
        recovery.notes.append(f"the store was down {back - began:.1f} s")
        job.start("b", "2")
        job.wait_step(back, world=2)
        (formed,) = job.rounds("a")
        recovery.seconds = float(formed["wall_time"]) - back
        started = events(job.logs["b"], "agent_started")[0]["wall_time"]
        recovery.notes.append(f"includes the second agent's start-up, {started - back:.1f} s")
    else:
        job.start("b", "2")
        job.wait_step(0, world=2)
        began = time.time()
        down()
        up()
        back = time.time()
        recovery.seconds = job.wait_step(back, world=2) - back
        recovery.notes.append(f"the store was down {back - began:.1f} s")
        if back - began > 0.5:  # training went on meanwhile: steps while it was down
            assert [at for _, _, at in job.steps() if began < at < back], job.text()
        # Past a TTL after the store's return: nobody was taken for dead.
        job.wait_step(back + TTL + 1, world=2)
    job.finish()
    job.assert_no_restart(phase, began)


@fault(
    "Store frozen 1 s (shorter than the TTL)",
    rendezvous="the waiting node carries on; the round forms when the second node comes",
    training="training goes on through it; nothing restarts",
    backends=STORES,
    quick={"rendezvous": "etcd", "training": "redis"},
)
def test_store_frozen_shorter_than_the_ttl(
    job: Job, backend: Backend, phase: str, recovery: Recovery
) -> None:
    store_outage(job, phase, recovery, backend.freeze, lambda: thaw_after(backend, SHORT))


@fault(
    "Store frozen 6 s (longer than the TTL)",
    rendezvous=(
        "liveness keys lapse meanwhile, but no node is taken for dead: the round forms "
        "when the second node comes; nothing restarts"
    ),
    training=(
        "liveness keys lapse meanwhile, but no node is taken for dead (each waits a TTL "
        "for the others to renew): training goes on; nothing restarts"
    ),
    backends=STORES,
    quick={"rendezvous": "redis", "training": "etcd"},
)
def test_store_frozen_longer_than_the_ttl(
    job: Job, backend: Backend, phase: str, recovery: Recovery
) -> None:
    store_outage(job, phase, recovery, backend.freeze, lambda: thaw_after(backend, LONG))


@fault(
    "Store killed and restarted (etcd on its data dir, Redis with appendonly)",
    rendezvous="the waiting node carries on; the round forms when the second node comes",
    training="training goes on through it; the agents reconnect; nothing restarts",
    backends=STORES,
    quick={"rendezvous": "etcd", "training": "redis"},
)
def test_store_killed_and_restarted(
    job: Job, backend: Backend, phase: str, recovery: Recovery
) -> None:
    store_outage(job, phase, recovery, backend.kill_store, backend.start_store)
    assert "rendezvous store reachable again" in job.text(), "the restart went unnoticed"


def thaw_after(backend: Backend, seconds: float) -> None:
    time.sleep(seconds)  # the outage itself: how long the store is frozen
    backend.thaw()


# --- the store cut off from one agent ----------------------------------------------------


@fault(
    "Store cut off from one agent for 6 s (longer than the TTL)",
    rendezvous=(
        "the other node forms a round without it (MIN 1) and trains; once back, the cut "
        "node joins in a scale-up round"
    ),
    training=(
        "the other node re-forms without it (MIN 1) and trains on; once back, the cut "
        "node's workers (their peers gone) restart and it rejoins in a scale-up round"
    ),
    backends=BACKENDS,
    quick={"rendezvous": "etcd", "training": "redis"},
)
def test_store_cut_off_from_one_agent_longer_than_the_ttl(
    job: Job, backend: Backend, phase: str, recovery: Recovery
) -> None:
    """A ``1:2`` job; ``b`` reaches the store through the proxy, ``a`` directly (on c10d,
    ``a`` hosts the store).

    rendezvous: on etcd and Redis, ``b`` leads round 0 and is cut off; ``a`` comes, finds
    the leader dead and forms a round alone. On c10d (``a`` leads, hosting the store) ``b``
    starts while cut off. Training: both train, then ``b`` is cut off.
    Recovery: from the cut to ``a`` training alone; the cut lasts until then (at least
    the TTL), and ``b`` must then come back.
    """
    if phase == "rendezvous":
        if backend.name == "c10d":
            job.start("a", "1:2")
            assert job.proxy is None
            job.proxy = Proxy(("127.0.0.1", backend.store_port))
            job.proxy.cut()
            cut = time.time()
            job.start("b", "1:2", proxied=True)
        else:
            job.start("b", "1:2", proxied=True)
            job.wait_joined("b", 1)
            assert job.proxy is not None
            job.proxy.cut()
            cut = time.time()
            job.start("a", "1:2")
    else:
        job.start("a", "1:2")
        job.start("b", "1:2", proxied=True)
        job.wait_step(0, world=2)
        assert job.proxy is not None
        job.proxy.cut()
        cut = time.time()
    alone = job.wait_step(cut, world=1, agent="a")
    recovery.seconds = alone - cut
    time.sleep(max(0.0, cut + LONG - time.time()))  # the cut lasts LONG at least
    job.proxy.restore()
    restored = time.time()
    together = job.wait_step(restored, world=2)
    recovery.notes.append(f"the cut node trained again {together - restored:.1f} s after")
    job.finish()
    assert all(r["group_world_size"] == 2 for r in job.rounds("b")), job.text()
    assert job.rounds("a")[-1]["group_world_size"] == 2, job.text()


@fault(
    "Store cut off from one agent for 1 s (shorter than the TTL)",
    rendezvous="the cut node carries on; the round forms with every node; nothing restarts",
    training="training goes on through it; nothing restarts",
    backends=BACKENDS,
    quick={"rendezvous": "redis", "training": "etcd"},
)
def test_store_cut_off_from_one_agent_shorter_than_the_ttl(
    job: Job, backend: Backend, phase: str, recovery: Recovery
) -> None:
    """rendezvous: ``b`` (through the proxy) waits in round 0 of a ``2`` job (on c10d, a
    ``3`` job with one worker per node: ``a``, hosting the store, waits with it), is cut
    off for 1 s, then the last node starts. Training: a ``1:2`` job trains at world size
    2, ``b`` is cut off for 1 s. Recovery: from the restore to the round complete, or to
    the next step.
    """
    if phase == "rendezvous":
        if backend.name == "c10d":
            nodes, nproc, world = "3", 1, 3
            job.start("a", nodes, nproc=nproc)
            job.start("b", nodes, proxied=True, nproc=nproc)
            job.wait_joined("a", 2)
        else:
            nodes, nproc, world = "2", 1, 2
            job.start("b", nodes, proxied=True)
            job.wait_joined("b", 1)
        assert job.proxy is not None
        cut = time.time()
        job.proxy.cut()
        time.sleep(SHORT)  # the cut itself
        job.proxy.restore()
        restored = time.time()
        last = "c" if backend.name == "c10d" else "a"
        job.start(last, nodes, nproc=nproc)
        job.wait_step(restored, world=world)
        formed = job.rounds("b")[0]["wall_time"]
        recovery.seconds = float(formed) - restored
        started = events(job.logs[last], "agent_started")[0]["wall_time"]
        recovery.notes.append(f"includes the last agent's start-up, {started - restored:.1f} s")
    else:
        job.start("a", "1:2")
        job.start("b", "1:2", proxied=True)
        job.wait_step(0, world=2)
        assert job.proxy is not None
        cut = time.time()
        job.proxy.cut()
        time.sleep(SHORT)  # the cut itself
        job.proxy.restore()
        restored = time.time()
        recovery.seconds = job.wait_step(restored, world=2) - restored
        assert [at for _, _, at in job.steps() if cut < at < restored], job.text()
        # Past the TTL after the cut: nobody was taken for dead.
        job.wait_step(cut + TTL + 1, world=2)
    job.finish()
    job.assert_no_restart(phase, cut)


@pytest.mark.parametrize(
    "backend", ["etcd", pytest.param("redis", marks=pytest.mark.soak)], indirect=True
)
def test_cut_off_leader_joins_the_run_started_afresh(job: Job, backend: Backend) -> None:
    """``b`` leads round 0 of a ``1:2`` job and is cut off; ``a`` starts only once ``b``'s
    liveness lapsed, finds no agent of the run alive, starts it afresh (the run's next
    generation, its old keys deleted) and trains alone. Once back, ``b`` must notice that
    its generation is gone and join the new one (a scale-up round), not wait out
    join_timeout in the old one."""
    job.start("b", "1:2", proxied=True)
    job.wait_joined("b", 1)
    assert job.proxy is not None
    job.proxy.cut()
    cut = time.time()
    time.sleep(TTL + 1.5)  # b's liveness lapses
    job.start("a", "1:2")
    job.wait_step(cut, world=1, agent="a")
    assert "starting it afresh" in job.logs["a"].read_text(), job.text()
    job.proxy.restore()
    job.wait_step(time.time(), world=2)
    assert "joining it as a new node" in job.logs["b"].read_text(), job.text()
    job.finish()

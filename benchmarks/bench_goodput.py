"""Goodput under failures, rallypoint against torchrun: SIGKILLs and a preemption notice.

The steps a job keeps in a fixed wall time under a schedule of failures, against the same
job without failures, under rallypoint and torchrun side by side in one run. The schedule
(``schedule``): every ``--node-every`` s (60) the second node, by turns SIGKILLed (the
machine lost) and told to stop with SIGTERM to its agent alone (a preemption notice, as
Kubernetes or Slurm gives it: rallypoint's job saves on notice, torchrun's agent forwards
it to its workers), each time started again at once (a join); every ``--worker-every`` s
(30) a worker SIGKILLed, but not within ``QUIET`` s of a node's event. A default 180 s run:
a worker at 30 s, the node SIGKILLed at 60 s, a worker at 90 s, the node SIGTERMed at
120 s, a worker at 150 s. docs/benchmarks-goodput.md says how.

    .venv/bin/python benchmarks/bench_goodput.py [--seconds 180]
    .venv/bin/python benchmarks/bench_goodput.py --seconds 70 --node-every 30 --worker-every 0
                                                                    # a short try, both kinds
    .venv/bin/python benchmarks/bench_goodput.py --render-only
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common
from common import BIN, HOST, ROOT

TRAIN = ROOT / "benchmarks" / "goodput_train.py"
LAUNCHERS = tuple(common.LAUNCHERS)
#: rallypoint's goodput at its own pace under the schedule (a node's SIGKILL and a SIGTERM,
#: each with a join, and the workers' SIGKILLs), warm start and memory checkpoints.
TARGET = 0.97
OPTIONS = {
    "seconds": (180.0, "wall time of each run, from the job's first step"),
    "worker_every": (30.0, "seconds between SIGKILLs of one worker (0: none)"),
    "node_every": (
        60.0,
        "seconds between events of the second node, SIGKILL and SIGTERM by turns, each "
        "followed by its start again at once (0: none)",
    ),
    "step_seconds": (0.3, "length of a training step"),
    "save_every": (1, "the script saves every N steps (and on notice under rallypoint)"),
    # Elastic, as jobs whose nodes come and go run: a survivor trains on alone while a
    # replacement gets ready (with a fixed size it waits for the replacement's start-up).
    "nnodes": ("1:2", "--nnodes of both launchers"),
    "memory": ("64MB", "rallypoint's --checkpoint-memory"),
    "preload": ("", "rallypoint's --preload (empty: none; torch._dynamo comes by itself)"),
    "hang_at": (
        0.0,
        "seconds from the first step when a worker of the second node hangs (0: never)",
    ),
    "keep": ("", "keep every run's logs and event logs under this directory"),
    "only": (("", *LAUNCHERS), "run one launcher only (for trying things out)"),
}
NODES = 2
NPROC = 2  # workers per node
#: rallypoint on Redis, a store of its own (the job survives the loss of any node, and the
#: agent needs no torch to start); torchrun on c10d, hosted by the first node's agent.
BACKEND = {"rallypoint": "redis", "torchrun": "c10d"}
#: Both declare a node dead 3 s after its last heartbeat (as bench_recovery.py).
RDZV_CONF = {
    "rallypoint": "heartbeat_timeout=3,last_call_timeout=1",
    "torchrun": "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
}
#: Without it torch 2.13 never scales the job from one node to two (benchmarks-recovery.md).
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass(frozen=True)
class Launch:
    """One launcher as the job runs under it: the row's name, the launcher (its command in
    ``common.LAUNCHERS``), its rendezvous, how the script saves (``train_checkpoint.py``),
    and what else it needs: its environment, each node's own (a node rank), and a process
    started first that serves the run on its port (DLRover's job master)."""

    name: str
    launcher: str
    backend: str
    rdzv_conf: str
    checkpoint: str = "rallypoint"
    env: Mapping[str, str] = field(default_factory=dict)
    node_env: Callable[[int, int], dict[str, str]] | None = None
    helper: Callable[[int, str, Path], subprocess.Popen[bytes]] | None = None


LAUNCHES = {
    name: Launch(name, name, BACKEND[name], RDZV_CONF[name],
                 env=TORCHRUN_ENV if name == "torchrun" else {})
    for name in LAUNCHERS
}  # fmt: skip
STORE_WAIT = 60.0  # seconds for the first agent (or redis-server) to open the store's port
TARGET_WAIT = 30.0  # seconds a kill waits for its worker to be running
START_CAP = 180.0  # seconds from the start for the job's first step
CLEANUP_WAIT = 30.0  # seconds for killed processes to disappear
#: Seconds an agent sent SIGTERM is given to exit by itself (its workers save on notice,
#: then stop; rallypoint's --shutdown-timeout, 30 s by default, bounds each of its waits)
#: before what is left of it is SIGKILLed.
TERM_WAIT = 60.0
QUIET = 10.0  # no worker is SIGKILLed within this many seconds of a node's event
STALL = 3.0  # a gap between two steps over this many median steps is a stall
DONE = re.compile(r"done step=(\d+) world=(\d+) at=([\d.]+)")
#: A load (every rank of a job; a healed group under torchft): the earliest step counts.
RESUMED = re.compile(r"resumed step=(\d+) world=\d+ rank=\d+ at=([\d.]+)")
START = re.compile(r"start tag=(\S+) rank=(\d+) local=(\d+) world=\d+ pid=(\d+) at=([\d.]+)")
HANGING = re.compile(r"hanging rank=\d+ step=(-?\d+) at=([\d.]+)")


# --- the schedule -------------------------------------------------------------------------


def schedule(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The failures of a run, by seconds from its first step. At every multiple of
    ``node_every`` an event of the second node (the first hosts torchrun's c10d store, which
    its job cannot lose), by turns a SIGKILL (the first, the third, ...) and a SIGTERM to its
    agent alone (a preemption notice), each followed by the node's start again at once (a
    join). At every multiple of ``worker_every`` not within ``QUIET`` s of a node's event,
    a worker's SIGKILL; the k-th takes local rank ``k // 2 % 2`` of node ``k % 2``."""

    def multiples(every: float) -> list[float]:
        found, at = [], every
        while every > 0 and at < args.seconds - 1e-6:
            found.append(round(at, 3))
            at += every
        return found

    nodes = multiples(args.node_every)
    events: list[dict[str, Any]] = [
        {"at": at, "kind": "node", "node": 1, "signal": "SIGTERM" if k % 2 else "SIGKILL"}
        for k, at in enumerate(nodes)
    ]
    if args.hang_at:
        events.append({"at": args.hang_at, "kind": "hang", "node": 1})
        nodes.append(args.hang_at)
    workers = [a for a in multiples(args.worker_every) if all(abs(a - n) >= QUIET for n in nodes)]
    for k, at in enumerate(workers):
        events.append({"at": at, "kind": "worker", "node": k % 2, "local": k // 2 % 2,
                       "signal": "SIGKILL"})  # fmt: skip
    return sorted(events, key=lambda event: float(event["at"]))


# --- processes ----------------------------------------------------------------------------


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (by parent pid, whatever their sessions)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int, marker: str) -> bool:
    """Whether ``pid`` runs (not a zombie) with ``marker`` on its command line."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return state != "Z" and marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


@dataclass
class Agent:
    """One start of one node's agent: its process, output and event log."""

    process: subprocess.Popen[bytes]
    log: Path
    events: Path | None
    started: float
    killed: float | None = None
    terminated: float | None = None  # when it was sent SIGTERM
    exit_code: int | None = None


@dataclass
class Node:
    """One node of the job: the same command every time it is started."""

    index: int
    tag: str
    command: list[str]
    env: dict[str, str]
    workdir: Path
    event_log: bool
    agents: list[Agent] = field(default_factory=list)

    def start(self) -> Agent:
        generation = len(self.agents)
        log = self.workdir / f"node{self.index}-{generation}.log"
        events = self.workdir / f"node{self.index}-{generation}.jsonl"
        command = [arg.replace("EVENT_LOG", str(events)) for arg in self.command]
        with log.open("wb") as out:
            process = subprocess.Popen(
                command, env=common.clean_env(self.env), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        agent = Agent(process, log, events if self.event_log else None, time.time())
        self.agents.append(agent)
        return agent

    @property
    def current(self) -> Agent:
        return self.agents[-1]

    def worker(self, local: int) -> int | None:
        """The pid of this node's running worker of local rank ``local``, if there is one."""
        found = [int(m[3]) for m in START.findall(text(self.current.log)) if int(m[2]) == local]
        return found[-1] if found and alive(found[-1], self.tag) else None

    def kill(self) -> float:
        """The machine lost: its agent and every process below it or carrying its tag
        stopped at once (SIGSTOP: none of them can react to the others' death), then
        SIGKILLed; when."""
        agent = self.current
        pids = [agent.process.pid, *descendants(agent.process.pid), *common.matching(self.tag)]
        pids = list(dict.fromkeys(pids))
        signal_all(pids, signal.SIGSTOP)
        killed = time.time()
        signal_all(pids, signal.SIGKILL)
        agent.killed = killed
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.exit_code = agent.process.wait(timeout=CLEANUP_WAIT)
        common.kill_tagged(self.tag, CLEANUP_WAIT)  # anything re-parented meanwhile
        return killed

    def terminate(self) -> tuple[Agent, float, list[int]]:
        """A preemption notice: SIGTERM to the agent alone, as Kubernetes or Slurm sends it
        (the agent forwards it to its workers); the agent, when, and the processes below it
        then."""
        agent = self.current
        pids = [agent.process.pid, *descendants(agent.process.pid)]
        agent.terminated = time.time()
        with contextlib.suppress(ProcessLookupError):
            agent.process.send_signal(signal.SIGTERM)
        return agent, agent.terminated, pids

    def reap(self, agent: Agent, pids: list[int], wait: float) -> dict[str, Any]:
        """Wait up to ``wait`` s for ``agent``, sent SIGTERM, to exit by itself; then SIGKILL
        what is left of it (``pids``, the processes below it at the SIGTERM, and those
        below it now), not by its tag: the node's new agent carries it too. Its exit code,
        the seconds from the SIGTERM to its exit, and how many processes were left."""
        assert agent.terminated is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.exit_code = agent.process.wait(timeout=wait)
        exited = time.time() if agent.exit_code is not None else None
        if agent.exit_code is None:
            pids = [*pids, *descendants(agent.process.pid)]
        left = [pid for pid in dict.fromkeys(pids) if alive(pid, "")]
        signal_all(left, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.exit_code = agent.process.wait(timeout=CLEANUP_WAIT)
        return {
            "exit_code": agent.exit_code,
            "exit_seconds": None if exited is None else exited - agent.terminated,
            "left": len(left),
        }

    def stop(self) -> None:
        for agent in self.agents:
            if agent.process.poll() is None:
                pids = [agent.process.pid, *descendants(agent.process.pid)]
                signal_all(pids, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = agent.process.wait(timeout=CLEANUP_WAIT)
                agent.exit_code = code if agent.exit_code is None else agent.exit_code


SAMPLE_EVERY = 2.0  # seconds between two samples of the launcher's memory


class MemorySampler:
    """The memory of one node's launcher while the run goes: every ``SAMPLE_EVERY`` s, the
    PSS (a page shared by n processes counted 1/n in each) of its current agent and every
    process below it but the workers and theirs (rallypoint's preloaded interpreter and
    memory keeper, ft_launcher's rank monitors count), and of the helper (DLRover's job
    master, one per job) apart; their median and peak, MB."""

    def __init__(self, node: Node, helper: subprocess.Popen[bytes] | None) -> None:
        self.node, self.helper = node, helper
        self.agent: list[float] = []
        self.helper_mb: list[float] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def sample(self) -> None:
        while not self.stopped.wait(SAMPLE_EVERY):
            if not self.node.agents or self.node.current.process.poll() is not None:
                continue
            root = self.node.current.process.pid
            workers = {pid for pid in descendants(root) if is_worker(pid)}
            below_workers = {d for pid in workers for d in descendants(pid)}
            mine = [root, *(p for p in descendants(root) if p not in workers | below_workers)]
            self.agent.append(sum(pss_kb(pid) for pid in mine) / 1024)
            if self.helper is not None and self.helper.poll() is None:
                self.helper_mb.append(pss_kb(self.helper.pid) / 1024)

    def stop(self) -> dict[str, Any]:
        self.stopped.set()
        self.thread.join(timeout=CLEANUP_WAIT)

        def summary(values: list[float]) -> dict[str, Any] | None:
            if not values:
                return None
            return {"median_mb": statistics.median(values), "peak_mb": max(values),
                    "samples": len(values)}  # fmt: skip

        return {"agent": summary(self.agent), "helper": summary(self.helper_mb)}


def is_worker(pid: int) -> bool:
    """Whether ``pid`` runs the training script: its first argument but the interpreter's
    flags names it (a launcher's processes carry the script further on their lines)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    first = next((a for a in argv[1:] if a and not a.startswith(b"-")), b"")
    return first.endswith(TRAIN.name.encode())


def pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            return next((int(line.split()[1]) for line in rollup if line.startswith("Pss:")), 0)
    except OSError:
        return 0


def text(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:
        return ""


# --- one run ------------------------------------------------------------------------------


def commands(
    launch: Launch, args: argparse.Namespace, port: int, run_id: str, workdir: Path
) -> list[str]:
    # ``port``: the store's, redis-server's for rallypoint on Redis, else the first agent's
    # (or the helper's)
    """The agent command of ``launch``, ``TAG`` for the node's tag, ``EVENT_LOG`` for
    the file of its event log."""
    rendezvous = [
        "--nnodes", args.nnodes, "--nproc-per-node", str(NPROC), "--max-restarts", "100",
        "--rdzv-backend", launch.backend, "--rdzv-endpoint", f"{HOST}:{port}",
        "--rdzv-id", run_id, "--rdzv-conf", launch.rdzv_conf,
    ]  # fmt: skip
    ckpt = str(workdir / "checkpoints")
    script = [str(TRAIN), "--step-seconds", str(args.step_seconds),
              "--save-every", str(args.save_every), "--tag", "TAG",
              "--checkpoint", launch.checkpoint, "--checkpoint-dir", ckpt]  # fmt: skip
    script += ["--hang-file", str(workdir / "hang-TAG")] if args.hang_at else []
    if launch.launcher == "torchft":  # a replica group per worker, under torchrun each
        groups = [
            "--groups", str(NPROC), "--num-groups", str(NPROC * NODES), "--max-restarts", "100",
        ]  # fmt: skip
        return [*common.LAUNCHERS["torchft"], *groups, *script]
    features = []
    if launch.launcher == "rallypoint":  # warm start is on by default
        features = ["--event-log", "EVENT_LOG"]
        if launch.checkpoint == "rallypoint":
            features += ["--checkpoint-memory", args.memory, "--checkpoint-dir", ckpt]
        features += ["--preload", args.preload] if args.preload else []
    return [*common.LAUNCHERS[launch.launcher], *rendezvous, *features, *script]


def run_once(
    launch: Launch, faults: bool, args: argparse.Namespace, scratch: Path, redis: int
) -> dict[str, Any]:
    """One run: two nodes of two workers each, started one after the other, trained for
    ``args.seconds`` from their first step, with the failures of ``schedule`` or none;
    then everything killed."""
    launcher = launch.name
    unique = uuid.uuid4().hex[:10]
    run_id, base = f"bench-goodput-{unique}", f"rpgoodput-{unique}"
    workdir = scratch / f"{launcher.replace(' ', '_')}-{'faults' if faults else 'clean'}-{unique}"
    workdir.mkdir()
    ckpt = str(workdir / "checkpoints")
    port = redis if launch.backend == "redis" else common.free_port()
    template = commands(launch, args, port, run_id, workdir)
    env = dict(launch.env)
    if launch.checkpoint == "rallypoint" and launch.launcher != "rallypoint":
        env["RALLYPOINT_CHECKPOINT_URL"] = ckpt  # rallypoint.checkpoint's durable directory
    nodes = [
        Node(i, f"{base}-n{i}", [a.replace("TAG", f"{base}-n{i}") for a in template],
             {**env, **(launch.node_env(port, i) if launch.node_env else {})},
             workdir, launch.launcher == "rallypoint")
        for i in range(NODES)
    ]  # fmt: skip
    kills: list[dict[str, Any]] = []
    reapers: list[threading.Thread] = []
    error = None
    helper = launch.helper(port, run_id, workdir) if launch.helper else None
    began = time.time()
    trained = deadline = began + args.seconds  # until the job's first step says otherwise
    sampler = MemorySampler(nodes[0], helper)
    try:
        nodes[0].start()
        sampler.start()
        # torchrun's first agent hosts the c10d store: the second starts once it listens
        # (rallypoint's store, redis-server, is up already).
        while not common.port_open(port) and nodes[0].current.process.poll() is None:
            if time.time() > began + STORE_WAIT:
                break
            time.sleep(0.05)
        if not common.port_open(port):
            raise Failed(f"the first agent did not open the store on port {port}")
        nodes[1].start()
        # The wall time runs from the job's first step: start-up varies by seconds from
        # run to run here, as much as a failure costs (bench_launcher.py measures it).
        trained = first_step(nodes, began + START_CAP)
        deadline = trained + args.seconds
        for planned in schedule(args) if faults else []:
            time.sleep(max(0.0, trained + planned["at"] - time.time()))
            if time.time() >= deadline:
                break
            kills.append(kill(nodes, planned, trained, deadline, reapers))
            print(f"  {launcher} t={kills[-1].get('at', 0):.1f} s {show_kill(kills[-1])}",
                  flush=True)  # fmt: skip
        time.sleep(max(0.0, deadline - time.time()))
    except Failed as failed:
        error = str(failed)
    finally:
        ended = time.time()
        memory = sampler.stop()
        for reaper in reapers:
            reaper.join(timeout=TERM_WAIT + 2 * CLEANUP_WAIT)
        # Whether an agent gave up before the deadline (torchrun's, say): its exit code.
        exits = [[exit_of(a) for a in node.agents] for node in nodes]
        for node in nodes:
            node.stop()
        if helper is not None:
            helper.kill()
            helper.wait(CLEANUP_WAIT)
        leftovers = common.kill_tagged(base, CLEANUP_WAIT)
        for path in [
            *Path("/dev/shm").glob(f"rallypoint-{run_id}-*"),
            *Path(tempfile.gettempdir()).glob(f"rallypoint-{run_id}-*"),
            *(p.parent for p in Path(tempfile.gettempdir()).glob(f"torchelastic_*/{run_id}_*")),
        ]:
            shutil.rmtree(path, ignore_errors=True)
    logs = "".join(text(a.log) for node in nodes for a in node.agents)
    result = progress(logs, trained, deadline, args.seconds)
    happened = [done for done in kills if "at" in done]
    bounds = [trained + done["at"] for done in happened] + [deadline]
    for index, done in enumerate(happened):
        done.update(after_kill(logs, bounds[index], bounds[index + 1]))
        if "started_again" in done:  # the node's new agent: when its workers joined
            new = text(nodes[done["node"]].agents[done.pop("agent")].log)
            done["seconds_to_rejoin"] = rejoined(logs, new, trained + done["started_again"],
                                                 bounds[index + 1])  # fmt: skip
    result.update(
        launcher=launcher, faults=faults, seconds=args.seconds, error=error, kills=kills,
        startup_seconds=trained - began if error is None else None,
        starts=[[a.started - trained for a in node.agents] for node in nodes],
        exits=exits,
        leftovers=leftovers, overrun_seconds=ended - deadline,
        command=shown(nodes[0].command, nodes[0].env, ckpt),
        agent_memory=memory, checkpoint=launch.checkpoint,
    )  # fmt: skip
    if launch.launcher == "rallypoint":
        result["account"] = accounted(nodes, trained, deadline)
    if not result["steps"]:
        result["log_tail"] = "\n".join(logs.splitlines()[-40:])
    if args.keep:
        shutil.copytree(
            workdir, Path(args.keep) / workdir.name, ignore=shutil.ignore_patterns("checkpoints")
        )
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def exit_of(agent: Agent) -> int | str | None:
    """How an agent ended: ``killed`` (SIGKILLed), ``terminated`` (sent SIGTERM: its exit is
    in the schedule's record), or its exit code (None: still running)."""
    if agent.killed is not None:
        return "killed"
    return "terminated" if agent.terminated is not None else agent.process.poll()


def first_step(nodes: list[Node], until: float) -> float:
    """When the job did its first step (the worker's clock)."""
    while time.time() < until:
        for agent in (a for node in nodes for a in node.agents):
            if found := DONE.search(text(agent.log)):
                return float(found[3])
        if all(a.process.poll() is not None for node in nodes for a in node.agents):
            raise Failed("every agent exited before the first step")
        time.sleep(0.1)
    raise Failed(f"no step within {START_CAP:.0f} s of the start")


class Failed(Exception):
    """A run that could not be measured, in a sentence."""


def kill(
    nodes: list[Node],
    planned: dict[str, Any],
    began: float,
    deadline: float,
    reapers: list[threading.Thread],
) -> dict[str, Any]:
    """Do one failure of the schedule; what was done, and when (seconds from ``began``);
    the wait for an agent sent SIGTERM goes on in a thread added to ``reapers``."""
    node = nodes[planned["node"]]
    done = dict(planned)
    done["ranks"] = ranks_of(node)
    if planned["kind"] == "node" and planned.get("signal") == "SIGTERM":
        agent, at, pids = node.terminate()
        done["at"] = at - began
        # another process: the new machine starts while the old one stops
        done["started_again"] = node.start().started - began
        done["agent"] = len(node.agents) - 1
        # Waited for aside: an agent that lingers must not hold up the schedule.
        reaper = threading.Thread(
            target=lambda: done.update(node.reap(agent, pids, TERM_WAIT)), daemon=True
        )
        reaper.start()
        reapers.append(reaper)
        return done
    if planned["kind"] == "node":
        done["at"] = node.kill() - began
        done["started_again"] = node.start().started - began
        done["agent"] = len(node.agents) - 1
        return done
    if planned["kind"] == "hang":  # its local rank 0 takes the file at its next step's end
        (node.workdir / f"hang-{node.tag}").touch()
        done["at"] = time.time() - began
        return done
    wait_until = min(deadline, time.time() + TARGET_WAIT)
    while (pid := node.worker(planned["local"])) is None and time.time() < wait_until:
        time.sleep(0.05)
    if pid is None:
        done["skipped"] = "no such worker running"
        return done
    done["rank"] = next((r for r, p in done["ranks"].items() if p == pid), None)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    done["at"] = time.time() - began
    return done


def ranks_of(node: Node) -> dict[int, int]:
    """The global ranks of this node's newest workers, and their pids."""
    latest = {int(m[2]): (int(m[1]), int(m[3])) for m in START.findall(text(node.current.log))}
    return dict(latest.values())


def show_kill(done: dict[str, Any]) -> str:
    if done.get("skipped"):
        return f"{done['kind']} kill skipped: {done['skipped']}"
    kind = done.get("signal", "SIGKILL")
    if done["kind"] == "hang":
        return f"a worker of node {done['node']} told to hang"
    if done["kind"] == "node":
        shown = f"{kind} node {done['node']} (ranks {sorted(done['ranks'])}), started again"
        if kind == "SIGTERM" and "left" in done:  # reaped by now
            shown += f"; {agent_exit(done)}"
        return shown
    return f"{kind} worker rank {done.get('rank')} (node {done['node']})"


def agent_exit(done: dict[str, Any]) -> str:
    """What became of the agent sent SIGTERM, in words."""
    if done.get("exit_seconds") is None:
        words = f"its agent had not exited {TERM_WAIT:.0f} s after the SIGTERM"
    else:
        words = f"its agent exited ({done['exit_code']}) {done['exit_seconds']:.1f} s after it"
    if done.get("left"):
        words += f", {done['left']} of its processes SIGKILLed then"
    return words


def shown(command: list[str], env: dict[str, str], ckpt: str) -> str:
    """A command as the page shows it: paths relative, the run's ids as placeholders."""
    line = " ".join([*(f"{k}={v}" for k, v in env.items()), *command])
    line = line.replace(ckpt, "DIR").replace(str(Path(ckpt).parent), "WORKDIR")
    line = line.replace(str(BIN) + "/", ".venv/bin/").replace(str(ROOT) + "/", "")
    line = re.sub(r"rpgoodput-\w+-n0", "TAG", line)
    line = re.sub(r"bench-goodput-\w+", "RUN_ID", line)
    line = re.sub(rf"{HOST}:\d+", f"{HOST}:PORT", line)
    return line.replace("EVENT_LOG", "FILE")


def progress(logs: str, began: float, deadline: float, seconds: float) -> dict[str, Any]:
    """The steps kept by ``deadline`` (the newest step done, plus one: steps redone after a
    restart do not count twice), and by each second of the run; and the run's own pace:
    its mean step time but for the stalls (a gap over ``STALL`` times the median step),
    the steps it would have kept at that pace, and the stalls (start, seconds)."""
    done = sorted((float(at), int(step)) for step, _, at in DONE.findall(logs))
    # One line a step: under torchft every group says it did the step
    done = [d for i, d in enumerate(done) if i == 0 or d[1] != done[i - 1][1]]
    kept = [(at - began, step + 1) for at, step in done if at <= deadline]
    by_second, reached, index = [], 0, 0
    for second in range(int(seconds) + 1):
        while index < len(kept) and kept[index][0] <= second:
            reached = max(reached, kept[index][1])
            index += 1
        by_second.append(reached)
    steps = max((step for _, step in kept), default=0)
    times = [at for at, _ in kept if at >= 0]
    gaps = [(a, b - a) for a, b in itertools.pairwise(times)]
    if not gaps:
        return {"steps": steps, "by_second": by_second, "pace": None}
    median = statistics.median(g for _, g in gaps)
    pace = statistics.fmean(g for _, g in gaps if g <= STALL * median)
    expected = 1 + seconds / pace
    return {
        "steps": steps,
        "by_second": by_second,
        "pace": {
            "step_seconds": pace,
            "median_step_seconds": median,
            "expected_steps": expected,
            "goodput": steps / expected,
            "stalls": [[round(a, 2), round(g, 2)] for a, g in gaps if g > STALL * median],
        },
    }


def rejoined(logs: str, new: str, started: float, until: float) -> float | None:
    """Seconds from a node's new agent's start (its output: ``new``) to the job's first
    step at world 4 once the new agent's workers have started (before ``until``): the node
    joining. (A preempted node's old workers may still step at world 4 meanwhile.)"""
    starts = [float(m[4]) for m in START.findall(new)]
    if not starts:
        return None
    joined = [float(t) for _, world, t in DONE.findall(logs) if world == str(NPROC * NODES)]
    joined = [t for t in joined if min(starts) < t <= until]
    return min(joined) - started if joined else None


def after_kill(logs: str, at: float, until: float) -> dict[str, Any]:
    """What the failure at ``at`` cost, from the workers' output up to ``until`` (the next
    failure, or the deadline): the newest step done before the new workers started, the
    step they resumed from, and the seconds until the job did a step it had not done."""
    steps = sorted((float(t), int(step)) for step, _, t in DONE.findall(logs))
    starts = sorted(float(m[4]) for m in START.findall(logs) if at < float(m[4]) <= until)
    # A job may also go on without a restart: torchft's quorum drops a hung replica group,
    # whose last step (which its peers may print a moment after it hangs) is then the
    # newest the whole job did.
    hung = sorted((float(t), int(s)) for s, t in HANGING.findall(logs) if at < float(t) <= until)
    restarted = starts[0] if starts else hung[0][0] if hung else until
    reached = max((step for t, step in steps if t <= restarted), default=-1)
    reached = max([reached, *(s for _, s in hung[:1])])
    resumed = [(float(t), int(s)) for s, t in RESUMED.findall(logs) if at < float(t) <= until]
    step = min(resumed)[1] if resumed else None
    new = [t for t, s in steps if restarted < t <= until and s > reached]
    if step is None and hung and not starts and new:
        step = reached  # went on in place: the survivors kept their state, loaded none
    return {
        "restarted": bool(starts),
        "reached": reached,
        "resumed": step,
        "redone": None if step is None else max(0, reached - step),
        "seconds_to_new_step": new[0] - at if (starts or hung) and new else None,
    }


def accounted(nodes: list[Node], start: float, deadline: float) -> dict[str, Any]:
    """rallypoint's own account of the run (``rallypoint.goodput``) from every agent's
    event log, up to the deadline; its phases from ``start`` (the first step) on, and of
    the whole run. A killed agent never wrote that it stopped: it is given an
    ``agent_stopping`` at the moment of its SIGKILL (its node-time ends there)."""
    from rallypoint import goodput
    from rallypoint.errors import UsageError

    kept: list[dict[str, Any]] = []
    skipped = 0
    for agent in (a for node in nodes for a in node.agents):
        try:  # an agent killed before it wrote a line has no log to speak of
            records, cut = goodput.read([agent.events]) if agent.events else ([], 0)
        except UsageError:
            continue
        skipped += cut
        kept += [r for r in records if float(r["wall_time"]) <= deadline]
        if agent.killed is not None:
            for node_id in {str(r["node"]) for r in records}:
                kept.append({"event": "agent_stopping", "node": node_id, "wall_time": agent.killed,
                             "exit_code": -9, "benchmark": "SIGKILL"})  # fmt: skip
    if not kept:
        return {"error": "no event log"}
    account = goodput.account(kept, now=deadline)
    phases = dict.fromkeys(goodput.PHASES, 0.0)
    for node in account.nodes:  # each segment's part in the window
        for segment in node.segments:
            phases[segment.phase] += max(
                0.0, min(segment.end, deadline) - max(segment.start, start)
            )
    total = sum(phases.values())
    return {
        "goodput": phases[goodput.TRAINING] / total if total else None,
        "node_seconds": total,
        "phases": phases,
        "shares": {k: v / total if total else None for k, v in phases.items()},
        "whole_run": {
            "goodput": account.goodput,
            "node_seconds": account.total,
            "phases": account.phases,
        },
        "failures": len(account.incidents),
        "failures_by_cause": account.causes(),
        "steps_redone": account.steps_redone,
        "steps_known": account.steps_known,
        "nodes": len(account.nodes),
        "skipped_lines": skipped,
        "incidents": [vars(i) for i in account.incidents],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    return measure_launches([LAUNCHES[args.only]] if args.only else [*LAUNCHES.values()], args)


def measure_launches(
    launches: list[Launch], args: argparse.Namespace, clean: bool = True
) -> dict[str, Any]:
    """Each launch without failures (unless not ``clean``), then with them, in turn
    (``bench_peers.py`` passes the peers too)."""
    scratch = Path(tempfile.mkdtemp(prefix="rallypoint-bench-goodput-"))
    runs: dict[str, dict[str, Any]] = {}
    redis, redis_port = common.start_redis(STORE_WAIT)
    try:
        # No failures first, then failures, each launcher in turn: the machine's noise
        # (others' tests) hits every launcher alike.
        for faults in (False, True) if clean else (True,):
            for launch in launches if not faults else launches[::-1]:
                print(f"{launch.name}, {'failures' if faults else 'no failures'}, "
                      f"{args.seconds:.0f} s ...", flush=True)  # fmt: skip
                run = run_once(launch, faults, args, scratch, redis_port)
                runs[f"{launch.name}-{'faults' if faults else 'clean'}"] = run
                print(f"  {run['steps']} steps"
                      + (f"; {run['error']}" if run["error"] else ""), flush=True)  # fmt: skip
    finally:
        redis.kill()
        redis.wait(CLEANUP_WAIT)
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {}
    for launcher in (launch.name for launch in launches):
        failed = runs[f"{launcher}-faults"]
        unfailed = runs.get(f"{launcher}-clean", {"steps": 0, "pace": None})
        summary[launcher] = {
            "steps_clean": unfailed["steps"] if clean else None,
            "steps_faults": failed["steps"],
            "goodput": failed["steps"] / unfailed["steps"] if unfailed["steps"] else None,
            "pace_goodput_clean": (unfailed["pace"] or {}).get("goodput"),
            "pace_goodput_faults": (failed["pace"] or {}).get("goodput"),
            "by_event": by_event(failed["kills"]),
            "agent_memory": unfailed.get("agent_memory", failed["agent_memory"])["agent"],
        }
    return {
        "git": common.git_state("core"),
        "settings": {k: getattr(args, k) for k in OPTIONS if k not in ("only", "keep")},
        "schedule": schedule(args),
        "target": TARGET,
        "summary": summary,
        "runs": runs,
    }


def event_name(event: dict[str, Any]) -> str:
    """A failure's kind: ``worker SIGKILL``, ``node SIGKILL``, ``node SIGTERM`` or
    ``rank hung``."""
    if event["kind"] == "hang":
        return "rank hung"
    return f"{event['kind']} {event.get('signal', 'SIGKILL')}"


def by_event(kills: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind of failure (``event_name``): how many happened, the steps redone after
    them (in all, of those whose resumed step is known; None: of none), and the mean
    seconds from the signal to a new step (of those that got one; ``never``: how many did
    not) and, of a node's, from its start again to the job's first step with it."""
    found: dict[str, dict[str, Any]] = {}
    for done in kills:
        if "at" not in done:
            continue  # skipped
        entry = found.setdefault(
            event_name(done),
            {"count": 0, "redone": None, "seconds": [], "never": 0, "rejoin": []},
        )
        if done.get("seconds_to_rejoin") is not None:
            entry["rejoin"].append(done["seconds_to_rejoin"])
        entry["count"] += 1
        if done.get("redone") is not None:
            entry["redone"] = (entry["redone"] or 0) + done["redone"]
        if done.get("seconds_to_new_step") is None:
            entry["never"] += 1
        else:
            entry["seconds"].append(done["seconds_to_new_step"])
    for entry in found.values():
        seconds = entry.pop("seconds")
        entry["mean_seconds_to_new_step"] = statistics.fmean(seconds) if seconds else None
        rejoin = entry.pop("rejoin")
        entry["mean_seconds_to_rejoin"] = statistics.fmean(rejoin) if rejoin else None
    return found


# --- the page -----------------------------------------------------------------------------


PHASE_COLORS = {
    "startup": "#c7c7c7", "rendezvous": "#9467bd", "training": "#2b7bba",
    "checkpoint": "#17becf", "detection": "#d62728", "restart": "#ff7f0e",
    "loading": "#bcbd22", "redone": "#8c564b", "stopping": "#7f7f7f",
}  # fmt: skip


def mark_schedule(axis: Any, schedule: list[dict[str, Any]]) -> None:
    """A line at each planned failure: a worker's dashed, a node's solid; SIGTERM orange."""
    for planned in schedule:
        node = planned["kind"] == "node"
        color = "#ff7f0e" if planned.get("signal") == "SIGTERM" else "#d62728"
        axis.axvline(planned["at"], color=color, alpha=0.6 if node else 0.25,
                     linewidth=1.5 if node else 0.8, linestyle="-" if node else "--")  # fmt: skip


def chart(results: dict[str, Any]) -> None:
    figure, (steps, phases) = common.figure(
        1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.6, 1]}
    )
    for run in results["runs"].values():
        launcher = run["launcher"]
        style = "-" if run["faults"] else ":"
        label = f"{launcher}, {'failures' if run['faults'] else 'no failures'}: {run['steps']}"
        steps.plot(range(len(run["by_second"])), run["by_second"], style,
                   color=common.COLORS.get(launcher), label=label, linewidth=1.6)  # fmt: skip
    mark_schedule(steps, results["schedule"])
    steps.set_xlabel(
        "seconds from the job's first step (red dashed: a worker SIGKILLed; "
        "solid: a node SIGKILLed, red, or SIGTERMed, orange)"
    )
    steps.set_ylabel("steps kept (newest step done)")
    steps.set_title("Training progress, two nodes of two workers", fontsize=10)
    steps.legend(fontsize=8, loc="upper left")
    steps.grid(True, alpha=0.3)
    rows = [r for r in results["runs"].values() if r.get("account", {}).get("shares")]
    for y, run in enumerate(rows):
        left = 0.0
        for phase, share in run["account"]["shares"].items():
            if share:
                phases.barh(y, share, left=left, color=PHASE_COLORS.get(phase, "#333333"),
                            label=phase, height=0.6)  # fmt: skip
                left += share
    phases.set_yticks(range(len(rows)))
    phases.set_yticklabels(["failures" if r["faults"] else "no failures" for r in rows])
    phases.invert_yaxis()
    phases.set_xlim(0, 1)
    phases.set_xlabel("share of node-seconds (rallypoint's event logs)")
    phases.set_title("rallypoint: where the time went", fontsize=10)
    handles, labels = phases.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))  # one entry per phase
    phases.legend(unique.values(), unique.keys(), fontsize=7, loc="upper center",
                  ncol=4, bbox_to_anchor=(0.5, -0.2))  # fmt: skip
    common.save(figure, "bench_goodput.png")


def render(results: dict[str, Any]) -> dict[str, list[str]]:
    settings = results["settings"]
    setup = common.measured(
        results,
        f"- Python {results['python']}, torch {results['torch']}; rallypoint {results['git']}",
        f"- Load average (1, 5, 15 min) before the run: {results['load_before']}; after: "
        f"{results['load_after']}",
        f"- {settings['seconds']:.0f} s per run; {described(results['schedule'])}; "
        f"{settings['step_seconds']} s steps, saved {saves(settings.get('save_every', 1))}",
    )
    summary = results["summary"]
    rows = []
    for launcher, s in summary.items():
        target = "measured"
        if launcher == "rallypoint":
            reached = (s["pace_goodput_faults"] or 0.0) >= results["target"]
            target = (
                f"at least {results['target']:.0%} at its pace: {'met' if reached else 'not met'}"
            )
        rows.append([launcher, s["steps_clean"], s["steps_faults"], percent(s["goodput"]),
                     f"{percent(s['pace_goodput_clean'])} / **{percent(s['pace_goodput_faults'])}**",
                     target])  # fmt: skip
    goodput_table = common.table(
        "launcher | steps, no failures | steps, failures | steps ÷ steps | "
        "at the run's own pace (no failures / failures) | target",
        rows,
    )
    # One row per failure of the schedule: what each launcher lost to it.
    kills = {r["launcher"]: r["kills"] for r in results["runs"].values() if r["faults"]}
    failure_rows = []
    for index, planned in enumerate(results["schedule"]):
        what = failure_words(planned)
        cells = [f"{planned['at']:.0f} s", what]
        for launcher in summary:
            done = kills.get(launcher, [])
            cells.append(failure_cell(done[index] if index < len(done) else None))
        failure_rows.append(cells)
    failures = common.table(
        "at | failure | "
        + " | ".join(f"{n}: steps redone, seconds to a new step" for n in summary),
        failure_rows,
    )
    # The same, per kind of failure: the steps redone in all, the mean seconds.
    kinds = {name: by_event(done) for name, done in kills.items()}
    kind_rows = []
    for kind in dict.fromkeys(event_name(e) for e in results["schedule"]):
        cells = [kind]
        for launcher in summary:
            entry = kinds.get(launcher, {}).get(kind)
            cells.append("not reached" if entry is None else kind_cell(entry))
        kind_rows.append(cells)
    failures += ["", *common.table(
        "kind | " + " | ".join(f"{n}: failures, steps redone, mean seconds to a new step"
                               for n in summary),
        kind_rows,
    )]  # fmt: skip
    phase_rows = []
    accounts = {r["faults"]: r["account"] for r in results["runs"].values() if "account" in r}
    if accounts:
        for phase in next(iter(accounts.values()))["phases"]:
            cells = [phase]
            for faults in (False, True):
                account = accounts.get(faults)
                if account is None:
                    cells.append("n/a")
                    continue
                seconds, share = account["phases"][phase], account["shares"][phase]
                cells.append(f"{seconds:.1f} s ({share:.1%})")
            phase_rows.append(cells)
        totals = ["**all**"]
        for faults in (False, True):
            account = accounts.get(faults)
            totals.append("n/a" if account is None else
                          f"{account['node_seconds']:.0f} node-seconds; goodput "
                          f"{common.number(account['goodput'] and account['goodput'] * 100, ' %', 1)}; "
                          f"{account['failures']} failures, {account['steps_redone']} steps redone")  # fmt: skip
        phase_rows.append(totals)
    phase_table = common.table("phase | no failures | failures", phase_rows)
    checks, notices = [], []
    for name, run in results["runs"].items():
        notes = []
        if run.get("error"):
            notes.append(run["error"])
        if run["leftovers"]:
            notes.append(f"{run['leftovers']} processes left after the cleanup")
        ended = [e for node in run["exits"] for e in node]
        exits = [e for e in ended if e not in ("killed", "terminated", None)]
        if exits:
            notes.append(f"agents exited on their own: {exits}")
        if notes:
            checks.append(f"- {name}: {'; '.join(notes)}")
        told = [done for done in run["kills"] if done.get("signal") == "SIGTERM" and "at" in done]
        for done in told:  # the agents sent SIGTERM, which were to exit by themselves
            notices.append(f"- {name}: node {done['node']} sent SIGTERM at {done['at']:.0f} s, "
                           f"{agent_exit(done)}")  # fmt: skip
    if not checks:
        checks.append("- No agent exited on its own, and no process was left after any run.")
    checks += notices
    startup = []
    for launcher in summary:
        seconds = [results["runs"].get(f"{launcher}-{kind}", {}).get("startup_seconds")
                   for kind in ("clean", "faults")]  # fmt: skip
        startup.append(f"{launcher} {' / '.join(common.number(x, ' s', 1) for x in seconds)}")
    checks.insert(0, "- Start-up, from the first agent's start to the job's first step (not in "
                  f"the wall time; no failures / failures): {'; '.join(startup)}")  # fmt: skip
    commands = ["```"]
    for launcher in summary:
        run = results["runs"][f"{launcher}-faults"]
        commands.append(run["command"])
    commands.append("```")
    return {
        "setup": setup,
        "goodput": [*goodput_table, "", *checks],
        "failures": failures,
        "phases": phase_table,
        "commands": commands,
    }


def percent(value: float | None) -> str:
    return common.number(None if value is None else value * 100, " %", 1)


def described(events: list[dict[str, Any]]) -> str:
    """The schedule in words: the workers' SIGKILLs, then the node's events."""
    workers = [f"{e['at']:.0f}" for e in events if e["kind"] == "worker"]
    nodes = [
        f"{e.get('signal', 'SIGKILL')} at {e['at']:.0f} s" for e in events if e["kind"] == "node"
    ]
    parts = [f"a worker SIGKILLed at {', '.join(workers)} s" if workers else "no worker killed"]
    parts.append(f"the second node: {', '.join(nodes)} (each time started again at once)"
                 if nodes else "no node event")  # fmt: skip
    parts += [f"a worker of the second node hangs at {e['at']:.0f} s"
              for e in events if e["kind"] == "hang"]  # fmt: skip
    return "; ".join(parts)


def failure_words(planned: dict[str, Any]) -> str:
    """One failure of the schedule, as a table's cell names it."""
    if planned["kind"] == "hang":
        return f"a worker of node {planned['node']} hangs"
    what = (f"node {planned['node']}" if planned["kind"] == "node"
            else f"a worker of node {planned['node']}")  # fmt: skip
    return f"{planned.get('signal', 'SIGKILL')} {what}"


def saves(every: int) -> str:
    every_n = "every step" if every == 1 else f"every {every} steps"
    return f"{every_n} (and on notice under rallypoint)"


def kind_cell(entry: dict[str, Any]) -> str:
    seconds = common.number(entry["mean_seconds_to_new_step"], " s", 1)
    never = f" ({entry['never']} never)" if entry["never"] else ""
    redone = "n/a" if entry["redone"] is None else entry["redone"]
    return f"{entry['count']}, {redone}, {seconds}{never}"


def failure_cell(done: dict[str, Any] | None) -> str:
    if done is None:
        return "not reached"
    if done.get("skipped"):
        return f"skipped ({done['skipped']})"
    redone = "n/a" if done.get("redone") is None else str(done["redone"])
    seconds = common.number(done.get("seconds_to_new_step"), " s", 1)
    return (
        f"{redone}, {seconds}"
        if done.get("seconds_to_new_step") is not None
        else f"{redone}, never"
    )


def main() -> None:
    args = common.options(__doc__, **OPTIONS).parse_args()
    common.publish(args, "goodput", "benchmarks-goodput", measure, chart, render)


if __name__ == "__main__":
    main()

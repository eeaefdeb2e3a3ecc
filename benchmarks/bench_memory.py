"""Memory checkpoints (``--checkpoint-memory``): what a save costs the training loop, and
what a failure costs in steps done again, against ``torch.save`` and torchrun side by side
in one run; docs/benchmarks-memory.md says how.

    .venv/bin/python benchmarks/bench_memory.py [--repeat 5] [--size-mb 500]
    .venv/bin/python benchmarks/bench_memory.py --render-only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import common
from common import BIN, HOST, ROOT

TRAIN = ROOT / "tests" / "workers" / "mem_train.py"
TARGETS = {"blocked": 0.05, "step_added": 0.10, "worker_redone": 0, "node_redone": 1}
OPTIONS = {
    "repeat": (5, "runs of each save, and failures of each kind"),
    "size_mb": (500.0, "size of the state in MB"),
    "steps": (10, "1 s steps per loop of the every-step measurement"),
    "loop_rounds": (6, "rounds of the three loops (no saves, memory, disk), interleaved"),
    "part": ("", "run only one part (loop, worker, node, stop): for trying things out"),
}
PARTS = ("loop", "worker", "node", "stop")
DONE = re.compile(r"done step=(\d+)")
RESUMED = re.compile(r"resumed source=(\w+) step=(\d+)")
PID = re.compile(r"rank=(\d+) pid=(\d+)")
#: A node sees a lost node within this (the rendezvous's heartbeat_timeout).
CONF = "heartbeat_timeout=3,last_call_timeout=1,join_timeout=60"


# --- the training loop, in a process set up as a worker with --checkpoint-memory ----------

LOOP = r'''
import json, os, statistics, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import torch
import bench_checkpoint as shapes
from rallypoint.checkpoint import Checkpointer

size_mb, steps, repeat, scratch = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
rounds = int(sys.argv[6])
torch.set_num_threads(1)  # one core computes; the other is the host's (the writer's)
state = shapes.make_state(size_mb)
tensors = shapes.tensors(state)
matrix = torch.randn(1024, 1024)
product = torch.empty_like(matrix)
def per_multiply():
    began = time.perf_counter()
    for _ in range(20):
        torch.mm(matrix, matrix, out=product)
    return (time.perf_counter() - began) / 20


# Sized from the median of several samples: on a shared machine one sample may be slow.
multiplies = max(1, int(0.93 / statistics.median(per_multiply() for _ in range(7))))
memory = Checkpointer(rank=0, world_size=1)  # the tier the environment names
from rallypoint.checkpoint import FileStorage
# Today's save to a directory: a storage given outright, so not the memory tier.
disk = Checkpointer(storage=FileStorage(os.path.join(scratch, "disk")), rank=0, world_size=1)
peak = [0]


def used():
    """The memory the arena's slots take (pages written, not the files' lengths)."""
    root = os.path.join(os.environ["RALLYPOINT_MEMORY_TIER_DIR"], "arena")
    return sum(f.stat().st_blocks * 512 for f in __import__("pathlib").Path(root).rglob("slot-*"))


def settle_step_length():
    """Size the multiplies so that a step without saves takes 1 s here, now: a step of
    the loop itself, twice adjusted (a sample of multiplies alone runs faster than a step,
    whose update of the state competes for the memory bus)."""
    global multiplies
    for _ in range(2):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(multiplies):
                torch.mm(matrix, matrix, out=product)
            for tensor in tensors:
                tensor.add_(1e-3)
            times.append(time.perf_counter() - start)
        multiplies = max(1, round(multiplies / statistics.median(times)))


settle_step_length()
first = [1000]  # steps only grow: each tier keeps its newest


def loop(saver):
    """1 s steps: multiplies (about 0.93 s), then every tensor of the state updated (an
    optimizer step), then a save of the step."""
    times, blocked = [], []
    first[0] += steps
    for step in range(first[0], first[0] + steps):
        start = time.perf_counter()
        for _ in range(multiplies):
            torch.mm(matrix, matrix, out=product)
        for tensor in tensors:
            tensor.add_(1e-3)
        if saver is not None:
            before = time.perf_counter()
            saver.save(state, step, asynchronous=True)
            blocked.append(time.perf_counter() - before)
        times.append(time.perf_counter() - start)
    if saver is not None:
        saver.wait()
    return {"step": statistics.median(times[1:]), "blocked": statistics.median(blocked or [0])}


def torch_save():
    path = os.path.join(scratch, "plain.pt")
    os.sync()
    start = time.perf_counter()
    torch.save(state, path)
    seconds = time.perf_counter() - start
    os.unlink(path)
    return seconds


def memory_save(step):
    start = time.perf_counter()
    memory.save(state, step, asynchronous=True)
    blocked = time.perf_counter() - start
    memory.wait()
    return {"blocked": blocked, "written": time.perf_counter() - start}


import shutil
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

# The reference for an asynchronous save: torch.distributed.checkpoint's, in a world of one.
dist.init_process_group("gloo", init_method=f"file://{scratch}/group", rank=0, world_size=1)


def dcp_save(step):
    path = os.path.join(scratch, f"dcp-{step}")
    start = time.perf_counter()
    future = dcp.async_save({"state": state}, checkpoint_id=path)
    blocked = time.perf_counter() - start
    future.result()
    written = time.perf_counter() - start
    shutil.rmtree(path, ignore_errors=True)
    return {"blocked": blocked, "written": written}


torch_save(), memory_save(0), dcp_save(0)  # warm-up
saves = {"torch_save": [], "memory": [], "dcp_async": []}
for index in range(repeat):
    saves["torch_save"].append(torch_save())
    saves["memory"].append(memory_save(index + 1))
    saves["dcp_async"].append(dcp_save(index + 1))
import threading

sampling = threading.Event()


def sample():
    """The tier's bytes (complete and partial files), every 20 ms while a memory loop runs."""
    while not done.is_set():
        if sampling.is_set():
            try:
                peak[0] = max(peak[0], used())
            except OSError:  # a file renamed or removed while it was counted
                pass
        time.sleep(0.02)


done = threading.Event()
threading.Thread(target=sample, daemon=True).start()
loops = {"alone": [], "memory": [], "disk": []}
for index in range(rounds):  # interleaved: noise on a shared machine hits each alike
    for name, saver in (("alone", None), ("memory", memory), ("disk", disk)):
        if saver is memory:
            sampling.set()
        loops[name].append(loop(saver))
        sampling.clear()
done.set()
print(json.dumps({"saves": saves, "loops": loops, "peak_bytes": peak[0], "multiplies": multiplies}))
'''


def measure_loop(args: argparse.Namespace) -> dict[str, Any]:
    """The save and the every-step loop in a child with the environment a worker of
    ``rallypoint run --checkpoint-memory`` gets (the tier's variables)."""
    scratch = Path(tempfile.mkdtemp(prefix="rallypoint-bench-memory-"))
    tier = Path(tempfile.mkdtemp(prefix="rallypoint-bench-memory-", dir="/dev/shm"))
    (tier / "arena").mkdir()
    env = common.clean_env(
        {
            "RALLYPOINT_MEMORY_TIER_DIR": str(tier),
            "RALLYPOINT_MEMORY_TIER_BYTES": str(int(args.size_mb * 4.2e6)),
            "RALLYPOINT_MEMORY_TIER_KEEP": "1",
        }
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", LOOP, str(ROOT / "benchmarks"), str(args.size_mb),
             str(args.steps), str(args.repeat), str(scratch), str(args.loop_rounds)],
            env=env, capture_output=True, text=True, timeout=1800, check=False,
        )  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(tier, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"the loop measurement failed:\n{done.stdout}\n{done.stderr}")
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    plain = statistics.median(raw["saves"]["torch_save"])
    blocked = statistics.median(s["blocked"] for s in raw["saves"]["memory"])
    written = statistics.median(s["written"] for s in raw["saves"]["memory"])
    dcp_blocked = statistics.median(s["blocked"] for s in raw["saves"]["dcp_async"])
    loops = raw["loops"]
    step = {name: statistics.median(r["step"] for r in runs) for name, runs in loops.items()}
    # Each round's loop against the loop without saves of the same round, then the median.
    added = {
        name: statistics.median(
            r["step"] / alone["step"] - 1
            for r, alone in zip(loops[name], loops["alone"], strict=True)
        )
        for name in ("memory", "disk")
    }
    return {
        "raw": raw,
        "torch_save_seconds": plain,
        "memory_blocked_seconds": blocked,
        "memory_written_seconds": written,
        "blocked_ratio": blocked / plain,
        "dcp_async_blocked_seconds": dcp_blocked,
        "step_seconds": step,
        "step_added": added,
        "peak_bytes": raw["peak_bytes"],
    }


# --- failures, with real launchers --------------------------------------------------------


class Job:
    """One launch of mem_train.py (a save every 0.2 s step), its output read as it comes."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: re.Pattern[str], count: int = 1, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(pattern.findall(self.text())) < count:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"never saw {pattern.pattern!r}:\n{self.text()[-3000:]}")
            time.sleep(0.02)

    def pid_of(self, rank: int) -> int:
        found = [int(p) for r, p in PID.findall(self.text()) if int(r) == rank]
        return found[-1]

    def stop(self, timeout: float = 60) -> int | None:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
            return None


def redone(text: str) -> tuple[int, int, str]:
    """From a job's output: the newest step done before the resume, the step resumed from,
    and where it was loaded from."""
    head, _, tail = text.partition("resumed source=")
    resumed = RESUMED.search("resumed source=" + tail)
    if resumed is None:
        raise RuntimeError(f"the job never resumed:\n{text[-3000:]}")
    reached = max(int(s) for s in DONE.findall(head))
    return reached, int(resumed[2]), resumed[1]


def worker_kill(launcher: str, scratch: Path, tag: str) -> dict[str, Any]:
    """A 2-worker job saving every step; rank 1 is SIGKILLed at a random moment of a step
    after the 10th; the steps done again after the restart."""
    ckpt = scratch / f"{launcher}-ckpt-{time.monotonic_ns()}"
    env = common.clean_env({"RALLYPOINT_CHECKPOINT_URL": str(ckpt)})
    if launcher == "rallypoint":
        flags = ["--checkpoint-memory", "1GB", "--checkpoint-dir", str(ckpt)]
    else:  # torchrun: the same script saves to the directory (rallypoint.checkpoint's API)
        flags = ["--standalone"]
    command = [*common.LAUNCHERS[launcher], "--nproc-per-node", "2", "--max-restarts", "1",
               *flags, str(TRAIN), "60", "--step-seconds", "0.2", "--megabytes", "64",
               "--stop-file", tag]  # fmt: skip
    job = Job(command, env)
    try:
        job.wait_for(DONE, count=2 * 10)
        time.sleep(random.uniform(0, 0.2))
        os.kill(job.pid_of(1), signal.SIGKILL)
        try:
            job.wait_for(RESUMED, count=2, timeout=60)
        except RuntimeError:  # the launcher's restart failed (torchrun's does, at times)
            return {"recovered": False}
        reached, step, source = redone(job.text())
    finally:
        Path(tag).touch()
        job.stop()
        Path(tag).unlink(missing_ok=True)
        common.kill_tagged(tag)
        shutil.rmtree(ckpt, ignore_errors=True)
    return {"recovered": True, "reached": reached, "resumed": step, "redone": reached - step,
            "source": source}  # fmt: skip


def two_nodes(port: int, run_id: str, ckpt: Path, tag: str, every: int) -> list[Job]:
    command = [str(BIN / "rallypoint"), "run", "--nnodes", "1:2", "--nproc-per-node", "1",
               "--max-restarts", "3", "--rdzv-backend", "redis",
               "--rdzv-endpoint", f"{HOST}:{port}", "--rdzv-id", run_id, "--rdzv-conf", CONF,
               "--checkpoint-memory", "1GB", "--checkpoint-dir", str(ckpt),
               "--checkpoint-persist-every", str(every), str(TRAIN), "100000",
               "--step-seconds", "0.2", "--megabytes", "8", "--stop-file", tag]  # fmt: skip
    return [Job(command, common.clean_env()) for _ in range(2)]


def node_kill(port: int, scratch: Path, tag: str) -> dict[str, Any]:
    """A 1:2 job of two agents; the agent of group rank 0 (its worker saves) and its worker
    are SIGKILLed at a random moment after step 10; the survivor resumes alone."""
    ckpt = scratch / f"node-{time.monotonic_ns()}"
    jobs = two_nodes(port, f"bench-node-{time.monotonic_ns()}", ckpt, tag, every=10)
    try:
        for job in jobs:
            job.wait_for(DONE, count=10)
        saver = next(job for job in jobs if "rank=0 pid=" in job.text())
        survivor = next(job for job in jobs if job is not saver)
        time.sleep(random.uniform(0, 0.2))
        os.killpg(saver.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        survivor.wait_for(RESUMED)
        reached_saver = max(int(s) for s in DONE.findall(saver.text()))
        reached, step, source = redone(survivor.text())
        reached = max(reached, reached_saver)
        recovered = time.monotonic() - killed
    finally:
        Path(tag).touch()
        for job in jobs:
            job.stop()
        Path(tag).unlink(missing_ok=True)
        common.kill_tagged(tag)
        shutil.rmtree(ckpt, ignore_errors=True)
    return {"reached": reached, "resumed": step, "redone": reached - step, "source": source,
            "seconds_to_resume": recovered}  # fmt: skip


def stop_all(port: int, scratch: Path, tag: str, every: int) -> dict[str, Any]:
    """SIGTERM to both agents of a 1:2 job at a random moment after step 20 (a preemption):
    the newest step in the durable store against the newest memory save (rank 0's last
    step: it prints a step once its save returned); and how far the durable copy was
    behind the newest step done while training (``every``: K)."""
    from rallypoint.checkpoint import Checkpointer

    ckpt = scratch / f"stop-{time.monotonic_ns()}"
    jobs = two_nodes(port, f"bench-stop-{time.monotonic_ns()}", ckpt, tag, every=every)
    behind: list[int] = []
    try:
        for job in jobs:
            job.wait_for(DONE, count=5)
        deadline = time.monotonic() + 60
        while len(DONE.findall(jobs[0].text())) < 20 and time.monotonic() < deadline:
            done = max(int(s) for job in jobs for s in DONE.findall(job.text()))
            durable = Checkpointer(str(ckpt), rank=0, world_size=1).steps() if ckpt.exists() else []
            behind.append(done - (durable[-1] if durable else -1))
            time.sleep(0.05)
        time.sleep(random.uniform(0, 0.2))
        for job in jobs:
            os.kill(job.process.pid, signal.SIGTERM)
        codes = [job.stop() for job in jobs]
        # Rank 0 prints a step once its save returned: its newest is the newest saved.
        saver = next(job for job in jobs if "rank=0 pid=" in job.text())
        saved = max(int(s) for s in DONE.findall(saver.text()))
        durable = Checkpointer(str(ckpt), rank=0, world_size=1).steps()
    finally:
        common.kill_tagged(tag)
        shutil.rmtree(ckpt, ignore_errors=True)
    return {"exit_codes": codes, "newest_saved": saved, "durable_newest": durable[-1],
            "most_behind_steps": max(behind) if behind else None}  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"git": common.git_state("core/rallypoint/checkpoint", "tier.py")}
    parts = [args.part] if args.part else list(PARTS)
    previous = common.RESULTS / "memory.json"
    if args.part and previous.exists():  # one part again: the others as they were
        kept = json.loads(previous.read_text())
        results.update({part: kept[part] for part in PARTS if part in kept and part != args.part})
    if "loop" in parts:
        results["loop"] = measure_loop(args)
        print(json.dumps({k: v for k, v in results["loop"].items() if k != "raw"}), flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="rallypoint-bench-memory-"))
    tag = str(scratch / "stop")
    try:
        if "worker" in parts:
            results["worker"] = common.rounds(
                args.repeat, list(common.LAUNCHERS), lambda name: worker_kill(name, scratch, tag)
            )
        if {"node", "stop"} & set(parts):
            server, port = common.start_redis()
            try:
                if "node" in parts:
                    results["node"] = [node_kill(port, scratch, tag) for _ in range(args.repeat)]
                    print(json.dumps(results["node"]), flush=True)
                if "stop" in parts:
                    results["stop"] = [stop_all(port, scratch, tag, 5) for _ in range(args.repeat)]
                    print(json.dumps(results["stop"]), flush=True)
            finally:
                server.kill()
                server.wait(10)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["size_mb"] = args.size_mb
    return results


# --- the page -----------------------------------------------------------------------------


def _dcp_reference(loop: dict[str, Any]) -> str:
    """``dcp.async_save`` of the same state beside it (absent from older results)."""
    seconds = loop.get("dcp_async_blocked_seconds")
    if seconds is None:
        return ""
    return f" (`dcp.async_save`: {seconds:.3f} s = {seconds / loop['torch_save_seconds']:.1%})"


def chart(results: dict[str, Any]) -> None:
    if "loop" not in results:
        return
    loop = results["loop"]
    figure, (saves, steps) = common.figure(1, 2, figsize=(10, 4))
    names = ["torch.save\n(disk)", "memory save\n(blocked)"]
    values = [loop["torch_save_seconds"], loop["memory_blocked_seconds"]]
    saves.bar(names, values, color=["#999999", "#2b7bba"])
    for x, value in enumerate(values):
        saves.annotate(f"{value:.3f} s", (x, value), ha="center", va="bottom", fontsize=8)
    saves.set_ylabel("seconds the loop waits (median)")
    saves.set_title(f"One save of {results['size_mb']:.0f} MB", fontsize=10)
    kinds = ["alone", "memory", "disk"]
    labels = ["no saves", "a memory save\nevery step", "a disk save\nevery step"]
    seconds = [loop["step_seconds"][k] for k in kinds]
    steps.bar(labels, seconds, color=["#999999", "#2b7bba", "#cfe0ef"])
    for x, value in enumerate(seconds):
        steps.annotate(f"{value:.3f} s", (x, value), ha="center", va="bottom", fontsize=8)
    steps.set_ylabel("step time (median)")
    steps.set_title("1 s steps, the whole state saved every step", fontsize=10)
    common.save(figure, "bench_memory_checkpoint.png")


def render(results: dict[str, Any]) -> dict[str, list[str]]:
    setup = common.measured(
        results,
        f"- Python {results['python']}, torch {results['torch']}; rallypoint {results['git']}",
        f"- Load average (1, 5, 15 min) before the run: {results['load_before']}; after: "
        f"{results['load_after']}",
    )
    rows = []
    loop = results.get("loop")
    if loop:
        rows.append(["loop blocked by a save, against `torch.save` to disk",
                     f"{loop['memory_blocked_seconds']:.3f} s / {loop['torch_save_seconds']:.3f} s = "
                     f"**{loop['blocked_ratio']:.1%}**" + _dcp_reference(loop),
                     f"at most {TARGETS['blocked']:.0%}"])  # fmt: skip
        rows.append(["a save every step, 1 s steps: step time added",
                     f"memory **{loop['step_added']['memory']:.1%}**; to disk (asynchronous) "
                     f"{loop['step_added']['disk']:.1%} (steps of "
                     f"{loop['step_seconds']['alone']:.2f} s without saves; a memory save "
                     f"takes {loop['memory_written_seconds']:.2f} s to complete)",
                     f"at most {TARGETS['step_added']:.0%}"])  # fmt: skip
    worker = results.get("worker")
    if worker:
        cells = []
        for launcher in common.LAUNCHERS:
            runs = [r for r in worker[launcher] if r["recovered"]]
            failed = len(worker[launcher]) - len(runs)
            cell = f"{launcher} {', '.join(str(r['redone']) for r in runs) or 'none'}"
            if runs:
                cell += f" (from {', '.join(sorted({r['source'] for r in runs}))})"
            if failed:
                cell += f"; {failed} of {len(worker[launcher])} restarts failed"
            cells.append(cell)
        rows.append(
            ["steps redone after a worker SIGKILL, a save every step", "; ".join(cells), "0"]
        )
    node = results.get("node")
    if node:
        rows.append(["steps redone after a node SIGKILL, 2 nodes",
                     ", ".join(f"{r['redone']} ({r['source']})" for r in node), "at most 1"])  # fmt: skip
    stop = results.get("stop")
    if stop:
        rows.append(["after a SIGTERM to every agent, the durable store holds",
                     ", ".join(f"step {r['durable_newest']} (newest saved: {r['newest_saved']})"
                               for r in stop),
                     "the newest memory checkpoint"])  # fmt: skip
        rows.append(
            [
                "durable copy behind the newest step while training (K = 5)",
                ", ".join(f"{r['most_behind_steps']}" for r in stop),
                "at most K saves",
            ]
        )
    memory = []
    if loop:
        state = results["size_mb"] * 1e6
        memory.append(f"- Node memory for {results['size_mb']:.0f} MB of state, one copy kept: "
                      f"at most {loop['peak_bytes'] / 1e6:.0f} MB in /dev/shm "
                      f"({loop['peak_bytes'] / state:.1f} copies: the kept one and the one "
                      "being written); a node that also holds a peer's copy holds one more "
                      "(two while a new one arrives).")  # fmt: skip
    return {
        "setup": setup,
        "table": [*common.table("measurement | measured | target", rows), "", *memory],
    }


def main() -> None:
    args = common.options(__doc__, **OPTIONS).parse_args()
    common.publish(args, "memory", "benchmarks-memory", measure, chart, render)


if __name__ == "__main__":
    main()

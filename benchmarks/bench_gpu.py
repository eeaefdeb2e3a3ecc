"""Checkpoints on a GPU: how long a save holds the loop up, how fast a memory copy loads back
onto the GPU, and what a worker's SIGKILL costs a job that saves every step, beside
torch.save, torch.distributed.checkpoint and torchrun in the same run; docs/benchmarks-gpu.md
says how. Only a machine with a CUDA GPU measures: elsewhere ``--device cpu`` runs every
part on the CPU as a dry run, and writes no results.

    python benchmarks/bench_gpu.py [--part stall|load|train] [--layers 12]
    python benchmarks/bench_gpu.py --device cpu --layers 1 --batch 1   # a dry run
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
from common import ROOT

TRAIN = ROOT / "benchmarks" / "gpu_train.py"
OPTIONS = {
    "part": ("", "run only one part (stall, load, train)"),
    "device": (("cuda", "cpu"), "cpu: a dry run, nothing written"),
    "layers": (12, "TransformerEncoderLayers of d=1024 (12: 1.81 GB of state with AdamW)"),
    "batch": (16, "sequences of 512 per step"),
    "repeat": (4, "saves and loads measured of each kind"),
    "memory_gb": (12.0, "--checkpoint-memory of the training jobs, in GB"),
}
PARTS = ("stall", "load", "train")
#: The issue's targets (docs/benchmarks-gpu.md): blocked per save, step time with a save
#: every step against none, steps redone, recovery gap, load against the H2D floor.
TARGETS = {"blocked": 0.05, "step_ratio": 1.3, "redone": 0, "gap": 1.5, "load_ratio": 2.0}


# --- one process: saves and loads of one state, side by side ------------------------------

SAVES = r'''
import json, os, statistics, sys, tempfile, time
import torch
import torch.distributed as dist

device, layers, repeat, part = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cuda = device == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1)
model = torch.nn.Sequential(
    *[torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True) for _ in range(layers)]
).to(device)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 8, 1024, device=device)).sum().backward()
optimizer.step()
state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
tensors = list(state["model"].values()) + [
    t for s in state["optimizer"]["state"].values() for t in s.values() if torch.is_tensor(t)
]
nbytes = sum(t.numel() * t.element_size() for t in tensors)
memory = os.environ["RALLYPOINT_MEMORY_TIER"]
scratch = tempfile.mkdtemp(dir="/dev/shm")
out = {"state_bytes": nbytes}


def timed(fn, after=None, n=repeat):
    """Seconds ``fn`` held the caller up, per run; ``after`` waits for what it left."""
    blocked, finished = [], []
    for i in range(n):
        sync()
        a = time.perf_counter()
        result = fn(i)
        blocked.append(time.perf_counter() - a)
        if after is not None:
            after(result)
        sync()
        finished.append(time.perf_counter() - a)
    return {"blocked": blocked, "finished": finished}


# The floor: one device-to-host copy into pinned buffers made once.
on_device = [t for t in tensors if t.device.type == device]
pinned = [torch.empty_like(t, device="cpu", pin_memory=cuda) for t in on_device]


def floor(i):
    for destination, source in zip(pinned, on_device):
        destination.copy_(source, non_blocking=cuda)
    sync()


if part == "stall":
    from rallypoint.checkpoint import Checkpointer

    ours = Checkpointer(rank=0, world_size=1)  # the arena the environment names
    out["floor"] = timed(floor)
    out["rallypoint"] = timed(lambda i: ours.save(state, 1 + i))
    out["rallypoint_async"] = timed(lambda i: ours.save(state, 100 + i, asynchronous=True), lambda r: ours.wait())
    out["torch_save"] = timed(lambda i: torch.save(state, f"{scratch}/t.pt"), n=max(2, repeat // 2))
    import torch.distributed.checkpoint as dcp

    out["dcp_async_save"] = timed(
        lambda i: dcp.async_save(state, checkpoint_id=f"{scratch}/dcp{i}"), lambda f: f.result()
    )
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(cuda, True, True, cuda))  # pinned, shared, async
        out["dcp_pinned_staging"] = timed(
            lambda i: dcp.async_save(state, checkpoint_id=f"{scratch}/dcq{i}", async_stager=stager),
            lambda r: getattr(r, "upload_completion", r).result(),
        )
    except (ImportError, TypeError, AssertionError) as error:
        out["dcp_pinned_staging_error"] = str(error)
elif part == "load":
    from rallypoint.checkpoint import Checkpointer

    ours = Checkpointer(rank=0, world_size=1)
    ours.save(state, 1)
    back = [torch.empty_like(t) for t in on_device]

    def h2d(i):
        for destination, source in zip(back, pinned):
            destination.copy_(source, non_blocking=cuda)
        sync()

    floor(0)
    out["floor_h2d"] = timed(h2d)
    out["rallypoint_load"] = timed(lambda i: ours.load_latest(map_location=device))
    path = f"{scratch}/t.pt"
    torch.save(state, path)
    out["torch_load"] = timed(lambda i: torch.load(path, map_location=device, weights_only=True), n=2)
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
'''


def in_one_process(args: argparse.Namespace, part: str) -> dict[str, Any]:
    memory = Path(tempfile.mkdtemp(prefix="rallypoint-bench-gpu-", dir="/dev/shm"))
    (memory / "arena").mkdir()
    env = common.clean_env(
        {
            "RALLYPOINT_MEMORY_TIER": str(memory),
            "MASTER_PORT": str(common.free_port()),
        }
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", SAVES, args.device, str(args.layers), str(args.repeat), part],
            env=env, capture_output=True, text=True, timeout=1200, check=False,
        )  # fmt: skip
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not found:
        raise SystemExit(f"the {part} measurement failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    return json.loads(found[-1].removeprefix("RESULT "))  # type: ignore[no-any-return]


# --- training jobs: a save every step, a worker SIGKILLed after the save of step 25 -------

JOBS = {
    # name: (launcher, extra flags, MODE, EVERY)
    "rallypoint memory, warm": ("rallypoint", ["--checkpoint-memory", "{memory}"], "rp", 1),
    "rallypoint memory, asynchronous": ("rallypoint", ["--checkpoint-memory", "{memory}"], "rp-async", 1),
    "rallypoint memory, cold": ("rallypoint", ["--checkpoint-memory", "{memory}", "--warm-start", "off"], "rp", 1),
    "rallypoint, torch.save every 10": ("rallypoint", [], "tr", 10),
    "torchrun, torch.save every 10": ("torchrun", [], "tr", 10),
    "rallypoint, no saves": ("rallypoint", [], "tr", 0),
}  # fmt: skip
STEPS, KILL = 40, 25
READY = re.compile(r"READY (\S+) restart=(\d+) start=(\d+) source=(\S+) setup=(\S+) load=(\S+)")
STEP = re.compile(r"T (\S+) restart=(\d+) step=(\d+) compute=(\S+) stall=(\S+)")


def train_job(args: argparse.Namespace, name: str) -> dict[str, Any]:
    launcher, flags, mode, every = JOBS[name]
    work = Path(tempfile.mkdtemp(prefix="rallypoint-bench-gpu-"))
    memory = f"{args.memory_gb:g}GB"
    command = [
        *common.LAUNCHERS[launcher], "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
        *[flag.format(memory=memory) for flag in flags], str(TRAIN), mode, str(STEPS), str(KILL), str(every),
    ]  # fmt: skip
    env = common.clean_env(
        {
            "CKPT_DIR": str(work),
            "LAYERS": str(args.layers),
            "BATCH": str(args.batch),
            "DEV": args.device,
        }
    )
    began = time.time()
    try:
        done = subprocess.run(
            command, env=env, cwd=work, capture_output=True, text=True, timeout=900, check=False
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summarize(done.stdout + done.stderr, began, done.returncode)


def summarize(log: str, launched: float, code: int) -> dict[str, Any]:
    """What a job's log says: its step time and stall, the restart's step and source, the
    steps redone and the recovery gap (the last step before the kill to the first after)."""
    ready: dict[int, tuple[float, int, str, float]] = {}
    steps: dict[int, list[tuple[int, float, float, float]]] = {}
    for line in log.splitlines():
        line = re.sub(r"^\[[^\]]*\]:", "", line.strip())
        if found := READY.match(line):
            ready[int(found[2])] = (float(found[1]), int(found[3]), found[4], float(found[6]))
        elif found := STEP.match(line):
            steps.setdefault(int(found[2]), []).append(
                (int(found[3]), float(found[1]), float(found[4]), float(found[5]))
            )
    if 0 not in steps or 1 not in steps or 1 not in ready:
        return {"exit": code, "error": log[-2000:]}
    first = steps[0][1:]
    killed = next(s for s in steps[0] if s[0] == KILL)
    return {
        "exit": code,
        "first_step_seconds": steps[0][0][1] - launched,
        "step_seconds": statistics.median(s[2] + s[3] for s in first),
        "compute_seconds": statistics.median(s[2] for s in first),
        "stall_seconds": statistics.median(s[3] for s in first),
        "stall_max_seconds": max(s[3] for s in first),
        "resumed_step": ready[1][1],
        "resumed_from": ready[1][2],
        "load_seconds": ready[1][3],
        "redone": KILL + 1 - ready[1][1],
        "gap_seconds": steps[1][0][1] - killed[1],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU here: run with --device cpu for a dry run")
    parts = [args.part] if args.part else list(PARTS)
    results: dict[str, Any] = {"layers": args.layers, "batch": args.batch, "device": args.device}
    try:
        results["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        ).stdout.strip()  # fmt: skip
    except OSError:
        results["gpu"] = "none"
    for part in ("stall", "load"):
        if part in parts:
            print(f"measuring {part} ...", flush=True)
            results[part] = in_one_process(args, part)
    if "train" in parts:
        results["train"] = {}
        for name in JOBS:
            print(f"job {name} ...", flush=True)
            results["train"][name] = train_job(args, name)
    return results


def chart(results: dict[str, Any]) -> None:
    stall = results.get("stall")
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # a GPU machine without it: the page's tables are the results
        print("matplotlib is not installed: no chart", flush=True)
        return
    if not stall:
        return
    figure, axis = common.figure(figsize=(7, 3.2))
    kinds = [k for k in LABELS if k in stall]
    values = [statistics.median(stall[k]["blocked"]) for k in kinds]
    axis.barh(
        [LABELS[k] for k in kinds],
        values,
        color=["#2b7bba" if k.startswith("rallypoint") else "#999999" for k in kinds],
    )
    for y, value in enumerate(values):
        axis.annotate(f" {value:.3f} s", (value, y), va="center", fontsize=8)
    axis.set_xlabel("the loop held up by one save (median)")
    axis.invert_yaxis()
    common.save(figure, "bench_gpu_stall.png")


LABELS = {
    "floor": "floor: D2H into pinned buffers",
    "rallypoint": "rallypoint save (memory)",
    "rallypoint_async": "rallypoint save, asynchronous",
    "dcp_async_save": "dcp.async_save",
    "dcp_pinned_staging": "dcp.async_save, pinned staging",
    "torch_save": "torch.save to /dev/shm",
}


def render(results: dict[str, Any]) -> dict[str, list[str]]:
    gb = results.get("stall", results.get("load", {})).get("state_bytes", 0) / 1e9
    setup = common.measured(
        results,
        f"- GPU: {results.get('gpu')}; Python {results['python']}, torch {results['torch']}",
        f"- State: {results['layers']} TransformerEncoderLayers (d=1024) with AdamW, {gb:.2f} GB",
    )
    rows = []
    stall = results.get("stall", {})
    if stall:
        floor = statistics.median(stall["floor"]["blocked"])
        for kind, label in LABELS.items():
            if kind in stall:
                blocked = statistics.median(stall[kind]["blocked"])
                done = statistics.median(stall[kind]["finished"])
                rows.append(
                    [label, f"{blocked:.3f} s ({blocked / floor:.1f}x the floor)", f"{done:.3f} s"]
                )
    load = results.get("load", {})
    loads = []
    if load:
        floor = statistics.median(load["floor_h2d"]["blocked"])
        ours = statistics.median(load["rallypoint_load"]["blocked"])
        plain = statistics.median(load["torch_load"]["blocked"])
        loads = [
            ["floor: H2D from pinned buffers", f"{floor:.3f} s"],
            ["rallypoint load_latest(map_location='cuda') from the arena", f"{ours:.3f} s ({ours / floor:.1f}x the floor)"],
            ["torch.load from /dev/shm", f"{plain:.3f} s"],
        ]  # fmt: skip
    jobs = []
    for name, job in results.get("train", {}).items():
        if "error" in job:
            jobs.append([name, f"failed (exit {job['exit']})", "", "", "", ""])
            continue
        jobs.append([
            name, f"{job['step_seconds'] * 1000:.0f} ms", f"{job['stall_seconds'] * 1000:.0f} ms",
            f"{job['resumed_step']} ({job['resumed_from']})", str(job["redone"]), f"{job['gap_seconds']:.2f} s",
        ])  # fmt: skip
    return {
        "setup": setup,
        "stall": common.table("save | the loop held up (median) | until complete", rows),
        "load": common.table("load | seconds (median)", loads) if loads else ["Not measured."],
        "train": common.table(
            "job | step time | save stall | resumed at (from) | steps redone | recovery gap", jobs
        )
        if jobs
        else ["Not measured."],
    }


def main() -> None:
    args = common.options(__doc__, **OPTIONS).parse_args()
    if args.device == "cpu" and not args.render_only:
        print(json.dumps(measure(args), indent=2))  # a dry run: nothing is published
        return
    common.publish(args, "gpu", "benchmarks-gpu", measure, chart, render)


if __name__ == "__main__":
    main()

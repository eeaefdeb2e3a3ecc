"""Checkpoints on a GPU: how long a save holds the loop up, how fast a memory copy loads back
onto the GPU, and what a worker's SIGKILL costs a job that saves every step, beside
torch.save, torch.distributed.checkpoint and torchrun in the same run; docs/benchmarks-gpu.md
says how. The stall is measured with the default and the fused AdamW (the save's own
blocking and the wait it adds inside the next ``optimizer.step()``), and with every local
rank saving at once. Only a machine with a CUDA GPU measures: elsewhere ``--device cpu``
runs every part on the CPU as a dry run, and writes no results.

    python benchmarks/bench_gpu.py [--part stall|load|train] [--layers 12]
    python benchmarks/bench_gpu.py --device cpu --layers 1 --batch 1   # a dry run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
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
    "repeat": (6, "saves and loads measured of each kind (the first save apart)"),
    "memory_gb": (12.0, "--checkpoint-memory of the training jobs, in GB"),
}
PARTS = ("stall", "load", "train")
#: The issue's targets (docs/benchmarks-gpu.md): blocked per save, step time with a save
#: every step against none, steps redone, recovery gap, load against the H2D floor.
TARGETS = {"blocked": 0.05, "step_ratio": 1.3, "redone": 0, "gap": 1.5, "load_ratio": 2.0}
#: Where the measurements' files in shared memory go: gpu-check.sh names a folder of its
#: own, which it removes whatever happens.
SHM = os.environ.get("GPU_CHECK_SHM", "/dev/shm")
#: The state of one TransformerEncoderLayer (d=1024) with AdamW, for room in /dev/shm.
LAYER_BYTES = 151e6
#: Each kind of save's first run pins (or allocates) what the later ones reuse.
FIRST = 1


def launcher(name: str) -> list[str]:
    """The command of ``rallypoint run`` or ``torchrun``: the one on PATH, else this
    Python's module (wherever either was installed)."""
    found = shutil.which(name)
    modules = {"rallypoint": ["-m", "rallypoint"], "torchrun": ["-m", "torch.distributed.run"]}
    command = [found] if found else [sys.executable, *modules[name]]
    return [*command, "run"] if name == "rallypoint" else command


# --- in a process of its own: saves and loads of one state, side by side ------------------


def child(spec: dict[str, Any]) -> None:
    """One measurement (``spec``: device, layers, repeat, part, optimizer), its results on
    a ``RESULT`` line. Under the environment of a ``rallypoint run --checkpoint-memory``
    worker (its memory directory and local rank)."""
    import torch

    cuda = spec["device"] == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local)
    model = torch.nn.Sequential(
        *[torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True) for _ in range(spec["layers"])]
    ).to(device)  # fmt: skip
    fused = spec["optimizer"] == "fused"
    optimizer = torch.optim.AdamW(model.parameters(), fused=True if fused else None)
    model(torch.randn(2, 8, 1024, device=device)).sum().backward()
    optimizer.step()  # the gradients stay: each later step() updates the state again
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    scratch = Path(tempfile.mkdtemp(dir=os.environ["RALLYPOINT_MEMORY_TIER_DIR"]))
    run = Measure(state, device, spec["repeat"], scratch)
    if spec["part"] == "ranks":
        print("READY", flush=True)
        sys.stdin.readline()  # every rank starts at once
        out = run.ranks(optimizer)
    else:
        import torch.distributed as dist

        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1)
        out = run.stall(optimizer, dcp=not fused) if spec["part"] == "stall" else run.load()
        dist.destroy_process_group()
    print("RESULT " + json.dumps({"state_bytes": run.nbytes, **out}), flush=True)


class Measure:
    """The saves and loads of one state measured, each ``repeat`` times."""

    def __init__(self, state: dict[str, Any], device: str, repeat: int, scratch: Path) -> None:
        import torch

        from rallypoint.checkpoint import Checkpointer

        self.state, self.repeat, self.scratch = state, repeat, scratch
        self.cuda = device.startswith("cuda")
        self.sync: Callable[[], None] = torch.cuda.synchronize if self.cuda else (lambda: None)
        tensors = list(state["model"].values()) + [
            t for s in state["optimizer"]["state"].values() for t in s.values() if torch.is_tensor(t)
        ]  # fmt: skip
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.on_device = [t for t in tensors if t.device.type == torch.device(device).type]
        self.pinned = [
            torch.empty_like(t, device="cpu", pin_memory=self.cuda) for t in self.on_device
        ]
        self.ours = Checkpointer(rank=0, world_size=1)  # the arena the environment names

    def timed(
        self, fn: Callable[[int], Any], after: Callable[[Any], Any] | None = None, n: int = 0
    ) -> dict[str, list[float]]:
        """Seconds ``fn`` held the caller up, per run, and until what it left was done
        (``after`` waits for it)."""
        blocked, finished = [], []
        for i in range(n or self.repeat):
            self.sync()
            began = time.perf_counter()
            result = fn(i)
            blocked.append(time.perf_counter() - began)
            if after is not None:
                after(result)
            self.sync()
            finished.append(time.perf_counter() - began)
        return {"blocked": blocked, "finished": finished}

    def floor(self, i: int = 0) -> None:
        """One device-to-host copy of every tensor into pinned buffers made once."""
        for destination, source in zip(self.pinned, self.on_device, strict=True):
            destination.copy_(source, non_blocking=self.cuda)
        self.sync()

    def step_stall(self, optimizer: Any) -> dict[str, Any]:
        """The host's seconds inside ``optimizer.step()`` right after an asynchronous save
        against without one, and the save's own: the loop's stall is both."""
        alone, blocked, inside = [], [], []
        for _ in range(self.repeat):
            self.sync()
            began = time.perf_counter()
            optimizer.step()
            alone.append(time.perf_counter() - began)
        error = ""
        for i in range(self.repeat):
            self.sync()
            began = time.perf_counter()
            self.ours.save(self.state, 300 + i, asynchronous=True)
            returned = time.perf_counter()
            optimizer.step()
            blocked.append(returned - began)
            inside.append(time.perf_counter() - returned)
            try:
                self.ours.wait()
            except Exception as failed:  # a save the step's change refused: said, not timed
                error = error or f"{type(failed).__name__}: {failed}"
            self.sync()
        return {"blocked": blocked, "in_step": inside, "in_step_alone": alone, "error": error}

    def stall(self, optimizer: Any, dcp: bool) -> dict[str, Any]:
        ours, state, scratch = self.ours, self.state, self.scratch
        out: dict[str, Any] = {"floor": self.timed(self.floor)}
        out["rallypoint"] = self.timed(lambda i: ours.save(state, 1 + i))
        out["rallypoint_async"] = self.timed(
            lambda i: ours.save(state, 100 + i, asynchronous=True), lambda r: ours.wait()
        )
        out["rallypoint_step"] = self.step_stall(optimizer)
        if not dcp:  # the others' saves: once, with the default optimizer
            return out
        import torch
        import torch.distributed.checkpoint as dcp_

        out["torch_save"] = self.timed(
            lambda i: torch.save(state, scratch / "t.pt"), n=max(3, self.repeat // 2)
        )
        out["dcp_async_save"] = self.timed(
            lambda i: dcp_.async_save(state, checkpoint_id=str(scratch / f"dcp{i}")),
            lambda f: f.result(),
        )
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Pinned, shared and asynchronous staging: DCP's fastest.
            stager = DefaultStager(StagingOptions(self.cuda, True, True, self.cuda))
            out["dcp_pinned_staging"] = self.timed(
                lambda i: dcp_.async_save(
                    state, checkpoint_id=str(scratch / f"dcq{i}"), async_stager=stager
                ),
                lambda r: getattr(r, "upload_completion", r).result(),
            )
        except (ImportError, TypeError, AssertionError) as error:
            out["dcp_pinned_staging_error"] = str(error)
        return out

    def ranks(self, optimizer: Any) -> dict[str, Any]:
        """This rank's saves while every local rank saves its own (started together)."""
        ours, state = self.ours, self.state
        return {
            "rallypoint": self.timed(lambda i: ours.save(state, 1 + i)),
            "rallypoint_step": self.step_stall(optimizer),
        }

    def load(self) -> dict[str, Any]:
        import torch

        self.ours.save(self.state, 1)
        back = [torch.empty_like(t) for t in self.on_device]

        def h2d(i: int) -> None:
            for destination, source in zip(back, self.pinned, strict=True):
                destination.copy_(source, non_blocking=self.cuda)
            self.sync()

        self.floor()
        device = "cuda" if self.cuda else "cpu"
        path = self.scratch / "t.pt"
        out = {"floor_h2d": self.timed(h2d)}
        out["rallypoint_load"] = self.timed(lambda i: self.ours.load_latest(map_location=device))
        torch.save(self.state, path)
        out["torch_load"] = self.timed(
            lambda i: torch.load(path, map_location=device, weights_only=True), n=2
        )
        if self.cuda:
            out["register"] = self.registration()
        return out

    def registration(self) -> dict[str, Any]:
        """What ``cudaHostRegister`` costs per GB of a /dev/shm mapping (a slot's first save
        after a restart pays it; loads never do): 1 GiB, pinned and unpinned ``repeat`` times."""
        import mmap

        import torch

        from rallypoint.checkpoint import pinning

        size = 1 << 30
        fd = os.open(self.scratch / "pinned", os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
        os.close(fd)
        pointer = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
        device = torch.device("cuda", torch.cuda.current_device())
        pin, unpin = [], []
        for _ in range(self.repeat):
            began = time.perf_counter()
            pinning.register(pointer, size, device, "the benchmark's range")
            pin.append(time.perf_counter() - began)
            began = time.perf_counter()
            pinning.unregister(pointer, device)
            unpin.append(time.perf_counter() - began)
        (self.scratch / "pinned").unlink()
        return {"gb": size / 1e9, "pin": pin, "unpin": unpin}


def worker_env(memory: Path, local_rank: int = 0) -> dict[str, str]:
    """The environment of a ``rallypoint run --checkpoint-memory`` worker, for a child."""
    return common.clean_env(
        {
            "RALLYPOINT_MEMORY_TIER_DIR": str(memory),
            "LOCAL_RANK": str(local_rank),
            "RALLYPOINT_LOCAL_RANK": str(local_rank),
            "MASTER_ADDR": common.HOST,
            "MASTER_PORT": str(common.free_port()),
        }
    )


def _kill(process: subprocess.Popen[str]) -> None:
    """SIGKILL a child still running, with what it started (its session)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def child_command(args: argparse.Namespace, part: str, optimizer: str = "default") -> list[str]:
    spec = {"device": args.device, "layers": args.layers, "repeat": args.repeat}
    spec.update(part=part, optimizer=optimizer)
    return [sys.executable, __file__, "--child", json.dumps(spec)]


def result_of(part: str, code: int, stdout: str, stderr: str) -> dict[str, Any]:
    found = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if code != 0 or not found:
        raise SystemExit(
            f"the {part} measurement failed (exit {code}):\n{stdout}\n{stderr[-3000:]}"
        )
    return json.loads(found[-1].removeprefix("RESULT "))  # type: ignore[no-any-return]


def in_one_process(
    args: argparse.Namespace, part: str, optimizer: str = "default"
) -> dict[str, Any]:
    memory = Path(tempfile.mkdtemp(prefix="rallypoint-bench-gpu-", dir=SHM))
    (memory / "arena").mkdir()
    try:
        done = subprocess.run(
            child_command(args, part, optimizer), env=worker_env(memory),
            capture_output=True, text=True, timeout=1200, check=False,
        )  # fmt: skip
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    return result_of(f"{part} ({optimizer} AdamW)", done.returncode, done.stdout, done.stderr)


def all_ranks(args: argparse.Namespace) -> dict[str, Any]:
    """The stall with every local rank saving at once: one process per GPU (two on the
    CPU), each its own state into its own arena, started together; as many as
    /dev/shm has room for (three slots each)."""
    count = 2
    if args.device == "cuda":
        import torch

        count = torch.cuda.device_count()
    room = int(shutil.disk_usage(SHM).free // (3.3 * LAYER_BYTES * args.layers))
    ranks = max(1, min(count, room))
    memory = Path(tempfile.mkdtemp(prefix="rallypoint-bench-gpu-", dir=SHM))
    (memory / "arena").mkdir()
    children: list[subprocess.Popen[str]] = []
    bound = threading.Timer(900, lambda: [_kill(c) for c in children])
    try:
        for rank in range(ranks):
            with open(memory / f"rank{rank}.log", "w") as log:
                children.append(subprocess.Popen(
                    child_command(args, "ranks"), env=worker_env(memory, rank), stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                ))  # fmt: skip
        bound.start()
        ready = [c.stdout.readline() for c in children]  # type: ignore[union-attr]
        if not all(line.startswith("READY") for line in ready):
            for c in children:
                _kill(c)
        for c in children:  # every rank at once
            with contextlib.suppress(OSError, ValueError):
                c.stdin.write("go\n")  # type: ignore[union-attr]
                c.stdin.flush()  # type: ignore[union-attr]
        outputs = [c.communicate()[0] for c in children]
        logs = [(memory / f"rank{rank}.log").read_text() for rank in range(ranks)]
    finally:
        bound.cancel()
        for c in children:
            _kill(c)
        shutil.rmtree(memory, ignore_errors=True)
    found = [
        result_of(f"ranks (local rank {rank})", c.returncode, out, log)
        for rank, (c, out, log) in enumerate(zip(children, outputs, logs, strict=True))
    ]
    return {"gpus": count, "ranks": found}


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
    which, flags, mode, every = JOBS[name]
    work = Path(tempfile.mkdtemp(prefix="rallypoint-bench-gpu-"))
    memory = f"{args.memory_gb:g}GB"
    command = [
        *launcher(which), "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
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
    smi = shutil.which("nvidia-smi")
    results["gpu"] = "none"
    if smi is not None:
        results["gpu"] = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        ).stdout.strip()  # fmt: skip
    if "stall" in parts:
        results["stall"] = {}
        for optimizer in ("default", "fused"):
            print(f"measuring the stall, {optimizer} AdamW ...", flush=True)
            results["stall"][optimizer] = in_one_process(args, "stall", optimizer)
        print("measuring the stall, every local rank saving at once ...", flush=True)
        results["stall"]["ranks"] = all_ranks(args)
    if "load" in parts:
        print("measuring load ...", flush=True)
        results["load"] = in_one_process(args, "load")
    if "train" in parts:
        results["train"] = {}
        for name in JOBS:
            print(f"job {name} ...", flush=True)
            results["train"][name] = train_job(args, name)
    return results


def warm(runs: list[float]) -> list[float]:
    """The runs after the first (which pins or allocates what the others reuse)."""
    return runs[FIRST:] or runs


def step_stall(found: dict[str, Any]) -> dict[str, float]:
    """A ``step_stall`` measurement: the save's blocking, the extra time inside the next
    ``optimizer.step()``, and the loop's stall (both) - medians, in seconds."""
    blocked = statistics.median(found["blocked"])
    extra = statistics.median(found["in_step"]) - statistics.median(found["in_step_alone"])
    return {"blocked": blocked, "extra": max(0.0, extra), "stall": blocked + max(0.0, extra)}


def chart(results: dict[str, Any]) -> None:
    stall = results.get("stall", {}).get("default")
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # a GPU machine without it: the page's tables are the results
        print("matplotlib is not installed: no chart", flush=True)
        return
    if not stall:
        return
    figure, axis = common.figure(figsize=(7, 3.2))
    kinds = [k for k in LABELS if k in stall]
    values = [statistics.median(warm(stall[k]["blocked"])) for k in kinds]
    axis.barh(
        [LABELS[k] for k in kinds],
        values,
        color=["#2b7bba" if k.startswith("rallypoint") else "#999999" for k in kinds],
    )
    for y, value in enumerate(values):
        axis.annotate(f" {value:.3f} s", (value, y), va="center", fontsize=8)
    axis.set_xlabel("the loop held up by one save (median of the saves after the first)")
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
    stall = results.get("stall", {})
    gb = stall.get("default", results.get("load", {})).get("state_bytes", 0) / 1e9
    setup = common.measured(
        results,
        f"- GPU: {results.get('gpu')}; Python {results['python']}, torch {results['torch']}",
        f"- State: {results['layers']} TransformerEncoderLayers (d=1024) with AdamW, {gb:.2f} GB",
    )
    return {
        "setup": setup,
        "stall": stall_tables(stall) if stall else ["Not measured."],
        "load": load_table(results.get("load", {})),
        "train": train_table(results.get("train", {})),
    }


def stall_tables(stall: dict[str, Any]) -> list[str]:
    """The saves side by side (the first apart from the warm ones), then the loop's stall
    with the optimizer's step: each optimizer, and every local rank saving at once."""
    saves = stall["default"]
    floor = statistics.median(warm(saves["floor"]["blocked"]))
    rows = []
    for kind, label in LABELS.items():
        if kind in saves:
            runs, done = warm(saves[kind]["blocked"]), warm(saves[kind]["finished"])
            median = statistics.median(runs)
            rows.append([
                label, f"{saves[kind]['blocked'][0]:.3f} s", f"{median:.3f} s ({median / floor:.1f}x the floor)",
                f"{max(runs):.3f} s", f"{statistics.median(done):.3f} s",
            ])  # fmt: skip
    steps = []
    for optimizer, label in (("default", "AdamW"), ("fused", "AdamW(fused=True)")):
        if optimizer in stall:
            found = step_stall(stall[optimizer]["rallypoint_step"])
            refused = " (a save failed)" if stall[optimizer]["rallypoint_step"]["error"] else ""
            steps.append([
                f"{label}, one rank{refused}", f"{found['blocked']:.3f} s", f"{found['extra']:.3f} s", f"{found['stall']:.3f} s",
            ])  # fmt: skip
    ranks = stall.get("ranks", {}).get("ranks", [])
    if ranks:
        each = [step_stall(rank["rallypoint_step"]) for rank in ranks]
        slowest = max(each, key=lambda found: found["stall"])
        steps.append([
            f"AdamW, {len(ranks)} local ranks of {stall['ranks']['gpus']} at once (the slowest)", f"{slowest['blocked']:.3f} s",
            f"{slowest['extra']:.3f} s", f"{slowest['stall']:.3f} s",
        ])  # fmt: skip
    return [
        *common.table("save | first save | after the first: median | max | until complete", rows),
        "",
        *common.table(
            "asynchronous save, then step() | save returns | extra in step() | stall", steps
        ),
    ]


def load_table(load: dict[str, Any]) -> list[str]:
    if not load:
        return ["Not measured."]
    floor = statistics.median(load["floor_h2d"]["blocked"])
    ours = statistics.median(load["rallypoint_load"]["blocked"])
    plain = statistics.median(load["torch_load"]["blocked"])
    rows = [
        ["floor: H2D from pinned buffers", f"{floor:.3f} s"],
        ["rallypoint load_latest(map_location='cuda') from the arena", f"{ours:.3f} s ({ours / floor:.1f}x the floor)"],
        ["torch.load from /dev/shm", f"{plain:.3f} s"],
    ]  # fmt: skip
    if "register" in load:  # what a restarted worker's first save pays per GB of its slots
        per_gb = [seconds / load["register"]["gb"] for seconds in load["register"]["pin"]]
        unpin = [seconds / load["register"]["gb"] for seconds in load["register"]["unpin"]]
        rows.append(
            ["cudaHostRegister of a /dev/shm mapping, per GB", f"{statistics.median(per_gb):.3f} s"]
        )
        rows.append(["cudaHostUnregister, per GB", f"{statistics.median(unpin):.3f} s"])
    return common.table("load | seconds (median)", rows)


def train_table(train: dict[str, Any]) -> list[str]:
    jobs = []
    for name, job in train.items():
        if "error" in job:
            jobs.append([name, f"failed (exit {job['exit']})", "", "", "", ""])
            continue
        jobs.append([
            name, f"{job['step_seconds'] * 1000:.0f} ms", f"{job['stall_seconds'] * 1000:.0f} ms",
            f"{job['resumed_step']} ({job['resumed_from']})", str(job["redone"]), f"{job['gap_seconds']:.2f} s",
        ])  # fmt: skip
    if not jobs:
        return ["Not measured."]
    return common.table(
        "job | step time | save stall | resumed at (from) | steps redone | recovery gap", jobs
    )


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(json.loads(sys.argv[2]))
        return
    args = common.options(__doc__, **OPTIONS).parse_args()
    if args.device == "cpu" and not args.render_only:
        print(json.dumps(measure(args), indent=2))  # a dry run: nothing is published
        return
    common.publish(args, "gpu", "benchmarks-gpu", measure, chart, render)


if __name__ == "__main__":
    main()

"""How long a checkpoint save of a ~500 MB state blocks the training loop: rallypoint's
asynchronous mode against plain ``torch.save``, side by side in one run; the variants and
the method are on docs/benchmarks-checkpoint.md.

    .venv/bin/python benchmarks/bench_checkpoint.py [--repeat 5] [--size-mb 500]
    .venv/bin/python benchmarks/bench_checkpoint.py --render-only
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common

TARGET_RATIO = 0.20  # blocked time of an asynchronous save / a plain torch.save
SIDE = 2048  # every tensor is SIDE x SIDE float32: 16 MiB
SAVES = ("torch_save", "torch_save_fsync", "rallypoint_sync", "rallypoint_async")
LABELS = {
    "torch_save": "torch.save",
    "torch_save_fsync": "torch.save + fsync",
    "rallypoint_sync": "rallypoint, synchronous",
    "rallypoint_async": "rallypoint, asynchronous",
}
LOOPS = {"matmul": "matrix multiplies", "python": "pure Python"}
#: Every measurement of a round, by name (see Bench.measure).
VARIANTS = [*SAVES, *(f"loop_{kind}_{when}" for kind in LOOPS for when in ("alone", "with_save"))]
VARIANTS += ["copy_fresh", "copy_preallocated"]
SAVES_HEADER = "save | blocked s | written s | blocked / torch.save | fastest run: blocked s"
LOOPS_HEADER = (
    "loop | alone s | with a background save s | slowdown | write still running at the loop's end"
)
OPTIONS = {
    "repeat": (5, "runs per variant"),
    "size_mb": (500.0, "size of the state in MB"),
    "dir": ("", "where to write; '': a temporary directory"),
}
CACHE_POLICY = {
    True: "os.sync() then `echo 1 > /proc/sys/vm/drop_caches` before every measurement",
    False: "os.sync() before every measurement (the page cache could not be dropped: not root)",
}
MATMUL_SIDE = 1024
PYTHON_WORK = 20_000  # one iteration of the pure-Python loop: sum of squares below this


def make_state(size_mb: float) -> dict[str, Any]:
    """A model's state dict and its Adam state (two moments per parameter), like
    ``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": n}``."""
    import torch

    generator = torch.Generator().manual_seed(0)
    layers = max(1, round(size_mb * 1e6 / (3 * SIDE * SIDE * 4)))

    def tensor() -> Any:
        return torch.randn(SIDE, SIDE, generator=generator)

    model = {f"layers.{i}.weight": tensor() for i in range(layers)}
    optimizer = {
        "state": {
            i: {"step": torch.tensor(100.0), "exp_avg": tensor(), "exp_avg_sq": tensor()}
            for i in range(layers)
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(layers))}],
    }
    return {"model": model, "optimizer": optimizer, "step": 100}


def tensors(state: Any) -> list[Any]:
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in tensors(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in tensors(value)]
    return []


def drop_page_cache() -> bool:
    """Whether it could be dropped (as root only)."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("1\n")
    except OSError:
        return False
    return True


def sha256_mb_per_s() -> float:
    data = os.urandom(64 << 20)
    began = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return len(data) / 1e6 / (time.perf_counter() - began)


def disk_of(path: Path) -> str:
    done = subprocess.run(
        ["df", "--output=source,fstype", str(path)], capture_output=True, text=True
    )
    rows = done.stdout.split("\n")[1:]
    return " ".join(rows[0].split()) if rows and rows[0] else "unknown"


class Bench:
    """One state, one scratch directory, every variant measured on them."""

    def __init__(self, state: dict[str, Any], scratch: Path) -> None:
        import torch

        self.state = state
        self.scratch = scratch
        self.can_drop = drop_page_cache()
        self.step = 0
        self.matrix = torch.randn(MATMUL_SIDE, MATMUL_SIDE)
        self.product = torch.empty_like(self.matrix)
        # Touched now, so that copying into them measures the copy and not the page faults.
        self.buffers = [torch.empty_like(t).fill_(0) for t in tensors(state)]
        self.iterations = {"matmul": 1, "python": 1}

    def fresh(self, name: str) -> Path:
        """An empty directory for one measurement (the previous one's files removed)."""
        target = self.scratch / name
        if target.exists():
            shutil.rmtree(target)
        target.mkdir()
        return target

    def checkpointer(self, name: str) -> Any:
        from rallypoint.checkpoint.checkpointer import Checkpointer

        self.step += 1
        return Checkpointer(str(self.fresh(name)), rank=0, world_size=1)

    def settle(self) -> None:
        """Write back dirty pages, and drop the page cache if allowed: no measurement pays
        for another's writes."""
        gc.collect()
        os.sync()
        if self.can_drop:
            drop_page_cache()
        time.sleep(0.2)

    def timed(self, work: Callable[[], object], *keys: str) -> dict[str, float]:
        """Seconds ``work()`` took, under each of ``keys`` (what it returns is freed after)."""
        self.settle()
        began = time.perf_counter()
        result = work()
        seconds = time.perf_counter() - began
        del result
        return dict.fromkeys(keys, seconds)

    # Saves: "blocked" is how long the caller waits, "written" until the bytes are written.

    def torch_save(self) -> dict[str, float]:
        import torch

        path = self.fresh("torch_save") / "state.pt"
        return self.timed(lambda: torch.save(self.state, path), "blocked", "written")

    def torch_save_fsync(self) -> dict[str, float]:
        import torch

        path = self.fresh("torch_save_fsync") / "state.pt"

        def save() -> None:
            with open(path, "wb") as handle:
                torch.save(self.state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)

        return self.timed(save, "blocked", "written")

    def rallypoint_sync(self) -> dict[str, float]:
        checkpointer = self.checkpointer("rallypoint_sync")
        return self.timed(lambda: checkpointer.save(self.state, self.step), "blocked", "written")

    def rallypoint_async(self) -> dict[str, float]:
        return self.loop_with_save(None)

    # The training loop, alone and while an asynchronous save writes in the background.

    def run_loop(self, kind: str, iterations: int) -> None:
        import torch

        if kind == "matmul":
            for _ in range(iterations):
                torch.mm(self.matrix, self.matrix, out=self.product)
        else:
            for _ in range(iterations):
                sum(i * i for i in range(PYTHON_WORK))

    def loop_alone(self, kind: str) -> dict[str, float]:
        return self.timed(lambda: self.run_loop(kind, self.iterations[kind]), "loop")

    def loop_with_save(self, kind: str | None) -> dict[str, float]:
        """An asynchronous save, then (``kind``) the loop while it writes; then ``wait()``."""
        checkpointer = self.checkpointer("rallypoint_async" if kind is None else f"loop_{kind}")
        self.settle()
        began = time.perf_counter()
        checkpointer.save(self.state, self.step, asynchronous=True)
        times = {"blocked": time.perf_counter() - began}
        if kind is not None:
            self.run_loop(kind, self.iterations[kind])
            times["loop"] = time.perf_counter() - began - times["blocked"]
            staging = checkpointer._modes[True].stager  # where asynchronous saves are staged
            flying = staging.copier.in_flight()  # still writing at the loop's end?
            times["write_outlasted_loop"] = float(bool(flying))
        checkpointer.wait()
        return {**times, "written": time.perf_counter() - began}

    # Diagnostics: the copy an asynchronous save makes, into fresh or reused memory.

    def copy_fresh(self) -> dict[str, float]:
        return self.timed(lambda: [tensor.clone() for tensor in tensors(self.state)], "seconds")

    def copy_preallocated(self) -> dict[str, float]:
        def copy() -> None:
            for buffer, tensor in zip(self.buffers, tensors(self.state), strict=True):
                buffer.copy_(tensor)

        return self.timed(copy, "seconds")

    def measure(self, variant: str) -> dict[str, float]:
        """One measurement of ``variant``: a save, a copy, ``loop_KIND_alone`` or
        ``loop_KIND_with_save``."""
        if variant.startswith("loop_"):
            _, kind, when = variant.split("_", 2)
            return self.loop_alone(kind) if when == "alone" else self.loop_with_save(kind)
        result: dict[str, float] = getattr(self, variant)()
        return result

    def calibrate(self) -> dict[str, Any]:
        """Warm every path up once, then size each loop to last about as long as one
        background write, so that the write overlaps the whole loop."""
        self.torch_save()
        warm = self.rallypoint_async()
        self.copy_fresh()
        background = warm["written"] - warm["blocked"]
        per_iteration = {}
        for kind in LOOPS:
            self.iterations[kind] = 5
            self.run_loop(kind, 2)
            seconds = self.loop_alone(kind)["loop"] / 5
            per_iteration[kind] = seconds
            self.iterations[kind] = max(5, math.ceil(background / seconds))
        return {
            "background_write_seconds": background,
            "seconds_per_iteration": per_iteration,
            "iterations": dict(self.iterations),
        }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    git = common.git_state("core/rallypoint/checkpoint", "checkpointer.py")
    state = make_state(args.size_mb)
    scratch = Path(tempfile.mkdtemp(prefix="rallypoint-bench-checkpoint-", dir=args.dir or None))
    try:
        bench = Bench(state, scratch)
        calibration = bench.calibrate()
        print(f"calibration: {json.dumps(calibration)}", flush=True)
        show = lambda sample: ", ".join(f"{k} {v:.3f}" for k, v in sample.items())  # noqa: E731
        samples = common.rounds(args.repeat, VARIANTS, bench.measure, show)
        disk = disk_of(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "torch_threads": torch.get_num_threads(),
        "git": git,
        "cache_policy": CACHE_POLICY[bench.can_drop],
        "disk": disk,
        "sha256_mb_per_s": sha256_mb_per_s(),
        "repeat": args.repeat,
        "state_mb": sum(t.numel() * t.element_size() for t in tensors(state)) / 1e6,
        "tensors": len(tensors(state)),
        "calibration": calibration,
        "samples": samples,
        "summary": summarise(samples),
    }


def summarise(samples: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    medians = {
        name: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
        for name, runs in samples.items()
    }
    plain = medians["torch_save"]["blocked"]
    ratios = {name: medians[name]["blocked"] / plain for name in SAVES}
    paired = [
        a["blocked"] / t["blocked"]
        for a, t in zip(samples["rallypoint_async"], samples["torch_save"], strict=True)
    ]
    ratio = ratios["rallypoint_async"]
    return {
        "medians": medians,
        "blocked_over_torch_save": ratios,
        "async_over_torch_save_per_round": paired,
        "verdict": {"ratio": ratio, "met": ratio <= TARGET_RATIO},
    }


def chart(results: dict[str, Any]) -> None:
    medians = results["summary"]["medians"]
    figure, (saves, loops) = common.figure(
        1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [3, 2]}
    )
    names = list(SAVES)
    blocked = [medians[n]["blocked"] for n in names]
    rest = [medians[n]["written"] - medians[n]["blocked"] for n in names]
    colors = ["#777777", "#999999", "#6a9fcb", "#2b7bba"]
    positions = range(len(names))
    saves.bar(positions, blocked, color=colors, label="training loop blocked")
    saves.bar(
        positions, rest, bottom=blocked, color="#cfe0ef", hatch="//", edgecolor="#2b7bba",
        label="written in the background",
    )  # fmt: skip
    for x, (b, r) in enumerate(zip(blocked, rest, strict=True)):
        saves.annotate(f"{b:.2f} s", (x, b), ha="center", va="bottom", fontsize=8)
        if r > 0.01:
            saves.annotate(f"{b + r:.2f} s", (x, b + r), ha="center", va="bottom", fontsize=8)
    target = TARGET_RATIO * medians["torch_save"]["blocked"]
    saves.axhline(
        target, color="#d62728", linestyle="--", linewidth=1,
        label=f"target: {TARGET_RATIO:.0%} of torch.save ({target:.2f} s)",
    )  # fmt: skip
    saves.set_xticks(list(positions))
    saves.set_xticklabels([LABELS[n].replace(", ", "\n") for n in names], fontsize=8)
    saves.set_ylabel("seconds (median)")
    saves.set_title(f"Saving {results['state_mb']:.0f} MB", fontsize=10)
    saves.legend(fontsize=8, loc="upper left")
    saves.grid(True, axis="y", alpha=0.3)

    kinds = list(LOOPS)
    alone = [medians[f"loop_{k}_alone"]["loop"] for k in kinds]
    busy = [medians[f"loop_{k}_with_save"]["loop"] for k in kinds]
    width = 0.38
    loops.bar([i - width / 2 for i in range(len(kinds))], alone, width, color="#999999",
              label="loop alone")  # fmt: skip
    loops.bar([i + width / 2 for i in range(len(kinds))], busy, width, color="#2b7bba",
              label="while an asynchronous save writes")  # fmt: skip
    for i, (a, b) in enumerate(zip(alone, busy, strict=True)):
        loops.annotate(f"{b / a:.2f}x", (i + width / 2, b), ha="center", va="bottom", fontsize=8)
    loops.set_xticks(list(range(len(kinds))))
    loops.set_xticklabels(list(LOOPS.values()), fontsize=8)
    loops.set_ylabel("loop seconds (median)")
    loops.set_title("The loop during a background write", fontsize=10)
    loops.legend(fontsize=8, loc="lower right")
    loops.grid(True, axis="y", alpha=0.3)
    common.save(figure, "bench_checkpoint_blocked.png")


def render(results: dict[str, Any]) -> dict[str, list[str]]:
    summary, calibration = results["summary"], results["calibration"]
    medians, ratios = summary["medians"], summary["blocked_over_torch_save"]
    check = summary["verdict"]
    plain = medians["torch_save"]["blocked"]
    setup = common.measured(
        results,
        f"- Python {results['python']}, torch {results['torch']} "
        f"({results['torch_threads']} intra-op threads); rallypoint {results['git']}",
        f"- State: {results['state_mb']:.0f} MB in {results['tensors']} float32 tensors "
        f"(a model's weights and Adam's two moments), on the CPU",
        f"- Disk: {results['disk']}, a temporary directory; SHA-256 runs at "
        f"{results['sha256_mb_per_s']:.0f} MB/s here",
        f"- Page cache: {results['cache_policy']}",
        f"- Load average (1, 5, 15 min) before the run: {results['load_before']}; after: "
        f"{results['load_after']}",
    )
    saves = []
    for name in SAVES:
        fastest = min(s["blocked"] for s in results["samples"][name])
        times = [f"{medians[name][key]:.3f}" for key in ("blocked", "written")]
        saves.append([LABELS[name], *times, f"{ratios[name]:.1%}", f"{fastest:.3f}"])
    paired = ", ".join(f"{r:.1%}" for r in summary["async_over_torch_save_per_round"])
    fresh, preallocated = medians["copy_fresh"]["seconds"], medians["copy_preallocated"]["seconds"]
    copies = [
        ["into fresh tensors", f"{fresh:.3f}", f"{fresh / plain:.1%}"],
        [
            "into buffers allocated before (what `save` does, in the background)",
            f"{preallocated:.3f}",
            f"{preallocated / plain:.1%}",
        ],
    ]
    loops = []
    for kind, label in LOOPS.items():
        alone = medians[f"loop_{kind}_alone"]["loop"]
        busy = medians[f"loop_{kind}_with_save"]["loop"]
        runs = results["samples"][f"loop_{kind}_with_save"]
        outlasted = sum(s["write_outlasted_loop"] for s in runs)
        runs = f"{outlasted:.0f} of {results['repeat']} runs"
        loops.append([label, f"{alone:.3f}", f"{busy:.3f}", f"{busy / alone:.2f}x", runs])
    iterations = calibration["iterations"]
    return {
        "setup": setup,
        "saves": [
            f"Median of {results['repeat']} runs each, in seconds.",
            "",
            *common.table(SAVES_HEADER, saves),
            "",
            f"- Asynchronous: {medians['rallypoint_async']['blocked']:.3f} s blocked against "
            f"{plain:.3f} s for `torch.save`: **{check['ratio']:.1%}** (per round: {paired})",
            f"- Verdict: **{'met' if check['met'] else 'not met'}**",
        ],
        "copy": common.table("copy of the state | s | / torch.save", copies),
        "loop": [
            f"Sized in the warm-up, where one background write took "
            f"{calibration['background_write_seconds']:.2f} s: matrix multiplies "
            f"({MATMUL_SIDE}x{MATMUL_SIDE} float32) {iterations['matmul']} iterations, "
            f"pure Python (a sum of squares) {iterations['python']} iterations.",
            "",
            *common.table(LOOPS_HEADER, loops),
        ],
    }


def main() -> None:
    args = common.options(__doc__, **OPTIONS).parse_args()
    common.publish(args, "checkpoint", "benchmarks-checkpoint", measure, chart, render)


if __name__ == "__main__":
    main()

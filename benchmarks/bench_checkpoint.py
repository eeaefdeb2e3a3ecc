"""How long a checkpoint save of a ~500 MB state blocks the training loop: rallypoint's
asynchronous mode against plain ``torch.save``, side by side in one run.

    .venv/bin/python benchmarks/bench_checkpoint.py [--repeat 5] [--size-mb 500]
    .venv/bin/python benchmarks/bench_checkpoint.py --render-only

The state is a model's and its Adam optimizer's state dict of float32 tensors on the CPU,
written to a temporary directory on the local disk. Every round measures, in an order
that rotates from round to round so that machine noise hits every variant alike:

* ``torch.save(state, path)``: what a script does today; the loop waits for all of it;
* ``torch.save`` followed by an fsync of the file and its directory (what it takes for the
  bytes to be on the disk, as rallypoint's saves guarantee);
* ``Checkpointer.save(state, step)``: rallypoint, synchronous (temporary file, SHA-256,
  fsync, rename, manifest);
* ``Checkpointer.save(state, step, asynchronous=True)``: the time ``save`` blocks the
  caller, and the time until ``wait()`` returns (the background write is complete);
* a training loop (matrix multiplies; and a pure-Python loop, which needs the GIL) run
  alone and again right after an asynchronous save returns, while the write goes on in
  the background: how much the background thread slows the loop;
* diagnostics: copying the state into fresh CPU tensors (what the asynchronous save
  does while it blocks) and into buffers allocated beforehand.

Before every measurement the page cache is written back (``os.sync()``) and, when the
process may, dropped (``/proc/sys/vm/drop_caches``); the JSON says which was done.

Results go to ``benchmarks/results/checkpoint.json`` and ``docs/benchmarks-checkpoint.md``
with a chart in ``docs/img/bench_checkpoint_blocked.png``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
from common import IMAGES, ROOT

RESULTS = ROOT / "benchmarks" / "results" / "checkpoint.json"
REPORT = ROOT / "docs" / "benchmarks-checkpoint.md"
CHART = IMAGES / "bench_checkpoint_blocked.png"
TARGET_RATIO = 0.20  # blocked time of an asynchronous save / a plain torch.save
SIDE = 2048  # every tensor is SIDE x SIDE float32: 16 MiB
SAVES = ("torch_save", "torch_save_fsync", "rallypoint_sync", "rallypoint_async")
LABELS = {
    "torch_save": "torch.save",
    "torch_save_fsync": "torch.save + fsync",
    "rallypoint_sync": "rallypoint, synchronous",
    "rallypoint_async": "rallypoint, asynchronous",
}
LOOPS = ("matmul", "python")
MATMUL_SIDE = 1024
PYTHON_WORK = 20_000  # one iteration of the pure-Python loop: sum of squares below this


# --- the state and the machine ------------------------------------------------------------


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


class Cache:
    """Writes back dirty pages before a measurement, and drops the page cache if allowed."""

    def __init__(self) -> None:
        self.can_drop = self._drop()

    @staticmethod
    def _drop() -> bool:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as control:
                control.write("1\n")
        except OSError:
            return False
        return True

    @property
    def policy(self) -> str:
        if self.can_drop:
            return "os.sync() then `echo 1 > /proc/sys/vm/drop_caches` before every measurement"
        return "os.sync() before every measurement (the page cache could not be dropped: not root)"

    def settle(self) -> None:
        gc.collect()
        os.sync()
        if self.can_drop:
            self._drop()
        time.sleep(0.2)


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


# --- the measurements ---------------------------------------------------------------------


class Bench:
    """One state, one scratch directory, every variant measured on them."""

    def __init__(self, state: dict[str, Any], scratch: Path, cache: Cache) -> None:
        import torch

        self.state = state
        self.scratch = scratch
        self.cache = cache
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

    # Saves. Each returns seconds: "blocked" (the caller waits), "written" (on disk/cache).

    def torch_save(self) -> dict[str, float]:
        import torch

        path = self.fresh("torch_save") / "state.pt"
        self.cache.settle()
        began = time.perf_counter()
        torch.save(self.state, path)
        seconds = time.perf_counter() - began
        return {"blocked": seconds, "written": seconds}

    def torch_save_fsync(self) -> dict[str, float]:
        import torch

        path = self.fresh("torch_save_fsync") / "state.pt"
        self.cache.settle()
        began = time.perf_counter()
        with open(path, "wb") as handle:
            torch.save(self.state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        seconds = time.perf_counter() - began
        return {"blocked": seconds, "written": seconds}

    def rallypoint_sync(self) -> dict[str, float]:
        checkpointer = self.checkpointer("rallypoint_sync")
        self.cache.settle()
        began = time.perf_counter()
        checkpointer.save(self.state, self.step)
        seconds = time.perf_counter() - began
        return {"blocked": seconds, "written": seconds}

    def rallypoint_async(self) -> dict[str, float]:
        checkpointer = self.checkpointer("rallypoint_async")
        self.cache.settle()
        began = time.perf_counter()
        checkpointer.save(self.state, self.step, asynchronous=True)
        blocked = time.perf_counter() - began
        checkpointer.wait()
        return {"blocked": blocked, "written": time.perf_counter() - began}

    # The training loop, alone and with a background save.

    def run_loop(self, kind: str, iterations: int) -> None:
        import torch

        if kind == "matmul":
            for _ in range(iterations):
                torch.mm(self.matrix, self.matrix, out=self.product)
        else:
            for _ in range(iterations):
                sum(i * i for i in range(PYTHON_WORK))

    def loop_alone(self, kind: str) -> dict[str, float]:
        self.cache.settle()
        began = time.perf_counter()
        self.run_loop(kind, self.iterations[kind])
        return {"loop": time.perf_counter() - began}

    def loop_with_save(self, kind: str) -> dict[str, float]:
        checkpointer = self.checkpointer(f"loop_{kind}")
        self.cache.settle()
        began = time.perf_counter()
        checkpointer.save(self.state, self.step, asynchronous=True)
        blocked = time.perf_counter() - began
        loop_began = time.perf_counter()
        self.run_loop(kind, self.iterations[kind])
        loop = time.perf_counter() - loop_began
        pending = checkpointer._pending
        overlapped = pending is not None and pending.is_alive()  # still writing at the end
        checkpointer.wait()
        return {
            "blocked": blocked,
            "loop": loop,
            "written": time.perf_counter() - began,
            "write_outlasted_loop": float(overlapped),
        }

    # Diagnostics: what the asynchronous save does while the caller waits.

    def copy_fresh(self) -> dict[str, float]:
        from rallypoint.checkpoint.checkpointer import snapshot_to_cpu

        self.cache.settle()
        began = time.perf_counter()
        snapshot = snapshot_to_cpu(self.state)
        seconds = time.perf_counter() - began
        del snapshot
        return {"seconds": seconds}

    def copy_preallocated(self) -> dict[str, float]:
        self.cache.settle()
        began = time.perf_counter()
        for buffer, tensor in zip(self.buffers, tensors(self.state), strict=True):
            buffer.copy_(tensor)
        return {"seconds": time.perf_counter() - began}

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


def measure(bench: Bench, repeat: int) -> dict[str, list[dict[str, float]]]:
    steps: dict[str, Callable[[], dict[str, float]]] = {
        name: getattr(bench, name) for name in SAVES
    }
    for kind in LOOPS:
        steps[f"loop_{kind}_alone"] = lambda kind=kind: bench.loop_alone(kind)  # type: ignore[misc]
        steps[f"loop_{kind}_with_save"] = lambda kind=kind: bench.loop_with_save(kind)  # type: ignore[misc]
    steps["copy_fresh"] = bench.copy_fresh
    steps["copy_preallocated"] = bench.copy_preallocated
    order = list(steps)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in order}
    for index in range(repeat):
        shift = index % len(order)
        for name in order[shift:] + order[:shift]:
            sample = steps[name]()
            samples[name].append(sample)
            shown = ", ".join(f"{k} {v:.3f}" for k, v in sample.items())
            print(f"round {index + 1}/{repeat} {name:24} {shown}", flush=True)
    return samples


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
    slowdown = {
        kind: medians[f"loop_{kind}_with_save"]["loop"] / medians[f"loop_{kind}_alone"]["loop"]
        for kind in LOOPS
    }
    ratio = ratios["rallypoint_async"]
    return {
        "medians": medians,
        "blocked_over_torch_save": ratios,
        "async_over_torch_save_per_round": paired,
        "loop_slowdown": slowdown,
        "verdict": {
            "ratio": ratio,
            "target": TARGET_RATIO,
            "met": ratio <= TARGET_RATIO,
            "blocked_if_copy_preallocated": medians["copy_preallocated"]["seconds"] / plain,
        },
    }


# --- the report ---------------------------------------------------------------------------


def chart(results: dict[str, Any]) -> str:
    plt = common.pyplot()
    medians = results["summary"]["medians"]
    figure, (saves, loops) = plt.subplots(
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
    loops.set_xticklabels(["matrix multiplies", "pure Python"], fontsize=8)
    loops.set_ylabel("loop seconds (median)")
    loops.set_title("The loop during a background write", fontsize=10)
    loops.legend(fontsize=8, loc="lower right")
    loops.grid(True, axis="y", alpha=0.3)
    return common.save_chart(figure, CHART)


def render(results: dict[str, Any]) -> str:
    summary = results["summary"]
    medians, ratios, check = (
        summary["medians"],
        summary["blocked_over_torch_save"],
        summary["verdict"],
    )
    plain = medians["torch_save"]["blocked"]
    lines = [
        "# Checkpoint benchmark",
        "",
        "Generated by `benchmarks/bench_checkpoint.py`; do not edit by hand.",
        "",
        "How long does saving a checkpoint stop the training loop? A plain `torch.save` stops",
        "it for the whole write; rallypoint's asynchronous mode (`Checkpointer.save(state,",
        "step, asynchronous=True)`) stops it only while it takes a snapshot: for state in CPU",
        "memory, a fork of the worker (copy-on-write) that writes the checkpoint while the",
        "worker goes on; for state on a GPU, a copy to CPU memory written by a background",
        "thread. This machine has no GPU: the asynchronous rows are the fork.",
        "",
        f"- Measured: {results['date']} on {results['machine']}",
        f"- Python {results['python']}, torch {results['torch']} "
        f"({results['torch_threads']} intra-op threads); rallypoint {results['git']}",
        f"- State: {results['state_mb']:.0f} MB in {results['tensors']} float32 tensors "
        f"(a model's weights and Adam's two moments), on the CPU",
        f"- Disk: {results['disk']}, a temporary directory; SHA-256 runs at "
        f"{results['sha256_mb_per_s']:.0f} MB/s here",
        f"- Page cache: {results['cache_policy']}",
        f"- Load average (1, 5, 15 min) before the run: {results['load_before']}; after: "
        f"{results.get('load_after', 'n/a')}",
        f"- Command: `{results['command']}`",
        "",
        f"Median of {results['repeat']} runs each, in seconds. *Blocked* is how long the",
        "caller waits; *written* is until the checkpoint is complete (for the asynchronous",
        "save, until `wait()` returns).",
        "",
        "| save | blocked s | written s | blocked / torch.save | fastest run: blocked s |",
        "|---|---|---|---|---|",
    ]
    for name in SAVES:
        m = medians[name]
        fastest = min(s["blocked"] for s in results["samples"][name])
        lines.append(
            f"| {LABELS[name]} | {m['blocked']:.3f} | {m['written']:.3f} | {ratios[name]:.1%} "
            f"| {fastest:.3f} |"
        )
    paired = ", ".join(f"{r:.1%}" for r in summary["async_over_torch_save_per_round"])
    lines += [
        "",
        f"**Target:** an asynchronous save blocks the loop for at most {TARGET_RATIO:.0%} of a "
        "plain `torch.save`.",
        "",
        f"- Asynchronous: {medians['rallypoint_async']['blocked']:.3f} s blocked against "
        f"{plain:.3f} s for `torch.save`: **{check['ratio']:.1%}** (per round: {paired})",
        f"- Verdict: **{'met' if check['met'] else 'not met'}**",
        "",
        "## The other snapshot: a copy",
        "",
        "State on a GPU cannot be forked: the save copies every tensor into new CPU tensors",
        "(`snapshot_to_cpu`) and a thread writes them. What that copy costs for this state,",
        "and a copy into buffers allocated (and touched) beforehand, for comparison:",
        "",
        "| copy of the state | s | / torch.save |",
        "|---|---|---|",
        f"| into fresh tensors (what `save` does) | {medians['copy_fresh']['seconds']:.3f} | "
        f"{medians['copy_fresh']['seconds'] / plain:.1%} |",
        f"| into preallocated buffers | {medians['copy_preallocated']['seconds']:.3f} | "
        f"{check['blocked_if_copy_preallocated']:.1%} |",
        "",
        "## The training loop while the background write runs",
        "",
        "A loop of fixed work, sized to last about as long as one background write "
        f"({results['calibration']['background_write_seconds']:.2f} s in the warm-up), timed",
        "alone and again starting right after an asynchronous save returned. The matrix",
        f"multiply loop ({MATMUL_SIDE}x{MATMUL_SIDE} float32, "
        f"{results['calibration']['iterations']['matmul']} iterations) releases the GIL inside",
        "torch and competes for cores and memory bandwidth; the pure-Python loop "
        f"({results['calibration']['iterations']['python']} iterations of a sum of squares) "
        "needs a core of its own.",
        "",
        "| loop | alone s | with a background save s | slowdown | write still running at the "
        "loop's end |",
        "|---|---|---|---|---|",
    ]
    for kind, label in zip(LOOPS, ("matrix multiplies", "pure Python"), strict=True):
        alone = medians[f"loop_{kind}_alone"]["loop"]
        busy = medians[f"loop_{kind}_with_save"]["loop"]
        outlasted = sum(
            s["write_outlasted_loop"] for s in results["samples"][f"loop_{kind}_with_save"]
        )
        lines.append(
            f"| {label} | {alone:.3f} | {busy:.3f} | {busy / alone:.2f}x | "
            f"{outlasted:.0f} of {results['repeat']} runs |"
        )
    lines += (
        ["", "## Findings", "", *results.get("findings", []), ""]
        if results.get("findings")
        else [""]
    )
    lines += [
        "## Method",
        "",
        "Every variant runs once per round, in an order that rotates from round to round, on",
        "the same state. Each measurement writes into an empty directory (the previous one's",
        "files are removed before, untimed), after the page cache was written back (and",
        "dropped where allowed, see above), so no measurement pays for another's dirty pages.",
        "",
        "- `torch.save`: `torch.save(state, path)`; the file may still be only in the page",
        "  cache when it returns.",
        "- `torch.save + fsync`: the same into an open file, then `fsync` of the file and the",
        "  directory: the bytes are on the disk.",
        "- rallypoint: `Checkpointer(dir, rank=0).save(state, step)` writes `state.pt` to a",
        "  temporary file through a SHA-256 hashing writer, fsyncs and renames it, then writes",
        "  the manifest the same way; with `asynchronous=True` (the state is in CPU memory)",
        "  it forks a process that does the same, and returns; `wait()` waits for it.",
        "",
        f"The machine has {results['cpus']} CPUs and other work (test suites, type checkers of",
        "other sessions) ran on it during this measurement, so the numbers are noisy and the",
        "background writer competes with more than the benchmark's own loop. State on a GPU",
        "takes the copy path (device to host), which this CPU-only machine cannot measure.",
        "Every sample is in `benchmarks/results/checkpoint.json`.",
        "",
        "![Checkpoint saves: time blocked and time written](" + results["chart"] + ")",
        "",
        "## Rerun",
        "",
        "```",
        ".venv/bin/python benchmarks/bench_checkpoint.py               # 5 runs each, 500 MB",
        ".venv/bin/python benchmarks/bench_checkpoint.py --repeat 9 --size-mb 1000",
        ".venv/bin/python benchmarks/bench_checkpoint.py --render-only # page and chart from the JSON",
        "```",
        "",
        "Run it as root to drop the page cache between measurements; otherwise it only syncs.",
        "",
    ]
    return "\n".join(lines)


def findings(results: dict[str, Any]) -> list[str]:
    """What the numbers say, for the page: computed, so a rerun cannot contradict it."""
    summary = results["summary"]
    medians, check = summary["medians"], summary["verdict"]
    plain = medians["torch_save"]["blocked"]
    synced = medians["torch_save_fsync"]["blocked"]
    blocked = medians["rallypoint_async"]["blocked"]
    fresh = medians["copy_fresh"]["seconds"]
    preallocated = medians["copy_preallocated"]["seconds"]
    slow = summary["loop_slowdown"]
    out = [
        f"- The asynchronous save blocks for {blocked:.3f} s, the time to fork the worker: "
        "its memory is shared copy-on-write, so nothing is copied while training waits. "
        f"A copy of the state into fresh CPU tensors (the GPU path) takes {fresh:.2f} s "
        f"({fresh / plain:.0%} of `torch.save`), into buffers that already exist "
        f"{preallocated:.2f} s"
        + (
            " (most of a fresh copy's time is the kernel mapping and zeroing new pages)."
            if preallocated < 0.5 * fresh
            else "."
        ),
        f"- A plain `torch.save` returns once the bytes are in the page cache ({plain:.2f} s; "
        f"{synced:.2f} s with an fsync). rallypoint's synchronous save fsyncs and hashes "
        "(SHA-256) what it writes, which is why it is slower than both; the asynchronous "
        "save does the same work, off the training loop.",
        f"- The background write slows a matrix-multiply loop {slow['matmul']:.2f}x and a "
        f"pure-Python loop {slow['python']:.2f}x while it runs: the writer process "
        f"(pickling, SHA-256, write calls) takes one of the {results['cpus']} CPUs, which the "
        f"{results['torch_threads']} intra-op threads of the matrix multiplies were using. "
        "On a training node with more cores than busy threads this cost is smaller; it is "
        "the price of not blocking.",
    ]
    if not check["met"]:
        reuse = check["blocked_if_copy_preallocated"]
        out.append(
            f"- The target is missed ({check['ratio']:.1%} > {TARGET_RATIO:.0%}). Copying into "
            "CPU buffers allocated once and reused by every save (pinned memory for CUDA "
            f"tensors) would block for about {reuse:.1%} of `torch.save` here"
            + (
                "."
                if reuse <= TARGET_RATIO
                else ": better, still over the target. For state that lives in CPU memory, "
                "only a snapshot that copies nothing while the caller waits (a copy-on-write "
                "fork, or a copy staged in the background that blocks only when the state is "
                "next modified, at the optimizer step) can block for a fraction of a save that "
                "the page cache absorbs."
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per variant (default: 5)")
    parser.add_argument(
        "--size-mb", type=float, default=500.0, help="size of the state in MB (default: 500)"
    )
    parser.add_argument(
        "--dir", default=None, help="where to write (default: a temporary directory)"
    )
    common.add_render_only(parser, RESULTS)
    args = parser.parse_args()
    if args.render_only:
        saved: dict[str, Any] = json.loads(RESULTS.read_text())
        saved["chart"] = chart(saved)
        saved["findings"] = findings(saved)
        REPORT.write_text(render(saved) + "\n")
        common.wrote(REPORT, CHART)
        return

    import torch

    command = " ".join(["python", "benchmarks/bench_checkpoint.py", *sys.argv[1:]])
    git = common.git_state("core/rallypoint/checkpoint", "checkpointer.py")
    load_before = common.load_average()
    cache = Cache()
    state = make_state(args.size_mb)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors(state))
    scratch = Path(tempfile.mkdtemp(prefix="rallypoint-bench-checkpoint-", dir=args.dir))
    began = time.time()
    try:
        bench = Bench(state, scratch, cache)
        calibration = bench.calibrate()
        print(f"calibration: {json.dumps(calibration)}", flush=True)
        samples = measure(bench, args.repeat)
        disk = disk_of(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results: dict[str, Any] = {
        **common.measured_on(began),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "git": git,
        "command": command,
        "load_before": load_before,
        "load_after": common.load_average(),
        "cache_policy": cache.policy,
        "disk": disk,
        "sha256_mb_per_s": sha256_mb_per_s(),
        "repeat": args.repeat,
        "state_mb": state_bytes / 1e6,
        "tensors": len(tensors(state)),
        "calibration": calibration,
        "wall_seconds": time.time() - began,
        "samples": samples,
        "summary": summarise(samples),
    }
    results["findings"] = findings(results)
    results["chart"] = chart(results)
    common.write_results(RESULTS, results)
    REPORT.write_text(render(results) + "\n")
    print(json.dumps(results["summary"]["verdict"], indent=2))
    common.wrote(RESULTS, REPORT, CHART)


if __name__ == "__main__":
    main()

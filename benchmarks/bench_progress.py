"""The cost of the progress sources (``rallypoint.worker.progress_sources``) on a CPU
training step: goodput_train.py's model and step, without its sleep, timed in fresh
worker processes without them (``off``), with them and their reporter (``installed``), and
with them plus a global forward pre-hook on every module call (``global hook``: what the
sources' sampled hook avoids), the modes alternating round by round.

A step: a batch from a DataLoader, forward and backward on one CPU thread, the gradients
all-reduced (gloo, one rank: the collective's bookkeeping, without a peer's noise), an Adam
step. Then each source's cost per call, timed alone in the same processes.

    .venv/bin/python benchmarks/bench_progress.py [--repeat 15] [--steps 300]

Prints the tables and writes benchmarks/results/progress.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import common

MODES = ("off", "installed", "global hook")
WARMUP = 30
#: Calls per source when each is timed alone.
CALLS = 2000
#: Blocks of BLOCK steps, the sources bypassed and in place by turns (``installed`` only).
BLOCKS, BLOCK = 40, 10
TARGET = 0.01
OPTIONS = {
    "repeat": (15, "runs of each mode"),
    "steps": (300, "measured steps per run"),
    "hidden": (512, "hidden width of the model (goodput_train.py's)"),
    "timeout": (300.0, "seconds before a run is killed"),
}


# --- a worker ---------------------------------------------------------------------------------


def work(mode: str, steps: int, hidden: int) -> None:
    """One worker process: install (as a cold worker's sitecustomize does, before torch is
    imported), time the steps, then the calls; prints one ``BENCH {json}`` line."""
    # One CPU, the same for every run: the scheduler's moves are most of the noise.
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    if mode != "off":
        from rallypoint.worker import progress_sources

        progress_sources.install()
    import torch
    import torch.distributed as dist

    if mode == "global hook":
        torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(common.free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    step = _step(torch, dist, hidden, steps + WARMUP + BLOCKS * BLOCK)
    times = [_timed(step) for _ in range(steps + WARMUP)][WARMUP:]
    report = {
        "mode": mode,
        "step_median": statistics.median(times),
        "step_mean": statistics.fmean(times),
        "paired": _paired(step, torch, dist) if mode == "installed" else None,
        "calls": _calls(torch, dist),
        "armed": _armed(),
    }
    dist.destroy_process_group()
    print("BENCH " + json.dumps(report), flush=True)


def _step(torch: Any, dist: Any, hidden: int, batches: int) -> Callable[[], None]:
    """goodput_train.py's step, its batch from a DataLoader."""
    nn = torch.nn
    model = nn.Sequential(
        nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 256),
    )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    parameters = list(model.parameters())
    data = torch.utils.data.TensorDataset(torch.randn(batches * 64, 256))
    loader = iter(torch.utils.data.DataLoader(data, batch_size=64))

    def step() -> None:
        (batch,) = next(loader)
        loss = (model(batch) - batch).pow(2).mean()
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in parameters])
        dist.all_reduce(flat)
        offset = 0
        for p in parameters:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
        optimizer.zero_grad()

    return step


def _timed(step: Callable[[], None]) -> float:
    began = time.perf_counter()
    step()
    return time.perf_counter() - began


def _paired(step: Callable[[], None], torch: Any, dist: Any) -> dict[str, float]:
    """The step with the sources bypassed (their originals put back, the sampler stopped)
    and in place, block by block in this one process: the noise between processes (several
    per cent here) is larger than what is measured. The median step of each."""
    from rallypoint.worker import progress_sources as sources

    iterator = torch.utils.data.dataloader._BaseDataLoaderIter
    hooks = sys.modules["torch.optim.optimizer"]._global_optimizer_post_hooks
    ours = {key: hook for key, hook in hooks.items() if hook is sources._stepped}
    batch, all_reduce, register = iterator.__next__, dist.all_reduce, sources._Sampler.register

    def sources_in_place(on: bool) -> None:
        iterator.__next__ = batch if on else batch.__wrapped__
        dist.all_reduce = all_reduce if on else all_reduce.__wrapped__
        sources._Sampler.register = register if on else None
        for key, hook in ours.items():
            hooks[key] = hook
            if not on:
                del hooks[key]

    times: dict[bool, list[float]] = {False: [], True: []}
    for index in range(BLOCKS):
        on = index % 2 == 1
        sources_in_place(on)
        times[on] += [_timed(step) for _ in range(BLOCK)]
    sources_in_place(True)
    return {"bypassed": statistics.median(times[False]), "on": statistics.median(times[True])}


def _calls(torch: Any, dist: Any) -> dict[str, float]:
    """Each source's call, timed alone: the median over 5 blocks of CALLS, in µs."""
    import io

    tiny = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(tiny.parameters(), lr=0.0)
    tiny(torch.ones(1)).sum().backward()
    one = torch.ones(1)
    batches = iter(torch.utils.data.DataLoader(torch.ones(CALLS), batch_size=1))
    calls: dict[str, Callable[[], object]] = {
        "optimizer step": optimizer.step,
        "forward (Linear)": lambda: tiny(one),
        "DataLoader batch": lambda: next(batches),
        "all_reduce (1 float)": lambda: dist.all_reduce(one),
        "torch.save (small)": lambda: torch.save({"w": one}, io.BytesIO()),
    }
    timed = {}
    for name, call in calls.items():
        blocks = []
        for _ in range(5):
            began = time.perf_counter()
            for _ in range(CALLS // 5):
                call()
            blocks.append((time.perf_counter() - began) / (CALLS // 5))
        timed[name] = statistics.median(blocks) * 1e6
    return timed


def _armed() -> bool | None:
    progress = sys.modules.get("rallypoint.worker.progress")
    return None if progress is None else bool(progress.state.armed)


# --- the runs ---------------------------------------------------------------------------------


def run_once(mode: str, args: argparse.Namespace, receiver: Any, stacks: str) -> dict[str, Any]:
    """One worker in ``mode``; ``installed`` ones report to ``receiver`` as to an agent."""
    from rallypoint.worker import variables

    env = common.clean_env({"RANK": "0", "LOCAL_RANK": "0"})
    env.update(
        {
            variables.EVENTS_SOCKET: receiver.address,
            variables.PROGRESS_REPORTS: "0.5",
            variables.STACKS_FILE: stacks,
        }
    )
    command = [sys.executable, "-u", __file__, "--as-worker", mode, str(args.steps)]
    done = subprocess.run(
        [*command, str(args.hidden)], env=env, capture_output=True, text=True,
        timeout=args.timeout,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH ")]
    if done.returncode != 0 or not lines:
        return {"mode": mode, "returncode": done.returncode, "error": done.stderr[-2000:]}
    return {"returncode": 0, **json.loads(lines[-1].removeprefix("BENCH "))}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from rallypoint.worker.channel import Receiver

    reports: list[dict[str, Any]] = []
    receiver = Receiver(lambda name, data: None, progress=reports.append)
    try:
        with tempfile.TemporaryDirectory() as folder:
            stacks = os.path.join(folder, "stacks.txt")

            def once(mode: str) -> dict[str, Any]:
                return run_once(mode, args, receiver, stacks)

            def show(run: dict[str, Any]) -> str:
                if run["returncode"] != 0:
                    return f"failed: {run.get('error', '')[-300:]}"
                return f"step {run['step_median'] * 1e3:.3f} ms"

            runs = common.rounds(args.repeat, MODES, once, show)
    finally:
        receiver.close()
    return {"summary": summarise(runs), "runs": runs, "reports_received": len(reports)}


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        ok = [r for r in runs[mode] if r["returncode"] == 0]
        names = ok[0]["calls"] if ok else {}
        summary[mode] = {
            "runs": len(ok),
            "failed_runs": len(runs[mode]) - len(ok),
            "step_ms": common.median(r["step_median"] * 1e3 for r in ok),
            "step_ms_range": [f(r["step_median"] * 1e3 for r in ok) for f in (min, max)]
            if ok
            else None,
            "calls_us": {n: common.median(r["calls"][n] for r in ok) for n in names},
            "armed": sorted({r["armed"] for r in ok}, key=str),
        }
        paired = [r["paired"] for r in ok if r.get("paired")]
        if paired:
            ratios = [p["on"] / p["bypassed"] - 1 for p in paired]
            summary[mode]["paired_vs_bypassed"] = common.median(ratios)
    base = summary["off"]["step_ms"]
    for data in summary.values():
        step = data["step_ms"]
        data["vs_off"] = None if step is None or not base else step / base - 1
    return summary


def tables(results: dict[str, Any]) -> list[str]:
    summary = results["summary"]

    def pct(value: object) -> str:
        return f"{100 * value:+.2f} %" if isinstance(value, (int, float)) else "n/a"

    def spread(mode: str) -> str:
        low, high = summary[mode].get("step_ms_range") or (None, None)
        return f"{common.number(low, '', 3)} to {common.number(high, ' ms', 3)}"

    steps = [
        [mode, common.number(summary[mode]["step_ms"], " ms", 3), spread(mode),
         pct(summary[mode]["vs_off"])]
        for mode in MODES
    ]  # fmt: skip
    lines = [
        f"{results['repeat']} runs per mode, {results['steps']} steps each after {WARMUP} "
        f"warm-up steps, hidden {results['hidden']}; {results['reports_received']} reports "
        f"received; target: under {100 * TARGET:.0f} % of the step",
        "",
        *common.table("mode | median step | runs' medians | vs off", steps),
        "",
    ]
    off, on = summary["off"]["calls_us"], summary["installed"]["calls_us"]
    hooked = summary["global hook"]["calls_us"]
    rows = [
        [name, *(common.number(of[name], " µs", 2) for of in (off, on, hooked)),
         common.number(on[name] - off[name], " µs", 2)]
        for name in off
    ]  # fmt: skip
    paired = summary["installed"].get("paired_vs_bypassed")
    lines += [
        f"In one process, the sources in place against bypassed, {BLOCKS // 2} blocks of "
        f"{BLOCK} steps each by turns: {pct(paired)} (the median over the runs).",
        "",
    ]
    header = "call (timed alone) | off | installed | global hook | installed - off"
    lines += common.table(header, rows)
    # A step makes one optimizer step, takes one batch and all-reduces once; its forward
    # passes cost nothing more but one call per report interval (the sampled hook).
    added = sum(
        on[n] - off[n] for n in ("optimizer step", "DataLoader batch", "all_reduce (1 float)")
    )
    step = summary["off"]["step_ms"]
    if step:
        lines += [
            "",
            f"A step's calls add {added:.2f} µs: {100 * added / (step * 1e3):.3f} % of the step.",
        ]
    return lines


def main() -> None:
    if sys.argv[1:2] == ["--as-worker"]:  # --as-worker MODE STEPS HIDDEN: one worker
        work(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    args = common.options(__doc__, **OPTIONS).parse_args()
    results_file = common.RESULTS / "progress.json"
    if args.render_only:
        results = json.loads(results_file.read_text())
    else:
        began = time.time()
        results = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began)),
            "machine": f"{os.cpu_count()} CPUs",
            "command": common.command_line(),
            **{key: getattr(args, key) for key in ("repeat", "steps", "hidden")},
            **measure(args),
        }
        results_file.write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(tables(results)))


if __name__ == "__main__":
    main()

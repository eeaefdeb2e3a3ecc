"""Training with a checkpoint every step: a gloo all-reduce per step, and rank 0 saves its
state asynchronously after it (to node memory under ``--checkpoint-memory``).

Usage: mem_train.py STEPS [--step-seconds S] [--kill-rank R --kill-at STEP]
       [--tear-at STEP] [--stop-file PATH] [--megabytes MB]
       [--save-every N] [--busy-rank R --busy-seconds S]

With ``--save-every N`` rank 0 saves after every N-th step only. Every rank tells its
agent each step (``rallypoint.progress(step=...)``). Rank R of ``--busy-rank`` computes
S seconds more than the others before each step's all-reduce (a straggler).

Only a fresh start (nothing loaded) kills: rank R SIGKILLs itself in step STEP, after
its all-reduce (so rank 0 has saved the step before, and may be saving this one);
rank 0 at ``--tear-at`` SIGKILLs itself in the middle of copying that step's state into
its arena (a torn copy). Prints
``memory=PATH rank=R pid=P`` once, ``resumed source=S step=N`` after a load and ``done step=N world=W``
after each step.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

import rallypoint
from rallypoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int)
parser.add_argument("--step-seconds", type=float, default=0.05)
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--tear-at", type=int, default=-1)
parser.add_argument("--stop-file", default="")
parser.add_argument("--megabytes", type=float, default=0.01)
parser.add_argument("--save-every", type=int, default=1)
parser.add_argument("--busy-rank", type=int, default=-1)
parser.add_argument("--busy-seconds", type=float, default=0.0)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
memory = os.environ.get("RALLYPOINT_MEMORY_TIER_DIR", "")
print(f"memory={memory} rank={rank} pid={os.getpid()}", flush=True)
state = {"w": torch.zeros(max(1, int(args.megabytes * 1e6 / 4)))}
loaded = checkpoint.load_latest()
start = 0
if loaded is not None:
    state = loaded.state
    start = loaded.step + 1
    print(f"resumed source={loaded.source} step={loaded.step} world={world}", flush=True)
fresh = loaded is None


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


for step in range(start, args.steps):
    if rank == args.busy_rank:  # CPU time, not wall time: as slow on a loaded machine
        busy_until = time.process_time() + args.busy_seconds
        while time.process_time() < busy_until:
            pass
    # Every rank stops at the same step: the all-reduce tells them all of the stop file.
    stop = float(bool(args.stop_file) and os.path.exists(args.stop_file))
    total = torch.tensor([1.0, stop])
    dist.all_reduce(total)
    if total[1] > 0:
        break
    if fresh and rank == args.kill_rank and step == args.kill_at:
        die()  # after the all-reduce: rank 0's save of the step before has returned
    state["w"] += 1
    rallypoint.progress(step=step)  # rank 0's save would say it too; the others' would not
    if rank == 0 and (step + 1) % args.save_every == 0:
        if fresh and step == args.tear_at:  # killed by the copy, its record saying WRITING
            torch.Tensor.copy_ = lambda *args, **kwargs: die()  # type: ignore[method-assign]
        checkpoint.save(state, step, asynchronous=True)
    print(f"done step={step} world={world}", flush=True)
    time.sleep(args.step_seconds)
checkpoint.wait()
dist.destroy_process_group()

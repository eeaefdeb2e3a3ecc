"""The scale benchmark's training script (benchmarks/bench_scale.py): the same file under
torchrun and rallypoint.

A step all-reduces a 1 MB tensor over gloo, then sleeps until ``--step-seconds`` from its
start (the accelerator's share: the CPU waits while it computes). Every ``--save-every``
steps, and under ``rallypoint run`` also when the agent gives notice (a node got SIGTERM),
every rank calls ``rallypoint.checkpoint.save`` (rank 0 writes): to node memory under
``rallypoint run --checkpoint-memory``, to the directory ``RALLYPOINT_CHECKPOINT_URL``
names under torchrun. A new round resumes from the newest checkpoint.

Usage: scale_train.py [--steps N] [--step-seconds S] [--save-every N] [--tag TAG]

Each node's first worker (local rank 0) prints ``start tag=TAG rank=R local=0 world=W
pid=P at=T`` once, ``resumed step=N world=W rank=R at=T`` after a load, and
``done step=N world=W rank=R at=T`` after each step (T: wall time), before the step's
save: a save on notice holds the worker until its agent stops it.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

from rallypoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1_000_000)
parser.add_argument("--step-seconds", type=float, default=0.05)
parser.add_argument("--save-every", type=int, default=10)
parser.add_argument("--tag", default="")
args = parser.parse_args()

torch.set_num_threads(1)  # four workers share two cores
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
local = int(os.environ.get("LOCAL_RANK", "0"))
speaks = local == 0


def say(text: str) -> None:
    if speaks:
        print(f"{text} at={time.time():.3f}", flush=True)


say(f"start tag={args.tag} rank={rank} local={local} world={world} pid={os.getpid()}")
tensor = torch.zeros(256 * 1024)  # 1 MB of float32
start = 0
loaded = checkpoint.load_latest()
if loaded is not None:
    tensor.copy_(loaded.state["tensor"])
    start = loaded.step + 1
    say(f"resumed step={loaded.step} world={world} rank={rank}")

for step in range(start, args.steps):
    began = time.monotonic()
    tensor.fill_(float(step))
    dist.all_reduce(tensor)
    tensor /= world
    time.sleep(max(0.0, began + args.step_seconds - time.monotonic()))
    say(f"done step={step} world={world} rank={rank}")
    if checkpoint.should_save(step, every=args.save_every):
        checkpoint.save({"tensor": tensor}, step)
checkpoint.wait()
dist.destroy_process_group()

"""A job that saves every EVERY steps and when its agent gives notice (``should_save``).

Usage: notice_steps.py STEP_SECONDS EVERY [TAG] [cuda]   (TAG is ignored: tests find
workers by it; ``cuda``: the state on the GPU, NCCL between the ranks, saved asynchronously)

Prints ``resumed step=N`` after a load and ``step=N rank=R world=W at=T`` after each step.
"""

import sys
import time

import torch
import torch.distributed as dist

from rallypoint import checkpoint

step_seconds, every = float(sys.argv[1]), int(sys.argv[2])
cuda = "cuda" in sys.argv[3:]
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
weight = torch.zeros(4, device=device)
step = 0
loaded = checkpoint.load_latest(map_location=device)
if loaded is not None:
    weight, step = loaded.state["weight"], loaded.step
    print(f"resumed step={step} rank={rank} world={world} from={loaded.source}", flush=True)
while True:
    began = time.monotonic()
    grad = torch.ones(4, device=device)
    dist.all_reduce(grad)
    weight += grad
    step += 1
    print(f"step={step} rank={rank} world={world} at={time.time():.3f}", flush=True)
    if checkpoint.should_save(step, every=every):
        checkpoint.save({"weight": weight}, step, asynchronous=cuda)
    time.sleep(max(0.0, step_seconds - (time.monotonic() - began)))

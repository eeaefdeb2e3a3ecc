"""Train-like loop: an all-reduce every 0.2 s for SECONDS, printing the world size (and
the worker's pid: benchmarks/bench_recovery.py tells a restarted worker's steps by it).

Usage: steps.py SECONDS [TAG]   (TAG is ignored: tests find their workers by it)
"""

import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    value = torch.tensor([1.0])
    dist.all_reduce(value)
    print(
        f"step rank={rank} world={world} sum={int(value.item())} at={time.time():.3f} "
        f"pid={os.getpid()}",
        flush=True,
    )
    time.sleep(0.2)
print(f"done rank={rank} world={world}", flush=True)
dist.destroy_process_group()

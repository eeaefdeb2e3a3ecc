"""Train-like loop until told to stop: an all-reduce every 0.2 s, printing the world size,
until the file STOP exists. The ranks agree through the all-reduce, so that they stop at
the same step. A worker that trains for 300 s without being told exits 1 (a safety net).

Usage: train_until.py STOP   (STOP's path also makes the command line unique to the test)
"""

import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
stop = sys.argv[1]
end = time.monotonic() + 300
while True:
    value = torch.tensor([1.0, float(os.path.exists(stop))])
    dist.all_reduce(value)
    print(
        f"step rank={rank} world={world} sum={int(value[0].item())} at={time.time():.3f}",
        flush=True,
    )
    if value[1].item() > 0:
        break
    if time.monotonic() > end:
        sys.exit(1)
    time.sleep(0.2)
print(f"done rank={rank} world={world}", flush=True)
dist.destroy_process_group()

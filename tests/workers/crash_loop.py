"""Fail every attempt before ``CRASHES``: ``crash_loop.py CRASHES``; then all-reduce and end."""

import os
import sys
import time

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
print(f"attempt={attempt} rank={dist.get_rank()} at={time.time():.6f}", flush=True)
if attempt < int(sys.argv[1]) and dist.get_rank() == 1:
    sys.exit(1)
total = torch.tensor([1.0])
dist.all_reduce(total)
print(f"done rank={dist.get_rank()} attempt={attempt} sum={total.item():g}", flush=True)

"""A worker that imports torch, joins its process group, all-reduces once, says so, then
stays until its launcher stops it: the memory benchmark measures it meanwhile."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"resident rank={os.environ['RANK']} pid={os.getpid()}", flush=True)
time.sleep(600)

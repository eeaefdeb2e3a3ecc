"""Deterministic DDP training with checkpoints: every step's batch comes from the step
number, so a run that crashes and resumes ends with the same weights as one that did not.

Usage: ckpt_train.py STEPS OUT [--kill-at STEP] [--save-every N] [--asynchronous]
Rank 1 SIGKILLs itself at --kill-at in the first attempt; rank 0 writes the final weights
to OUT (torch.save).
"""

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rallypoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int)
parser.add_argument("out")
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--save-every", type=int, default=5)
parser.add_argument("--asynchronous", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
ddp = DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

start = 0
loaded = checkpoint.load_latest()
if loaded is not None:
    model.load_state_dict(loaded.state["model"])
    optimizer.load_state_dict(loaded.state["optimizer"])
    start = loaded.step + 1
print(f"rank={rank} attempt={attempt} start={start}", flush=True)

for step in range(start, args.steps):
    if rank == 1 and attempt == 0 and step == args.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    generator = torch.Generator().manual_seed(step * 100 + rank)
    inputs = torch.randn(32, 8, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
    loss.backward()
    optimizer.step()
    if step % args.save_every == 0:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        checkpoint.save(state, step, asynchronous=args.asynchronous)

checkpoint.wait()
if rank == 0:
    torch.save(model.state_dict(), args.out)
dist.destroy_process_group()

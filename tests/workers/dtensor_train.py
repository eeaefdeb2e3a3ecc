"""Training with a sharded state saved every step: a weight sharded by rows over every
rank (``DTensor``, ``Shard(0)``) and a replicated one, both raised by 1 each step, and the
step count as a plain leaf. Every rank saves its share with ``save_sharded``, and a fresh
start's rank R of ``--kill-rank`` SIGKILLs itself right after every rank's save of
``--kill-at`` returned.

Usage: dtensor_train.py STEPS [--kill-rank R --kill-at STEP] [--rows N] [--tag TAG]
Prints ``resumed source=S step=N world=W`` after a load, checks that every element of the
loaded state is the step's, and ``done step=N world=W rows=R`` after each step (R: the rows
this rank holds).
"""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from rallypoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int)
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--rows", type=int, default=6)
parser.add_argument("--tag", help="unused: makes the workers' command lines unique")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))


def fresh(value: float) -> dict:
    return {
        "weight": distribute_tensor(torch.full((args.rows, 4), value), mesh, [Shard(0)]),
        "bias": distribute_tensor(torch.full((3,), value), mesh, [Replicate()]),
        "meta": {"step": -1, "betas": (0.9, 0.99)},
    }


checkpointer = checkpoint.default()
state = fresh(0.0)
start = 0
loaded = checkpointer.load_sharded(state)
if loaded is not None:
    start = loaded.step + 1
    value = float(start)  # the state after step N is N + 1 everywhere
    whole = state["weight"].full_tensor()
    assert tuple(whole.shape) == (args.rows, 4), whole.shape
    assert torch.equal(whole, torch.full_like(whole, value)), whole
    assert torch.equal(state["bias"].to_local(), torch.full((3,), value)), state["bias"]
    assert state["meta"] == {"step": loaded.step, "betas": (0.9, 0.99)}, state["meta"]
    print(f"resumed source={loaded.source} step={loaded.step} world={world}", flush=True)

for step in range(start, args.steps):
    with torch.no_grad():
        state["weight"] += 1
        state["bias"] += 1
    state["meta"]["step"] = step
    checkpointer.save_sharded(state, step)
    if loaded is None and step == args.kill_at:
        # Once every rank's save returned: else the agent may stop a slower rank inside
        # its save when this one dies, and the newest step all ranks hold is the one before.
        dist.barrier()
        if rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # right after the saves returned
    rows = state["weight"].to_local().shape[0]
    print(f"done step={step} world={world} rows={rows}", flush=True)
    dist.barrier()
checkpointer.wait()
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as sharded.py: no interpreter teardown after torch.distributed.checkpoint

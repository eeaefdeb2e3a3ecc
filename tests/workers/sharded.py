"""Sharded checkpoints through torch.distributed.checkpoint, on every rank.

Usage: sharded.py save STEP VALUE | sharded.py load
"save" fills each rank's tensor "shard" with VALUE + rank and saves the state sharded;
"load" loads the newest valid sharded checkpoint into fresh tensors and prints them.
"""

import os
import sys

import torch
import torch.distributed as dist

from rallypoint import checkpoint

dist.init_process_group("gloo")
rank = dist.get_rank()
checkpointer = checkpoint.default()
if sys.argv[1] == "save":
    step, value = int(sys.argv[2]), float(sys.argv[3])
    state = {f"shard{rank}": torch.full((4,), value + rank)}
    checkpointer.save_sharded(state, step)
else:
    state = {f"shard{rank}": torch.zeros(4)}
    loaded = checkpointer.load_sharded(state)
    assert loaded is not None, "no sharded checkpoint"
    print(f"rank={rank} step={loaded.step} value={state[f'shard{rank}'][0].item():g}", flush=True)
dist.barrier()  # leave together: gloo can abort a process that tears down while a peer works
dist.destroy_process_group()
# Done: leave without the interpreter's teardown. There, after a load through
# torch.distributed.checkpoint, a worker aborted in C++ ("terminate called without an
# active exception", SIGABRT) in one run of this test in six (torch 2.13, gloo): a torch
# exit-time fault, not what this worker is here to test.
sys.stdout.flush()
os._exit(0)

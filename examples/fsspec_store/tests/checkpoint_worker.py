"""A worker for the end-to-end test: resume from the newest checkpoint, or save a few.

Usage: checkpoint_worker.py STEPS OUT_DIR

Every rank loads the newest checkpoint, and on a fresh start rank 0 then saves steps
0..STEPS-1 (the state of step s: three values, each s); every rank writes what it found to
OUT_DIR/rank<RANK>.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from rallypoint import checkpoint

steps, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()

loaded = checkpoint.load_latest()
report = {
    "url": os.environ[checkpoint.URL_ENV],
    "storage": type(checkpoint.default().storage).__name__,
    "loaded_step": None if loaded is None else loaded.step,
    "state": None if loaded is None else loaded.state["w"].tolist(),
}
dist.barrier()  # every rank has loaded before rank 0 saves anything new
if loaded is None:
    for step in range(steps):
        checkpoint.save({"w": torch.full((3,), float(step))}, step)

with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump(report, handle)

dist.destroy_process_group()

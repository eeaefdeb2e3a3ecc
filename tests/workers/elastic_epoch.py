"""Read part of an epoch through ElasticSampler on every rank and report what each rank saw.

Usage: elastic_epoch.py STATE OUT --size N --batch-size B [--steps K] [--seed S]

Every rank loads the sampler position from STATE (JSON) when it exists and takes at most K
batches (all that is left of the epoch without --steps). Rank 0 then writes OUT, JSON
``{"world": w, "seen": [indices of rank 0, of rank 1, ...], "state": state_dict,
"agent_modules": [rallypoint.agent modules imported in this worker]}``, and
saves the sampler's state to STATE for the next run. There is no collective per step (the
last step of an epoch may leave a rank without a batch): docs/elastic-data.md's example, run
by tests/test_data.py, covers DDP over that uneven tail with join().
"""

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.utils.data import DataLoader

from rallypoint.data import ElasticSampler

parser = argparse.ArgumentParser()
parser.add_argument("state", type=Path)
parser.add_argument("out", type=Path)
parser.add_argument("--size", type=int, required=True)
parser.add_argument("--batch-size", type=int, required=True)
parser.add_argument("--steps", type=int)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
sampler = ElasticSampler(range(args.size), seed=args.seed)
assert (sampler.rank, sampler.world_size) == (rank, world)
if args.state.exists():
    sampler.load_state_dict(json.loads(args.state.read_text()))
loader = DataLoader(range(args.size), batch_size=args.batch_size, sampler=sampler)

seen: list[int] = []
for batch in itertools.islice(loader, args.steps):
    seen += batch.tolist()
    sampler.advance(args.batch_size)

everyone: list[list[int] | None] = [None] * world
dist.all_gather_object(everyone, seen)
if rank == 0:
    # Rank 0 holds the largest share of an uneven tail: its position is the job's.
    state = sampler.state_dict()
    temporary = args.state.with_suffix(".tmp")
    temporary.write_text(json.dumps(state))
    os.replace(temporary, args.state)
    agent = [name for name in sys.modules if name.startswith("rallypoint.agent")]
    report = {"world": world, "seen": everyone, "state": state, "agent_modules": agent}
    args.out.write_text(json.dumps(report))
dist.destroy_process_group()

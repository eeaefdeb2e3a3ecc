"""A slow elastic training loop for fault tests: ElasticSampler batches, one collective and
one checkpoint (rallypoint.checkpoint) per step, resumable at any world size.

Usage: elastic_train.py OUT --size N --batch-size B [--epochs E] [--step-seconds S] [--hold F]

Every step each rank takes its batch, the ranks all-gather the batches (the collective that
notices a lost peer), every rank advances the sampler, and rank 0 saves the checkpoint:
``{"sampler": state_dict, "seen": [indices the job took in epoch 0, in epoch 1, ...],
"worlds": [...], "step": n}``. A restarted round resumes from the newest checkpoint, so ``seen`` counts only
the steps of the rounds the job continued from. At the end rank 0 writes OUT, JSON
``{"seen": [...], "steps": n, "worlds": [world size of each round it resumed in]}``.

Each rank prints ``step=N epoch=E consumed=C rank=R world=W at=WALL`` after every step, and
``sigterm rank=R`` when it is stopped by SIGTERM (it then exits at once with 143). With
``--hold F`` the ranks wait before the job's last step while the file F exists (printing
``holding rank=R world=W``): a test decides when the job may end, whatever the machine's load.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path
from types import FrameType

import torch.distributed as dist
from torch.utils.data import DataLoader

from rallypoint import checkpoint
from rallypoint.data import ElasticSampler

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--size", type=int, required=True)
parser.add_argument("--batch-size", type=int, required=True)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--step-seconds", type=float, default=0.1)
parser.add_argument("--hold", type=Path)
args = parser.parse_args()


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    # The agent stops workers with SIGTERM: say so and leave without running the process
    # group's destructors (a peer may be gone).
    print(f"sigterm rank={os.environ.get('RANK')}", flush=True)
    os._exit(128 + signal.SIGTERM)


dist.init_process_group("gloo")
# After init_process_group: a Python handler only runs between bytecodes, and one set
# earlier would keep the worker from stopping while it waits in there for its peers.
signal.signal(signal.SIGTERM, on_sigterm)
rank, world = dist.get_rank(), dist.get_world_size()
sampler = ElasticSampler(range(args.size), seed=3)
seen: list[list[int]] = []
worlds: list[int] = []
step = 0
loaded = checkpoint.load_latest()
if loaded is not None:
    sampler.load_state_dict(loaded.state["sampler"])
    seen, worlds, step = loaded.state["seen"], loaded.state["worlds"], loaded.state["step"]
worlds = [*worlds, world]
print(f"resumed rank={rank} world={world} step={step} at={time.time():.3f}", flush=True)

for epoch in range(sampler.epoch, args.epochs):
    sampler.set_epoch(epoch)
    while len(seen) <= epoch:
        seen.append([])
    batches = iter(DataLoader(range(args.size), batch_size=args.batch_size, sampler=sampler))
    # The ranks advance together, so they agree on what is left; a rank short of a batch in
    # the epoch's last step contributes an empty one.
    while sampler.remaining > 0:
        last = epoch == args.epochs - 1 and sampler.remaining <= world * args.batch_size
        if last and args.hold is not None and args.hold.exists():
            print(f"holding rank={rank} world={world}", flush=True)
            while args.hold.exists():  # until the test removes it, or stops the job
                time.sleep(0.05)
        batch = next(batches, None)
        everyone: list[list[int] | None] = [None] * world
        dist.all_gather_object(everyone, [] if batch is None else batch.tolist())
        sampler.advance(args.batch_size)
        step += 1
        seen[epoch] += [index for share in everyone for index in share or []]
        state = {"sampler": sampler.state_dict(), "seen": seen, "worlds": worlds, "step": step}
        checkpoint.save(state, step)
        print(
            f"step={step} epoch={epoch} consumed={sampler.consumed} rank={rank} world={world} "
            f"at={time.time():.3f}",
            flush=True,
        )
        time.sleep(args.step_seconds)

dist.barrier()
if rank == 0:
    temporary = args.out.with_suffix(".tmp")
    temporary.write_text(json.dumps({"seen": seen, "steps": step, "worlds": worlds}))
    os.replace(temporary, args.out)
print(f"done rank={rank} world={world} step={step}", flush=True)
dist.destroy_process_group()

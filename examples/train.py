"""A small data-parallel training job that survives a crash and resumes from a checkpoint.

Runs unchanged under torchrun or rallypoint:

    rallypoint run --standalone --nproc-per-node 2 --max-restarts 2 \
        --checkpoint-dir /tmp/ckpt examples/train.py --steps 60 --crash-at 25

Each worker trains a shared two-layer network on its shard of a synthetic regression
problem (DistributedDataParallel over gloo, so it runs on CPU). Rank 0 saves a checkpoint
every ``--save-every`` steps (written to a temporary file, then renamed, so a crash never
leaves a torn one); on start every rank loads the newest checkpoint and continues from its
step. ``--crash-at`` makes rank 1 fail once, in the first attempt, to show the recovery.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rallypoint import record


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--crash-at", type=int, default=-1, help="rank 1 fails once at this step")
    parser.add_argument(
        "--checkpoint-dir",
        default=os.environ.get("RALLYPOINT_CHECKPOINT_URL", ""),
        help="where to keep checkpoints (default: rallypoint's --checkpoint-dir)",
    )
    return parser.parse_args()


def make_data(seed: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression problem: y = tanh(x . w / 4) plus a little noise."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(count, 16, generator=generator)
    weights = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
    targets = torch.tanh(inputs @ weights / 4) + 0.01 * torch.randn(count, 1, generator=generator)
    return inputs, targets


def save(path: Path, state: dict[str, object]) -> None:
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    os.replace(partial, path)  # atomic: a reader sees the old file or the new one


@record
def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checkpoint = Path(args.checkpoint_dir) / "checkpoint.pt" if args.checkpoint_dir else None
    if checkpoint is not None:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)

    start = 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        if rank == 0:
            print(f"attempt {attempt}: resuming from the checkpoint of step {start}", flush=True)
    elif rank == 0:
        print(f"attempt {attempt}: starting from scratch, {world} workers", flush=True)

    inputs, targets = make_data(seed=rank, count=args.batch_size * args.steps)
    began = time.monotonic()
    for step in range(start, args.steps):
        if rank == 1 and attempt == 0 and step == args.crash_at:
            raise RuntimeError(f"simulated crash of rank 1 at step {step}")
        batch = slice(step * args.batch_size, (step + 1) * args.batch_size)
        loss = nn.functional.mse_loss(model(inputs[batch]), targets[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done = step + 1
        if rank == 0 and (done % args.save_every == 0 or done == args.steps):
            if checkpoint is not None:
                state = {"model": model.module.state_dict(), "step": done}
                save(checkpoint, {**state, "optimizer": optimizer.state_dict()})
            print(f"step {done:4d}/{args.steps}  loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(
            f"finished {args.steps - start} steps in {time.monotonic() - began:.2f} s", flush=True
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

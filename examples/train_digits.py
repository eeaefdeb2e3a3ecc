"""Train a small classifier on scikit-learn's digits, elastically: it survives a crash and
resumes from the newest checkpoint, at the same or at a different world size.

    rallypoint run --standalone --nproc-per-node 2 --max-restarts 2 \
        --checkpoint-dir /tmp/digits examples/train_digits.py --crash-at 60

The same script runs unchanged under torchrun. The checkpoint location is
``--checkpoint-dir``, which defaults to the one rallypoint passes to its workers
(``RALLYPOINT_CHECKPOINT_URL``); with neither, the script trains from scratch and saves
nothing. See examples/README.md for the multi-node command lines.

What makes it elastic, in order of appearance below:

- the learning rate is ``--lr`` per worker times the world size (linear scaling), computed
  for the current round, not taken from the checkpoint;
- ``rallypoint.data.ElasticSampler`` keeps one data order per epoch and a count of the
  samples the job has used; the count goes into the checkpoint, so a restart at any world
  size goes on where the job stopped, without repeating or skipping a sample;
- every ``--save-every`` steps rank 0 saves model, optimizer and sampler state with
  ``rallypoint.checkpoint`` in the background; every rank loads the newest intact one.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from rallypoint import checkpoint, metrics, record
from rallypoint.data import ElasticSampler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05, help="per worker; scaled by world size")
    parser.add_argument("--save-every", type=int, default=25, help="steps between checkpoints")
    parser.add_argument("--log-every", type=int, default=50, help="steps between loss lines")
    parser.add_argument("--crash-at", type=int, default=-1, help="rank 1 fails once at this step")
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.0,
        help="make each step take at least this long, to follow a demo as it runs (default: "
        "as fast as it goes)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=os.environ.get(checkpoint.URL_ENV, ""),
        help="where to keep checkpoints (default: rallypoint run's --checkpoint-dir; "
        "without one, nothing is saved or resumed)",
    )
    return parser.parse_args()


def load_data(device: torch.device) -> tuple[TensorDataset, TensorDataset]:
    """8x8 images of digits, bundled with scikit-learn: 1437 to train on, 360 held out."""
    images, labels = load_digits(return_X_y=True)
    train_x, test_x, train_y, test_y = train_test_split(
        images / 16.0, labels, test_size=0.2, random_state=0, stratify=labels
    )

    def tensors(x: object, y: object) -> TensorDataset:
        inputs = torch.as_tensor(x, dtype=torch.float32, device=device)
        return TensorDataset(inputs, torch.as_tensor(y, dtype=torch.long, device=device))

    return tensors(train_x, train_y), tensors(test_x, test_y)


#: Where ``load_latest`` found the checkpoint (``Checkpoint.source``), as the log says it.
WHERE = {
    "memory": "in memory",
    "peer": "from another node's memory",
    "durable": "in --checkpoint-dir",
}


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler
) -> dict[str, object]:
    """What a restart needs; the step is the checkpoint's name."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": sampler.state_dict(),  # the epoch and how much of it the job has used
    }


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


@record  # an uncaught exception reaches rallypoint's (and torchrun's) failure report
def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    train(args, device)
    # The DDP model holds the process group. Collected after the group is destroyed, it would
    # end gloo's threads holding the GIL, which can hang (pytorch/pytorch#56297).
    gc.collect()
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    # The restart count is set by rallypoint and torchrun alike; 0 in the first attempt.
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    train_set, test_set = load_data(device)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # drop_last: every rank gets the same number of batches, so no rank waits in an
    # all-reduce that the others never join (at most world-1 samples an epoch are left out).
    sampler = ElasticSampler(train_set, rank=rank, world_size=world, seed=0, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    store = checkpoint.Checkpointer(args.checkpoint_dir) if args.checkpoint_dir else None
    step = 0  # steps the job has taken, over every attempt; a checkpoint is named by it
    loaded = store.load_latest(map_location=device) if store is not None else None
    if loaded is not None:
        model.load_state_dict(loaded.state["model"])
        optimizer.load_state_dict(loaded.state["optimizer"])
        sampler.load_state_dict(loaded.state["sampler"])
        step = loaded.step
        log(
            f"attempt {attempt}: resuming from the checkpoint of step {step} {WHERE[loaded.source]} "
            f"(saved at world size {loaded.world_size}, now {world}): epoch {sampler.epoch}, "
            f"{sampler.consumed}/{len(train_set)} samples of it done"
        )
    else:
        log(f"attempt {attempt}: starting from scratch, world size {world}")

    # Linear scaling: the global batch is world * batch_size, so the step size grows with it.
    # Set after loading: the optimizer's saved state holds the old world size's rate.
    for group in optimizer.param_groups:
        group["lr"] = args.lr * world
    log(f"learning rate {args.lr * world:g} = {args.lr:g} per worker x world size {world}")

    began = time.monotonic()
    loaded_step = step
    for epoch in range(sampler.epoch, args.epochs):
        sampler.set_epoch(epoch)  # keeps the position when resuming this very epoch
        for inputs, labels in loader:
            step_began = time.monotonic()
            if rank == 1 and attempt == 0 and step == args.crash_at:
                raise RuntimeError(f"simulated crash of rank 1 at step {step}")
            loss = nn.functional.cross_entropy(ddp(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sampler.advance(args.batch_size)  # every rank took a batch: the job moved on
            step += 1
            # The metrics the Grafana dashboard shows (recorded only under --metrics).
            took = time.monotonic() - step_began
            metrics.step(step)
            metrics.loss(loss.item())
            metrics.samples(len(labels))
            metrics.samples_per_second(len(labels) / took if took > 0 else 0.0)
            metrics.step_time(took)
            if step % args.log_every == 0:
                log(f"epoch {epoch:2d}  step {step:4d}  loss {loss.item():.4f}")
            # Every --save-every steps, and when the agent gives notice (a node told to stop).
            if store is not None and store.should_save(step, every=args.save_every):
                # Rank 0 writes; the tensors are copied now and written in the background.
                store.save(training_state(model, optimizer, sampler), step, asynchronous=True)
            time.sleep(max(0.0, args.step_seconds - (time.monotonic() - step_began)))
    if store is not None:
        if step != loaded_step and step % args.save_every != 0:
            # The end is a checkpoint too: a later run with more --epochs goes on from here.
            store.save(training_state(model, optimizer, sampler), step, asynchronous=True)
        store.wait()  # the last background save is finished (or its error raised)

    model.eval()
    with torch.no_grad():
        inputs, labels = test_set.tensors
        accuracy = (model(inputs).argmax(dim=1) == labels).float().mean().item()
    log(
        f"trained {step - loaded_step} steps in {time.monotonic() - began:.1f} s; "
        f"held-out accuracy {100 * accuracy:.1f}% ({len(test_set)} images)"
    )


if __name__ == "__main__":
    main()

"""The goodput benchmark's training script: the same file under every launcher.

A small MLP trained with Adam on random data, gloo all-reducing its gradients every step,
its whole state (weights and Adam's moments, about 8 MB) saved every ``--save-every`` steps
(1: every step) the way ``--checkpoint`` names (``train_checkpoint.py``): by default with
``rallypoint.checkpoint``, to node memory under ``rallypoint run --checkpoint-memory``,
where the agent also asks for a save on notice when a node is told to stop (SIGTERM), and
to the directory ``RALLYPOINT_CHECKPOINT_URL`` names under torchrun, where ``should_save``
is just ``step % every == 0``. A step is the forward and backward pass on one CPU thread, a sleep
until ``--step-seconds`` from its start (the accelerator's share: the CPU waits while it
computes), then the all-reduce, the optimizer step, rank 0's ``done`` line and the save
(after a save on notice, ``save`` returns only if the agent withdraws the notice: it
stops the worker first).

Usage: goodput_train.py [--steps N] [--step-seconds S] [--save-every N] [--tag TAG]
                        [--checkpoint WAY] [--checkpoint-dir DIR] [--hang-file FILE]

``--hang-file``: local rank 0 looks for FILE after each step; the first to find it takes it
away and hangs outside any collective (its peers then wait in the next all-reduce), as a
deadlock in a data loader or a stuck file system does.

Prints ``start tag=TAG rank=R local=L world=W pid=P at=T`` once per worker,
``resumed step=N world=W rank=R at=T`` after a load, and, on rank 0, ``done step=N world=W at=T``
after each step (T: wall time).
"""

import argparse
import os
import time

import torch
import train_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1_000_000)
parser.add_argument("--step-seconds", type=float, default=0.3)
parser.add_argument("--save-every", type=int, default=1)
parser.add_argument("--tag", default="")
parser.add_argument("--hidden", type=int, default=512)
parser.add_argument("--checkpoint", choices=train_checkpoint.WAYS, default="rallypoint")
parser.add_argument("--checkpoint-dir", default="checkpoints")
parser.add_argument("--hang-file", default="")
args = parser.parse_args()

torch.set_num_threads(1)  # four workers share two cores
way = train_checkpoint.open_way(args.checkpoint, args.checkpoint_dir, args.save_every)
rank, local, world = way.join()
print(
    f"start tag={args.tag} rank={rank} local={local} world={world} pid={os.getpid()} "
    f"at={time.time():.3f}",
    flush=True,
)
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, args.hidden),
    torch.nn.ReLU(),
    torch.nn.Linear(args.hidden, args.hidden),
    torch.nn.ReLU(),
    torch.nn.Linear(args.hidden, 256),
)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
parameters = list(model.parameters())
way.bind(model, optimizer)
step = 0
loaded = way.load()
if loaded is not None:
    done, state = loaded
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = done + 1
    print(f"resumed step={done} world={world} rank={rank} at={time.time():.3f}", flush=True)

while step < args.steps:
    step = way.begin(step)
    if (healed := way.healed()) is not None:
        print(f"resumed step={healed} world={world} rank={rank} at={time.time():.3f}", flush=True)
    began = time.monotonic()
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    batch = torch.randn(64, 256, generator=generator)
    loss = (model(batch) - batch).pow(2).mean()
    loss.backward()
    time.sleep(max(0.0, began + args.step_seconds - time.monotonic()))
    flat = torch.cat([p.grad.flatten() for p in parameters])  # type: ignore[union-attr]
    world = way.average(flat)
    offset = 0
    for p in parameters:
        assert p.grad is not None
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    if way.commit():
        optimizer.step()
        if way.reports(rank):  # before the save: a save on notice is the worker's last act
            print(f"done step={step} world={world} at={time.time():.3f}", flush=True)
        if way.should_save(step):
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            way.save(state, step)
        step += 1
    optimizer.zero_grad()
    if args.hang_file and local == 0 and os.path.exists(args.hang_file):
        try:
            os.rename(args.hang_file, f"{args.hang_file}.taken")  # one rank, once
        except FileNotFoundError:
            continue
        print(f"hanging rank={rank} step={step - 1} at={time.time():.3f}", flush=True)
        while True:
            time.sleep(1)
way.wait()
way.leave()

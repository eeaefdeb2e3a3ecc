"""A training loop in a framework's own hands, with no rallypoint call in it: Lightning's
``Trainer`` (its DDP strategy on gloo) or Accelerate's ``Accelerator`` (its prepared DDP
model). tests/test_hang_detection.py: hangs are found through what the framework calls
(optimizer steps, forward passes, batches, backward under DDP), nothing else.

Usage: frameworks.py lightning|accelerate CASE [--steps N] [--at STEP] [--tag DIR]

CASE ``blocked``: rank 1 blocks forever (``threading.Event().wait()``) at step ``--at``
of the first attempt; the restart trains to the end. ``steady``: steps only. Prints
``rank R trained N steps in attempt A`` at the end.
"""

import argparse
import os
import threading

import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("framework", choices=["lightning", "accelerate"])
parser.add_argument("case", choices=["blocked", "steady"])
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--at", type=int, default=40)
parser.add_argument("--tag", help="the test's directory, on the command line of every process")
args = parser.parse_args()

RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
HANGS = args.case == "blocked" and ATTEMPT == 0 and RANK == 1


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(args.steps * 16, 8)), batch_size=4)


def maybe_hang(step: int) -> None:
    if HANGS and step == args.at:
        print(f"hanging at step {step}", flush=True)
        threading.Event().wait()


def lightning() -> int:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            maybe_hang(self.global_step)
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), data())
    return trainer.global_step


def accelerate() -> int:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    net, optimizer, loader = accelerator.prepare(net, optimizer, data())
    step = 0
    while step < args.steps:
        for (batch,) in loader:
            maybe_hang(step)
            accelerator.backward(net(batch).sum())
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == args.steps:
                break
    accelerator.end_training()
    KEPT.extend([accelerator, net, optimizer, loader])
    return step


#: What the loop made, kept to the end: freeing Accelerate's DDP model and gloo group
#: once the peer has exited hung in their C++ destructors (futex waits), 1 run in 3 on a
#: busy machine, after the print or before it; torch's and Accelerate's teardown, not the
#: hang detection's to test.
KEPT: list[object] = []
steps = lightning() if args.framework == "lightning" else accelerate()
print(f"rank {RANK} trained {steps} steps in attempt {ATTEMPT}", flush=True)
os._exit(0)

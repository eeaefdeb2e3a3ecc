"""A plain training loop over gloo (no rallypoint call in it) that hangs, or works long
without a progress signal, on cue: tests/test_hang_detection.py.

Usage: hangs.py CASE [--steps N] [--at STEP] [--seconds S] [--step-seconds S] [--ddp]
                     [--device cpu|cuda] [--tag DIR]

``--ddp``: the model in DistributedDataParallel, whose all-reduces run inside backward().

Hangs, on rank 1 at step ``--at`` of the job's first attempt only (the restart trains to
the end):
  blocked      threading.Event().wait()
  spin         an endless Python loop
  fifo         opens a FIFO nobody writes
  sigstop      SIGSTOPs itself
  mismatch     calls broadcast where rank 0 calls all_reduce
  dataloader   its DataLoader's worker process blocks

Healthy (``healthy``), every rank, each stretch ``--seconds`` long with no step in it:
the first step compiled by torch.compile, DataLoader workers made again every 10 steps
(an epoch); every rank works in numpy alone at step 15; then rank 0 alone evaluates
(forward passes only) at step 25 and saves (one slow synchronous torch.save) at step 35
while the others wait in all_reduce. ``steady``: only steps of
``--step-seconds``.
"""

import argparse
import io
import os
import signal
import tempfile
import threading
import time

import numpy
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("case")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--at", type=int, default=50)
parser.add_argument("--seconds", type=float, default=5.0)
parser.add_argument("--step-seconds", type=float, default=0.01)
parser.add_argument("--ddp", action="store_true")
parser.add_argument(
    "--device", default="cpu", help="cuda: the model and batches on this rank's GPU"
)
parser.add_argument("--tag", help="the test's directory, on the command line of every process")
args = parser.parse_args()


class Numbers(Dataset):
    """Batches of random inputs; on cue, item ``block_at`` never comes (its worker hangs)."""

    def __init__(self, length: int, block_at: int = -1) -> None:
        self.length, self.block_at = length, block_at

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.block_at:
            threading.Event().wait()
        return torch.randn(8)


class SlowFile(io.BytesIO):
    """A file whose first write takes ``--seconds``: a slow file system under torch.save."""

    slow = True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if self.slow:
            self.slow = False
            time.sleep(args.seconds)
        return super().write(data)


def hang(case: str) -> None:
    print(f"hanging: {case}", flush=True)
    if case == "blocked":
        threading.Event().wait()
    elif case == "spin":
        while True:
            pass
    elif case == "fifo":
        path = os.path.join(tempfile.mkdtemp(), "fifo")
        os.mkfifo(path)
        with open(path, "rb") as fifo:
            fifo.read()
    elif case == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    hangs = rank == 1 and first_time()
    device = torch.device(args.device)
    if args.device == "cuda":  # every rank on the machine's GPU (gloo moves CUDA tensors too)
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    forward = torch.compile(model, backend="aot_eager") if args.case == "healthy" else model
    if args.ddp:
        forward = torch.nn.parallel.DistributedDataParallel(model)
    block_at = args.at * 4 if args.case == "dataloader" and hangs else -1
    per_epoch = 10 if args.case == "healthy" else args.steps
    step = 0
    while step < args.steps:
        loader = DataLoader(Numbers(per_epoch * 4, block_at), batch_size=4, num_workers=1)
        for batch in loader:
            if hangs and step == args.at and args.case in ("blocked", "spin", "fifo", "sigstop"):
                hang(args.case)
            healthy_pause(step, rank)
            loss = forward(batch.to(device)).sum()
            loss.backward()
            for parameter in [] if args.ddp else model.parameters():
                assert parameter.grad is not None
                if hangs and step == args.at and args.case == "mismatch":
                    dist.broadcast(parameter.grad, src=0)
                else:
                    dist.all_reduce(parameter.grad)
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(args.step_seconds)
            step += 1
            if step == args.steps:
                break
    print(f"rank {rank} trained {step} steps in attempt {attempt}", flush=True)
    dist.destroy_process_group()


def first_time() -> bool:
    """Whether this is the job's first attempt: the first to claim the mark in the test's
    directory (each node counts its own restarts: one whose workers were stopped for
    another node's failure keeps its count, as torchrun's agents do)."""
    if not args.tag or not os.path.isdir(args.tag):
        return int(os.environ["TORCHELASTIC_RESTART_COUNT"]) == 0
    try:
        os.close(os.open(os.path.join(args.tag, "hung-once"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def healthy_pause(step: int, rank: int) -> None:
    """The healthy job's long stretches with no optimizer step."""
    if args.case != "healthy":
        return
    until = time.monotonic() + args.seconds
    if step == 25 and rank == 0:  # an evaluation: forward passes only
        with torch.no_grad():
            model = torch.nn.Linear(8, 8)
            while time.monotonic() < until:
                model(torch.randn(4, 8))
                time.sleep(0.05)
    elif step == 35 and rank == 0:
        torch.save({"weights": torch.zeros(4096)}, SlowFile())
    elif step == 15:
        values = numpy.random.default_rng(0).random((256, 256))
        while time.monotonic() < until:
            values = numpy.sin(values @ values.T) / 256


if __name__ == "__main__":
    main()

"""A training loop that injects one fault, once per job: the fault suite's worker.

Usage: faulty.py TAG_DIR [--steps N] [--fault KIND --at STEP] [--rank R]
                 [--step-seconds S] [--save-every N] [--state-kb KB] [--asynchronous]

Every step: ``rallypoint.progress()``, an all-reduce over gloo (checked), a short sleep.
At step ``--at`` the worker of rank ``--rank`` (default: the last rank) injects KIND:
sigkill, sigsegv (a real segmentation fault), exit1, exit137 (exit codes), exception
(RuntimeError), hang (sleeps forever; the agent's watchdog must kill it). It fires once
per job, whatever the restarts: the worker that fires it first creates
``TAG_DIR/fault.json`` (``{"rank", "kind", "at"}``), and no worker fires it once that file
exists. With ``--save-every``, rank 0 saves a checkpoint of ``--state-kb`` KB every N steps
through ``rallypoint.checkpoint``, and every rank resumes from the newest one.

Each worker appends JSON lines to ``TAG_DIR/record.jsonl``: ``training`` after its first
all-reduce (``at``: wall time), ``loaded`` (the step it resumed from and what was
skipped), ``done``. TAG_DIR also makes the command line unique to the test, so that the
test can check that no worker is left behind.
"""

import argparse
import ctypes
import json
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist

import rallypoint

KINDS = ("none", "sigkill", "sigsegv", "exit1", "exit137", "exception", "hang")

parser = argparse.ArgumentParser()
parser.add_argument("tag_dir")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--fault", choices=KINDS, default="none")
parser.add_argument("--at", type=int, default=10)
parser.add_argument("--rank", type=int, default=-1)
parser.add_argument("--step-seconds", type=float, default=0.05)
parser.add_argument("--save-every", type=int, default=0)
parser.add_argument("--state-kb", type=int, default=64)
parser.add_argument("--asynchronous", action="store_true")
args = parser.parse_args()


def record(event: str, **data: object) -> None:
    line = json.dumps({"event": event, "rank": rank, "pid": os.getpid(), **data}) + "\n"
    # One write on an O_APPEND descriptor: lines of concurrent workers never interleave.
    fd = os.open(os.path.join(args.tag_dir, "record.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def claim_fault() -> bool:
    """Whether this worker fires the fault: only the first to create the marker does."""
    try:
        fd = os.open(os.path.join(args.tag_dir, "fault.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        json.dump({"rank": rank, "kind": args.fault, "at": time.time()}, handle)
    return True


def inject(kind: str, step: int) -> None:
    print(f"injecting {kind} rank={rank} step={step}", flush=True)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigsegv":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the test's cwd
        ctypes.string_at(0)  # a real invalid read, not a signal sent
    elif kind == "exit1":
        os._exit(1)  # skips interpreter shutdown, where gloo's threads may abort
    elif kind == "exit137":
        os._exit(137)  # what a shell reports for SIGKILL; an exit code all the same
    elif kind == "exception":
        raise RuntimeError(f"injected fault at step {step}")
    elif kind == "hang":
        while True:  # no progress, no collective: only the agent ends this
            time.sleep(1)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
fault_rank = world - 1 if args.rank < 0 else args.rank

start = 0
if args.save_every:
    from rallypoint import checkpoint

    loaded = checkpoint.load_latest()
    if loaded is not None:
        assert loaded.state["step"] == loaded.step, "the checkpoint holds another step's state"
        assert torch.equal(loaded.state["w"], torch.full_like(loaded.state["w"], loaded.step))
        start = loaded.step + 1
    record(
        "loaded",
        step=None if loaded is None else loaded.step,
        skipped=[] if loaded is None else list(loaded.skipped),
    )

for step in range(start, args.steps):
    # Before this step's progress(), like a hang in fetching the step's batch: the peers
    # start the step (and say so) and wait in its all-reduce, so the rank that hangs is the
    # one whose progress is the oldest, the one the agent's report blames.
    if args.fault != "none" and rank == fault_rank and step == args.at and claim_fault():
        inject(args.fault, step)
    rallypoint.progress()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert total.item() == world * (world + 1) / 2, total
    if step == start:
        record("training", step=step, at=time.time())
    if args.save_every and step % args.save_every == 0:
        state = {"w": torch.full((args.state_kb * 256,), float(step)), "step": step}
        checkpoint.save(state, step, asynchronous=args.asynchronous)
    time.sleep(args.step_seconds)

if args.save_every:
    checkpoint.wait()
record("done", at=time.time())
print(f"done rank={rank} world={world}", flush=True)
dist.destroy_process_group()
sys.exit(0)

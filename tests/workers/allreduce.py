"""All-reduce over gloo; rank 1 can be told to fail at a step of the first attempt.

Usage: allreduce.py STEPS [--crash-at STEP] [--crash-with exception|exit|kill]
                        [--record rallypoint|torch] [--print-steps]

``--print-steps``: a line with the wall time after every step's all-reduce (the benchmarks
measure the gap between the last step before a crash and the first after it).
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from rallypoint import record

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int)
parser.add_argument("--crash-at", type=int, default=-1)
parser.add_argument("--crash-with", default="exception")
parser.add_argument("--record", choices=["rallypoint", "torch"])
parser.add_argument("--print-steps", action="store_true")
args = parser.parse_args()


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"started rank={rank} attempt={attempt} at={time.time():.6f}", flush=True)
    for step in range(args.steps):
        if rank == 1 and attempt == 0 and step == args.crash_at:
            print(f"crashing rank={rank} at={time.time():.6f}", flush=True)
            if args.crash_with == "exit":
                sys.exit(3)
            if args.crash_with == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"boom at step {step}")
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        assert total.item() == world * (world + 1) / 2, total
        if args.print_steps:
            print(
                f"step rank={rank} attempt={attempt} step={step} at={time.time():.6f}", flush=True
            )
    print(f"done rank={rank} world={world} attempt={attempt}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if args.record == "torch":
        from torch.distributed.elastic.multiprocessing.errors import record as torch_record

        main = torch_record(main)
    elif args.record == "rallypoint":
        main = record(main)
    main()

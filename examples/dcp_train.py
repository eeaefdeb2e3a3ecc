"""FSDP2 training that checkpoints with torch.distributed.checkpoint (DCP) into rallypoint's
memory tier: each rank's shards are copied into its arena in node memory every step, the
agent sends them to a peer node and copies every K-th to --checkpoint-dir, and a restart
at the same world size loads each rank's own shards from memory (at another world size
DCP reshards from --checkpoint-dir).

    rallypoint run --nproc-per-node 2 --max-restarts 1 --checkpoint-memory 256MB \\
        --checkpoint-dir /tmp/dcp-ckpt examples/dcp_train.py --crash-at 30

The only rallypoint lines are the writer and the reader given to DCP.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from rallypoint.checkpoint.dcp import RallypointReader, RallypointWriter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--crash-at", type=int, default=-1, help="a rank fails at this step once")
    parser.add_argument("--crash-rank", type=int, default=1, help="the rank that fails")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    fully_shard(model, mesh=mesh)  # each rank holds a shard of every parameter (DTensor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    start = 0
    reader = RallypointReader()  # the newest checkpoint this rank can load, or none
    if reader.step is not None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, storage_reader=reader)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        start = reader.step + 1
        print(f"resumed from step {reader.step} ({reader.checkpoint.source})", flush=True)

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    device = "cuda" if cuda else "cpu"
    for step in range(start, args.steps):
        if step == args.crash_at and dist.get_rank() == args.crash_rank and not restarted:
            raise RuntimeError(f"simulated failure of rank {args.crash_rank} at step {step}")
        generator = torch.Generator().manual_seed(step * 100 + dist.get_rank())
        inputs = torch.randn(32, 64, generator=generator).to(device)
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # Every rank saves its shards; returns once this rank's copy is in node memory.
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state},
            storage_writer=RallypointWriter(step),
        )
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Lightning Fabric's ``TorchElasticEnvironment`` check, written out: it detects torchelastic
by these variables and reads the world from them (lightning is too heavy for the test extra)."""

import os
import sys

import torch.distributed as dist

REQUIRED = {"RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}  # its detect()
assert REQUIRED.issubset(os.environ), sorted(REQUIRED - set(os.environ))
address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
local_rank, node_rank = int(os.environ["LOCAL_RANK"]), int(os.environ["GROUP_RANK"])
dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", world_size=world, rank=rank)
assert (dist.get_rank(), dist.get_world_size()) == (rank, world)
print(f"fabric rank={rank} local_rank={local_rank} node_rank={node_rank} world={world}", flush=True)
dist.destroy_process_group()
sys.exit(0)

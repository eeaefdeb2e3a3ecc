"""Print this worker's launcher environment as one JSON line."""

import json
import os

PREFIXES = ("RANK", "LOCAL_", "WORLD_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_", "OMP_")
PREFIXES += ("TORCH_NCCL_", "RALLYPOINT_")
print(json.dumps({k: v for k, v in os.environ.items() if k.startswith(PREFIXES)}), flush=True)

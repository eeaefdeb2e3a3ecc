"""Print this worker's launcher environment as one JSON line."""

import json
import os
import sys

PREFIXES = ("RANK", "LOCAL_", "WORLD_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_", "OMP_")
PREFIXES += ("TORCH_NCCL_", "RALLYPOINT_")
line = json.dumps({k: v for k, v in os.environ.items() if k.startswith(PREFIXES)}) + "\n"
# One write of the whole line: print() writes the text and its newline apart, and with
# PYTHONUNBUFFERED set (CI machines often have it) each goes to the shared pipe at once,
# so two workers' lines could interleave. A single write under PIPE_BUF (4 KiB) cannot.
sys.stdout.write(line)
sys.stdout.flush()

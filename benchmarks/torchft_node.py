"""One node of a torchft job, for ``bench_peers.py``: torchft has no launcher of its own,
so a node runs each of its replica groups under a torchrun of its own, as torchft's README
starts one (``REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=... torchrun
--nnodes 1 --nproc_per_node 1 train_ddp.py``), beside the job's one Lighthouse.

Usage (with the torchft environment's python)::

    NODE_RANK=N torchft_node.py --groups G --num-groups T [--max-restarts R] SCRIPT [ARGS...]

Group ``N * G + i`` for ``i`` below ``G``; ``--standalone`` in place of the README's fixed
``--master_port`` (a free port each, as two groups share the machine). A SIGTERM is passed
to every torchrun (which passes it to its worker) and the node exits once they have.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--groups", type=int, required=True)
parser.add_argument("--num-groups", type=int, required=True)
parser.add_argument("--max-restarts", type=int, default=0)
parser.add_argument("script", nargs=argparse.REMAINDER)
args = parser.parse_args()

torchrun = str(Path(sys.executable).parent / "torchrun")
groups = []
for index in range(args.groups):
    env = {
        **os.environ,
        "REPLICA_GROUP_ID": str(int(os.environ["NODE_RANK"]) * args.groups + index),
        "NUM_REPLICA_GROUPS": str(args.num_groups),
        "REPLICA_GROUPS_PER_NODE": str(args.groups),
    }
    command = [torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
               "--max-restarts", str(args.max_restarts), *args.script]  # fmt: skip
    groups.append(subprocess.Popen(command, env=env))

signal.signal(signal.SIGTERM, lambda *_: [g.send_signal(signal.SIGTERM) for g in groups])
codes = [group.wait() for group in groups]
sys.exit(next((code for code in codes if code), 0))

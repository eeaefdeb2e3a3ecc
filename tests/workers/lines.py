"""Print a few known lines on stdout and stderr, tagged with the local rank, and this
worker's CPU affinity and device variables.

Usage: lines.py
"""

import json
import os
import sys

rank = os.environ[
    "RALLYPOINT_LOCAL_RANK" if "RALLYPOINT_LOCAL_RANK" in os.environ else "LOCAL_RANK"
]
for text in ("apple", "banana", "pear,plum"):
    print(f"{text} {rank}", flush=True)
    print(f"{text} err {rank}", file=sys.stderr, flush=True)
facts = {
    "rank": os.environ["RANK"],
    "local_rank": os.environ["LOCAL_RANK"],
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "cpus": sorted(os.sched_getaffinity(0)),
}
sys.stdout.write("facts " + json.dumps(facts) + "\n")

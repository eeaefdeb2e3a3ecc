"""A worker without torch, for tests of the agents' rendezvous: prints its world size, then
holds until DIR/hold is gone, and exits 0 (or 1 with --fail, on the last rank).

Usage: light.py DIR [--fail]
"""

import os
import sys
import time
from pathlib import Path

hold = Path(sys.argv[1]) / "hold"
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
print(f"training rank={rank} world={world} at={time.time():.3f}", flush=True)
if "--fail" in sys.argv and rank == world - 1:
    sys.exit(1)
deadline = time.monotonic() + 120
while hold.exists() and time.monotonic() < deadline:
    time.sleep(0.05)

"""A torchrun-style worker: ``@record`` from torch on its main, which raises on the last
local rank (the others exit 0).

Usage: record_raises.py
"""

import os

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    if os.environ["LOCAL_RANK"] == str(int(os.environ["LOCAL_WORLD_SIZE"]) - 1):
        raise ValueError("shard 1 is missing")


if __name__ == "__main__":
    main()

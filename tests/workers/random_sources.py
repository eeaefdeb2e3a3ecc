"""Draw from every random source a training script uses, without seeding (or with
``--seed``), and write what it drew to ``DIR/<restart>-<rank>.json``.

Usage: random_sources.py DIR [--seed]. Two workers: on the first attempt rank 1 fails once
rank 0 has written, so that the job restarts and both draw again.
"""

import json
import os
import random
import sys
import time
from pathlib import Path

import numpy
import torch
from torch.utils.data import DataLoader, get_worker_info

directory = Path(sys.argv[1])
rank = int(os.environ["RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def worker_seed(batch: list[int]) -> int:
    info = get_worker_info()
    assert info is not None
    return int(info.seed)


if __name__ == "__main__":
    if "--seed" in sys.argv:  # what seed_everything and Accelerate's set_seed do
        random.seed(1234)
        numpy.random.seed(1234)
        torch.manual_seed(1234)
    drawn = {
        "python": random.random(),
        "numpy": float(numpy.random.random()),
        "torch": [torch.initial_seed(), torch.rand(1).item()],
        "dropout": torch.nn.Dropout(0.5)(torch.ones(64)).nonzero().flatten().tolist(),
        "shuffle": [int(i) for i in next(iter(DataLoader(range(32), 32, shuffle=True)))],
        "loader_workers": sorted(DataLoader(range(2), 1, num_workers=2, collate_fn=worker_seed)),
    }
    if torch.cuda.is_available():  # made and seeded when first used, in the worker
        drawn["cuda"] = [torch.cuda.initial_seed(), torch.rand(1, device="cuda").item()]
    path = directory / f"{restart}-{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(drawn))
    path.with_suffix(".tmp").rename(path)
    if restart == 0:
        if rank == 1:  # fail once the other has drawn, so that the job restarts
            deadline = time.monotonic() + 60
            while not (directory / "0-0.json").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            sys.exit(1)
        time.sleep(60)  # stopped by the launcher when rank 1 fails

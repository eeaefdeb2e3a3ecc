"""A training loop that records worker metrics, for the Prometheus tests.

Usage: metrics_train.py DIR STEPS

Every attempt of every worker runs STEPS steps; each step adds 1 to ``test_steps_total``,
observes ``test_step_seconds``, and reports step, loss and samples through
``rallypoint.metrics``. Rank 0 also reports one checkpoint save to the agent. Then the
worker writes DIR/done-<attempt>-<rank> and waits: rank 1 of attempt 0 exits with 3 once
DIR/crash exists; every worker exits with 0 once DIR/finish exists, and with 4 after 60 s.
"""

import os
import sys
import time
from pathlib import Path

from rallypoint import metrics
from rallypoint.worker import channel as worker_channel

directory, steps = Path(sys.argv[1]), int(sys.argv[2])
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

counted = metrics.counter("test_steps", "Steps run by the test workers.")
timed = metrics.histogram("test_step_seconds", "Step time of the test workers.")
# One per live worker: the sum over ranks is the number of running workers, whatever the
# number of restarts.
metrics.gauge("test_live_workers", "Running test workers.", aggregate="sum").set(1)

for step in range(steps):
    with timed.time():
        time.sleep(0.001)
    counted.inc()
    metrics.step(step)
    metrics.loss(1.0 / (step + 1))
    metrics.samples(4)
    metrics.samples_per_second(4000.0)
    metrics.step_time(0.001)
if rank == 0:
    worker_channel.send(
        "checkpoint_saved", step=steps, seconds=0.2, bytes=4096, blocked_seconds=0.05,
        asynchronous=False,
    )  # fmt: skip

(directory / f"done-{attempt}-{rank}").write_text(str(os.getpid()))
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    if rank == 1 and attempt == 0 and (directory / "crash").exists():
        sys.exit(3)
    if (directory / "finish").exists():
        sys.exit(0)
    time.sleep(0.02)
sys.exit(4)

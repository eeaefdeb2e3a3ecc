"""Leave behind the helpers a real worker leaves, then end: ``helpers.py DIR``.

Each worker registers a semaphore with multiprocessing's resource tracker (a ``spawn``
lock, as a data loader's queues do) and starts two helpers tagged with DIR: one in its
process group that says when it gets SIGTERM and exits, one in a session of its own that
ignores SIGTERM. It writes the semaphore's name to ``DIR/<restart>-<rank>.sem``. Two
workers: on the first attempt rank 1 fails once rank 0 has written, and rank 0 waits to
be stopped; on the next both exit 0 at once.
"""

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

directory = Path(sys.argv[1])
rank = int(os.environ["RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
said = directory / f"{restart}-{rank}.term"
polite = (
    "import signal, sys, time\n"
    "def stop(signum, frame):\n"
    f"    open({str(said)!r}, 'w').close()\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "time.sleep(300)\n"
)
deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"

if __name__ == "__main__":
    lock = multiprocessing.get_context("spawn").Lock()
    subprocess.Popen([sys.executable, "-c", polite, str(directory)])
    subprocess.Popen([sys.executable, "-c", deaf, str(directory)], start_new_session=True)
    time.sleep(0.5)  # the helpers set their handlers
    (directory / f"{restart}-{rank}.sem").write_text(lock._semlock.name)  # type: ignore[attr-defined]
    if restart == 0:
        if rank == 1:
            deadline = time.monotonic() + 60
            while not (directory / "0-0.sem").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            sys.exit(1)
        time.sleep(60)

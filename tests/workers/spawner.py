"""Start one process of every kind a real worker starts, write their pids, then wait.

Usage: spawner.py DIR [--then sleep|exit0|fail-once]

Each worker starts, all tagged with DIR in their command line: a ``subprocess.Popen`` child
(in the worker's session and process group), a ``multiprocessing`` fork child, a child in a
process group of its own, and a daemon that escaped by a double fork and ``setsid``. It
writes their pids and its own to ``DIR/pids-<attempt>-<local rank>.json``, then sleeps
(``sleep``), exits 0 (``exit0``), or exits 1 on the first attempt, once both workers
wrote their pids, and sleeps on the next (``fail-once``). Two workers per node.
"""

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

directory = Path(sys.argv[1])
then = sys.argv[sys.argv.index("--then") + 1] if "--then" in sys.argv else "sleep"
tag = str(directory)
sleeper = [sys.executable, "-c", "import time; time.sleep(300)", tag]


def daemon() -> int:
    """Double fork and setsid, as a daemon does: the grandchild's pid, through a pipe."""
    read, write = os.pipe()
    first = os.fork()
    if first == 0:
        os.setsid()
        second = os.fork()
        if second == 0:
            os.execv(sys.executable, sleeper)
        os.write(write, str(second).encode())
        os._exit(0)
    os.waitpid(first, 0)
    os.close(write)
    return int(os.read(read, 32))


def own_group() -> int:
    child = os.fork()
    if child == 0:
        os.setpgid(0, 0)
        os.execv(sys.executable, sleeper)
    return child


if __name__ == "__main__":
    popen = subprocess.Popen(sleeper)
    forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,))
    forked.start()
    pids = {
        "worker": os.getpid(),
        "popen": popen.pid,
        "fork": forked.pid,
        "group": own_group(),
        "daemon": daemon(),
    }
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    path = directory / f"pids-{attempt}-{os.environ['LOCAL_RANK']}.json"
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(pids))
    partial.rename(path)
    if then == "fail-once" and attempt == "0":
        # Every worker writes its pids before the first one fails and stops the others.
        others = [directory / f"pids-0-{rank}.json" for rank in range(2)]
        deadline = time.monotonic() + 60
        while not all(p.exists() for p in others) and time.monotonic() < deadline:
            time.sleep(0.01)
    if then == "exit0" or (then == "fail-once" and attempt == "0"):
        # Not sys.exit: multiprocessing would wait for the fork child at exit.
        os._exit(0 if then == "exit0" else 1)
    time.sleep(300)

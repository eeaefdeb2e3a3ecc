"""Print, as one JSON line per worker, what a worker sees of its interpreter; then end as
told: ``probe.py [ARGS...] [--end ok|exit3|message|raise|interrupt|sigkill]``.

Run as a script, with ``-m workers.probe`` or with ``--run-path``: the warm-start tests
compare what a worker forked from the preloaded interpreter sees with a fresh one's.
``PROBE_IMPORT=MODULE`` imports a module first (one that is ``--preload``ed, warm).
"""

import sys

# Before anything imports it: whether this interpreter was preloaded.
PRELOADED = "torch" in sys.modules

import atexit  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
from multiprocessing import forkserver, resource_tracker  # noqa: E402

import numpy  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PROBE_IMPORT"):
    imported = importlib.import_module(os.environ["PROBE_IMPORT"])


def own_helpers() -> bool:
    """Whether the multiprocessing helpers this process knows of (its resource tracker and
    fork server) are none, or its own children, as in a fresh interpreter."""
    pids = [resource_tracker._resource_tracker._pid, forkserver._forkserver._forkserver_pid]
    return all(
        pid is None or f" {os.getpid()} " in open(f"/proc/{pid}/stat").read() for pid in pids
    )


def cmdline() -> list[str]:
    """/proc/self/cmdline as psutil splits it (a setproctitle-style line on spaces)."""
    with open("/proc/self/cmdline", errors="surrogateescape") as handle:
        data = handle.read()
    sep = "\0" if data.endswith("\0") else " "
    data = data.removesuffix(sep)
    parts = data.split(sep)
    return data.split(" ") if sep == "\0" and len(parts) == 1 and " " in data else parts


end = sys.argv[sys.argv.index("--end") + 1] if "--end" in sys.argv else "ok"
main = sys.modules["__main__"]
seen = {
    "preloaded": PRELOADED,
    "argv": sys.argv,
    "path0": sys.path[0],
    "file": globals().get("__file__"),
    "name": __name__,
    "spec": None if __spec__ is None else __spec__.name,
    "main_is_module": main.__dict__ is globals(),
    "main_keys": sorted(k for k in globals() if k.startswith("__")),
    "cwd": os.getcwd(),
    "stdout": [type(sys.stdout.buffer).__name__, sys.stdout.write_through, sys.stdout.encoding],
    "own_session": os.getsid(0) == os.getpid(),
    "own_group": os.getpgid(0) == os.getpid(),
    "sigint": getattr(
        signal.getsignal(signal.SIGINT), "__name__", str(signal.getsignal(signal.SIGINT))
    ),
    "sigterm": str(signal.getsignal(signal.SIGTERM)),
    "sigchld": str(signal.getsignal(signal.SIGCHLD)),
    "threads": torch.get_num_threads(),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "rank": os.environ["RANK"],
    "local_rank": os.environ["LOCAL_RANK"],
    "world": os.environ["WORLD_SIZE"],
    "cuda_initialised": torch.cuda.is_initialized(),
    "random": random.random(),
    "numpy": float(numpy.random.random()),
    "torch_seed": torch.initial_seed(),
    "torch_rand": torch.rand(1).item(),
    "authkey": multiprocessing.current_process().authkey.hex(),
    "hash_seed": os.environ.get("PYTHONHASHSEED"),
    "hash": hash("rallypoint"),
    "gc_frozen": gc.get_freeze_count() > 0,
    "own_helpers": own_helpers(),
    "renewed": imported.owner.pid == os.getpid() if os.environ.get("PROBE_IMPORT") else None,
    # What ps shows, and whether psutil would find empty arguments in it.
    "cmdline": " ".join(cmdline()),
    "empty_arguments": "" in cmdline(),
    "fds": sorted(os.listdir("/proc/self/fd")),
    "rallypoint_modules": sorted(m for m in sys.modules if "rallypoint" in m),
}
sys.stdout.write(json.dumps(seen) + "\n")
sys.stdout.flush()


def goodbye() -> None:
    sys.stdout.write(f"atexit ran rank={os.environ['RANK']}\n")


atexit.register(goodbye)
# A file left open, written but never flushed: finishing the interpreter flushes it.
left_open = os.path.join(os.environ.get("PROBE_DIR", "."), f"left-open-{os.environ['RANK']}.txt")
unflushed = open(left_open, "w")  # noqa: SIM115
unflushed.write("written before the end\n")

if end == "exit3":
    sys.exit(3)
elif end == "message":
    sys.exit("the script said goodbye")
elif end == "raise":
    raise ValueError("probe raised")
elif end == "interrupt":
    raise KeyboardInterrupt
elif end == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)

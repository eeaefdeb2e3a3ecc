"""The processes writing checkpoints into node memory, marked so that the agent can wait
for them.

A writer to node memory outlives its worker (``Checkpointer._fork_writer``): a worker
killed while its last save is written still leaves that save complete. When the agent
stops a worker group it kills whatever the workers left running; first it waits, bounded,
for the writers marked here (one empty file per writer, named by its pid, under the
agent's memory directory). A writer that dies leaves its mark behind: its pid is gone,
and that is what counts.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

WRITERS = "writers"
#: The memory directory's checkpoints: this node's, and the copy a peer sent.
CHECKPOINTS = "checkpoints"
PEER = "peer"


def mark(directory: str | Path, pid: int) -> None:
    """Mark ``pid`` as a writer in ``directory`` (the agent's memory directory). The worker
    marks the writer it forked before ``save`` returns: a worker killed right after still
    leaves its writer known."""
    folder = Path(directory) / WRITERS
    folder.mkdir(exist_ok=True)
    (folder / str(pid)).touch()


def unmark(directory: str | Path, pid: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        (Path(directory) / WRITERS / str(pid)).unlink()


def running(directory: str | Path) -> list[int]:
    """The pids of the marked writers that are still running (not ended, nor zombies)."""
    folder = Path(directory) / WRITERS
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    alive = []
    for name in names:
        if not name.isdigit():
            continue
        if _running(int(name)):
            alive.append(int(name))
        else:
            with contextlib.suppress(FileNotFoundError):
                (folder / name).unlink()
    return alive


def wait(directory: str | Path, timeout: float) -> list[int]:
    """Wait until no marked writer runs, at most ``timeout`` seconds; those still running."""
    deadline = time.monotonic() + timeout
    while (left := running(directory)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")

"""Checkpoints from a worker, wherever ``rallypoint run --checkpoint-dir`` points.

    from rallypoint import checkpoint

    loaded = checkpoint.load_latest()          # every rank; None on a fresh start
    if loaded is not None:
        model.load_state_dict(loaded.state["model"])
        start = loaded.step + 1
    ...
    if checkpoint.should_save(step, every=100):  # and when the agent gives notice
        checkpoint.save({"model": model.state_dict()}, step, asynchronous=True)  # rank 0 writes

The functions use one ``Checkpointer`` for the process, made from the environment the
agent sets (``RALLYPOINT_CHECKPOINT_URL``, ``RANK``, ``WORLD_SIZE``); make a
``Checkpointer`` yourself for other settings (``keep_last``). Nothing here imports the
agent; torch is imported when a checkpoint is saved or loaded.
"""

from __future__ import annotations

import threading
from typing import Any

from rallypoint.checkpoint.checkpointer import URL_ENV, Checkpoint, Checkpointer
from rallypoint.checkpoint.storage import FileStorage
from rallypoint.interfaces import CheckpointError, CheckpointStorage
from rallypoint.worker import notice_watch as notice

__all__ = [
    "URL_ENV",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStorage",
    "Checkpointer",
    "FileStorage",
    "default",
    "load_latest",
    "save",
    "should_save",
    "wait",
]

_default: Checkpointer | None = None
_lock = threading.Lock()


def default() -> Checkpointer:
    """The process's ``Checkpointer``, made from the environment on first use."""
    global _default
    with _lock:
        if _default is None:
            _default = Checkpointer()
        return _default


def save(state: Any, step: int, *, asynchronous: bool = False) -> None:
    """``default().save(...)``: rank 0 saves ``state`` as the checkpoint of ``step``."""
    default().save(state, step, asynchronous=asynchronous)


def should_save(step: int, every: int | None = None) -> bool:
    """Whether to save at ``step``: every ``every`` steps, and at a save on notice
    (``Checkpointer.should_save``; it needs no checkpoint location)."""
    return notice.should_save(step, every)


def load_latest(*, map_location: Any = "cpu", weights_only: bool = True) -> Checkpoint | None:
    """``default().load_latest(...)``: the newest intact checkpoint, or ``None``."""
    return default().load_latest(map_location=map_location, weights_only=weights_only)


def wait() -> None:
    """``default().wait()``: wait for a background save to finish."""
    if _default is not None:
        _default.wait()

"""How ``goodput_train.py`` saves and resumes, under any launcher: one small adapter per way
(its ``--checkpoint``), so that every launcher runs the same training script.

- ``rallypoint``: ``rallypoint.checkpoint`` (node memory under ``rallypoint run
  --checkpoint-memory``, where the agent also asks for a save on notice; the directory
  ``RALLYPOINT_CHECKPOINT_URL`` names elsewhere).
- ``torch.save``: what a torchrun user writes: rank 0 saves the whole state (every rank
  holds the same) to ``DIR/step-N.pt``, written aside and renamed into place; every rank
  loads the newest file.
- ``flash``: DLRover's Flash Checkpoint (``DdpCheckpointer``): to node memory at every
  save, which ``dlrover-run``'s agent keeps across a restart, and to ``DIR`` every
  ``DISK_EVERY`` saves.
- ``nvidia-local``: NVIDIA's local checkpointing (``LocalCheckpointManager`` with a
  ``BasicTensorAwareStateDict``): each rank's state to ``DIR`` on its own node.

Only the chosen way's library is imported: a peer's environment has no rallypoint, and
rallypoint's has no peer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WAYS = ("rallypoint", "torch.save", "flash", "nvidia-local")
DISK_EVERY = 50  # Flash Checkpoint's saves to disk, as its examples space them
KEEP = 2  # torch.save: the newest files kept (the one being written may be cut short)


class Way:
    """How a script saves and resumes; by default it does neither."""

    def load(self) -> tuple[int, dict[str, Any]] | None:
        """The newest step saved and its state, if any."""
        return None

    def should_save(self, step: int) -> bool:
        return False

    def save(self, state: dict[str, Any], step: int) -> None:
        """Save ``state``, that of ``step``."""

    def wait(self) -> None:
        """Wait for a save still in flight."""


class Rallypoint(Way):
    def __init__(self, directory: str, every: int) -> None:
        from rallypoint import checkpoint

        self.checkpoint, self.every = checkpoint, every

    def load(self) -> tuple[int, dict[str, Any]] | None:
        loaded = self.checkpoint.load_latest()
        return None if loaded is None else (loaded.step, loaded.state)

    def should_save(self, step: int) -> bool:
        # Every rank asks, every rank saves; true on notice too (a preemption).
        return self.checkpoint.should_save(step, every=self.every)

    def save(self, state: dict[str, Any], step: int) -> None:
        self.checkpoint.save(state, step, asynchronous=True)

    def wait(self) -> None:
        self.checkpoint.wait()


class TorchSave(Way):
    def __init__(self, directory: str, every: int) -> None:
        self.directory, self.every = Path(directory), every
        self.directory.mkdir(parents=True, exist_ok=True)

    def load(self) -> tuple[int, dict[str, Any]] | None:
        for path in sorted(self.directory.glob("step-*.pt"), key=_step, reverse=True):
            try:  # a file is whole once renamed into place; an unreadable one is skipped
                return _step(path), torch.load(path, weights_only=True)
            except (OSError, RuntimeError, EOFError):
                continue
        return None

    def should_save(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, state: dict[str, Any], step: int) -> None:
        if dist.get_rank() != 0:
            return
        final = self.directory / f"step-{step}.pt"
        partial = final.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, final)
        for old in sorted(self.directory.glob("step-*.pt"), key=_step)[:-KEEP]:
            old.unlink(missing_ok=True)


def _step(path: Path) -> int:
    return int(path.stem.partition("-")[2])


class Flash(Way):
    def __init__(self, directory: str, every: int) -> None:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        self.storage = StorageType
        self.checkpointer = DdpCheckpointer(directory)
        self.directory, self.every, self.saves = directory, every, 0

    def load(self) -> tuple[int, dict[str, Any]] | None:
        state = self.checkpointer.load_checkpoint()
        return (int(state.pop("step")), state) if state else None

    def should_save(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, state: dict[str, Any], step: int) -> None:
        self.saves += 1
        where = self.storage.DISK if self.saves % DISK_EVERY == 0 else self.storage.MEMORY
        # Its own path (DIR/STEP/rank_0.pt): the one its load reads. Another path, as its
        # docstring's example gives, is written but never found again.
        self.checkpointer.save_checkpoint(step, {**state, "step": step}, storage_type=where)


class NvidiaLocal(Way):
    def __init__(self, directory: str, every: int) -> None:
        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
            BasicTensorAwareStateDict,
        )
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager,
        )

        self.wrap = BasicTensorAwareStateDict
        self.manager = LocalCheckpointManager(directory)
        self.every = every

    def load(self) -> tuple[int, dict[str, Any]] | None:
        if self.manager.find_latest() == -1:
            return None
        loaded, _ = self.manager.load()
        state = loaded.state_dict
        return int(state.pop("step")), state

    def should_save(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, state: dict[str, Any], step: int) -> None:
        self.manager.save(self.wrap({**state, "step": step}), step, is_async=False)


def open_way(way: str, directory: str, every: int) -> Way:
    kinds: dict[str, type[Way]] = {
        "rallypoint": Rallypoint, "torch.save": TorchSave, "flash": Flash,
        "nvidia-local": NvidiaLocal,
    }  # fmt: skip
    return kinds[way](directory, every)

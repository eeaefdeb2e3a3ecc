"""How ``goodput_train.py`` saves and resumes, under any launcher: one small adapter per way
(its ``--checkpoint``), so that every launcher runs the same training script. A way also
joins the job and averages the gradients: by torch's process group for all, but torchft's.

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
- ``torchft``: torchft's live recovery: each worker is a replica group of its own
  (``REPLICA_GROUP_ID``, under a torchrun of its own) whose ``Manager`` joins a quorum at
  every step through the Lighthouse (``TORCHFT_LIGHTHOUSE``), averages the gradients among
  the groups in it, commits the step only if every group did, and heals a group that
  (re)joins behind from a peer's state; nothing is saved.

Only the chosen way's library is imported: a peer's environment has no rallypoint, and
rallypoint's has no peer.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WAYS = ("rallypoint", "torch.save", "flash", "nvidia-local", "torchft")
DISK_EVERY = 50  # Flash Checkpoint's saves to disk, as its examples space them
KEEP = 2  # torch.save: the newest files kept (the one being written may be cut short)


class Way:
    """The step as every launcher but torchft runs it: torch's process group of the job,
    the gradients averaged by an all-reduce, every step committed."""

    def __init__(self, directory: str, every: int) -> None:
        """``directory``: where it saves; ``every``: how many steps apart."""

    def join(self) -> tuple[int, int, int]:
        """This worker's rank, local rank and the world's size."""
        dist.init_process_group("gloo")
        return dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), dist.get_world_size()

    def begin(self, step: int) -> int:
        """The step to do now."""
        return step

    def average(self, flat: torch.Tensor) -> int:
        """Average ``flat`` among the workers; how many took part."""
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        return dist.get_world_size()

    def commit(self) -> bool:
        return True

    def leave(self) -> None:
        dist.destroy_process_group()

    def bind(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The state to heal from a peer (torchft's way alone needs it)."""

    def healed(self) -> int | None:
        """The step this worker was healed to from a peer since the last call, if it was."""
        return None

    def reports(self, rank: int) -> bool:
        """Whether this worker prints the steps done: rank 0."""
        return rank == 0

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
        self.directory, self.every, self.saves = directory, every, 0

    def join(self) -> tuple[int, int, int]:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        joined = super().join()
        # Built once the process group is: its engine counts the ranks that share a save
        # then (built before, each rank saves alone and its collectives go out of step).
        self.storage, self.checkpointer = StorageType, DdpCheckpointer(self.directory)
        return joined

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

        self.wrap, self.manager_of = BasicTensorAwareStateDict, LocalCheckpointManager
        self.directory, self.every = directory, every

    def join(self) -> tuple[int, int, int]:
        joined = super().join()
        self.manager = self.manager_of(self.directory)  # it takes its rank from the group
        return joined

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


class TorchFT(Way):
    def __init__(self, directory: str, every: int) -> None:
        self.group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
        self.state: dict[str, Any] = {}
        self.resumed: int | None = None

    def bind(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """What a healing group loads from a peer, and what it is sent."""
        self.state = {"model": model, "optimizer": optimizer}

    def join(self) -> tuple[int, int, int]:
        from torchft import Manager, ProcessGroupGloo

        def state_dict() -> dict[str, Any]:
            return {k: v.state_dict() for k, v in self.state.items()}

        def load_state_dict(state: dict[str, Any]) -> None:
            for key, value in self.state.items():
                value.load_state_dict(state[key])
            self.resumed = self.manager.current_step()

        # As torchft's train_ddp.py runs on a CPU: gloo with a 5 s timeout, a 30 s quorum.
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
            min_replica_size=1,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            replica_id=f"goodput_{self.group}",
            timeout=timedelta(seconds=30),
        )
        # The benchmark's local rank of a group: its index among the node's groups.
        per_node = int(os.environ.get("REPLICA_GROUPS_PER_NODE", "1"))
        return self.group, self.group % per_node, int(os.environ.get("NUM_REPLICA_GROUPS", "1"))

    def begin(self, step: int) -> int:
        self.manager.start_quorum()
        self.manager.wait_quorum()
        return self.manager.current_step()

    def average(self, flat: torch.Tensor) -> int:
        self.manager.allreduce(flat).wait()  # averaged among the groups of the quorum
        return self.manager.num_participants()

    def commit(self) -> bool:
        return self.manager.should_commit()

    def healed(self) -> int | None:
        healed, self.resumed = self.resumed, None
        return healed

    def reports(self, rank: int) -> bool:
        return True  # any group may be the one left to step

    def leave(self) -> None:
        self.manager.shutdown()


def open_way(way: str, directory: str, every: int) -> Way:
    kinds: dict[str, type[Way]] = {
        "rallypoint": Rallypoint, "torch.save": TorchSave, "flash": Flash,
        "nvidia-local": NvidiaLocal, "torchft": TorchFT,
    }  # fmt: skip
    return kinds[way](directory, every)

"""Where a save goes (the writers of ``rallypoint.checkpoint.saving``): a slot of the
worker's arena in node memory, ``--checkpoint-dir`` through ``torch.save``, or
``--checkpoint-dir`` through ``torch.distributed.checkpoint`` for sharded state."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rallypoint.checkpoint import arena
from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint.copying import Copier
from rallypoint.checkpoint.reading import SHARDS, STATE_FILE, local_path, sharded_tier
from rallypoint.checkpoint.saving import Job
from rallypoint.checkpoint.tier import BEGUN, MEMORY, Tier
from rallypoint.worker import channel as worker_channel
from rallypoint.worker import progress, variables


class ArenaSlot:
    """A slot of this process's arena in the agent's memory directory ``memory``
    (``--checkpoint-memory``): the arena copies the state into the slot, by DMA for CUDA
    tensors, now or while the loop goes on (``Job.asynchronous``), and commits it; the
    agent sends it to a peer and copies it to ``--checkpoint-dir``. The arena is made on
    the first save: a rank that never saves has none."""

    def __init__(self, memory: Path, rank: int, world_size: int) -> None:
        self.memory = memory
        self.rank = rank
        self.world_size = world_size
        self.arena: arena.Arena | None = None
        # A copier now installs the optimizer-step hook before the loop's first step, so
        # that the arena's first asynchronous save is ordered by it, not at once (copying).
        self._hooks = Copier()

    def settle(self) -> None:
        pass  # a save begins while the one before is still copied (``arena.IN_FLIGHT``)

    def write(self, staged: Any, job: Job, blocked: float | None) -> None:
        self.open().save(
            staged, job.step, rank=self.rank, world_size=self.world_size, format=job.format,
            asynchronous=job.asynchronous, placed=job.placed,
        )  # fmt: skip

    def wait(self) -> None:
        if self.arena is not None:
            self.arena.wait()

    def open(self) -> arena.Arena:
        """The arena, made (or the process's, shared) on first use."""
        if self.arena is None:
            local_rank = variables.env_int(variables.NODE_LOCAL_RANK)
            self.arena = arena.for_process(
                self.memory,
                (variables.env_int(variables.LOCAL_RANK) or 0)
                if local_rank is None
                else local_rank,
                keep=variables.env_int(variables.CHECKPOINT_MEMORY_KEEP) or 1,
                budget=variables.env_int(variables.CHECKPOINT_MEMORY_BYTES),
                saved=tell_agent,
            )
        return self.arena


class DurableWriter:
    """``--checkpoint-dir``: the state written with ``torch.save``, atomically (payload
    first, manifest last), one save at a time: ``settle`` waits for the one before."""

    def __init__(self, tier: Tier, world_size: int, settle: Callable[[], None]) -> None:
        self.tier = tier
        self.world_size = world_size
        self._settle = settle

    def settle(self) -> None:
        self._settle()

    def write(self, staged: Any, job: Job, blocked: float | None) -> None:
        import torch

        tier = self.tier
        step = job.step
        name = mf.directory(step)
        # A synchronous save holds up training: its writes are the worker's progress.
        writer: mf.HashingWriter | None = None
        try:
            tier.begin(step)
            with tier.writer(f"{name}/{STATE_FILE}") as handle:
                writer = mf.HashingWriter(handle, progress.progress if blocked is None else None)
                torch.save(staged, writer)  # type: ignore[arg-type]
            tier.commit(step, self.world_size, "torch", {STATE_FILE: writer.entry})
        except Exception as error:
            raise tier.failed(step, (writer and writer.error) or error) from error
        seconds = time.perf_counter() - job.began
        worker_channel.send(
            "checkpoint_saved",
            step=step,
            seconds=seconds,
            bytes=writer.size,
            blocked_seconds=seconds if blocked is None else blocked,
            asynchronous=blocked is not None,
            tier=tier.source,
        )

    def wait(self) -> None:
        pass


class DcpWriter:
    """``--checkpoint-dir`` for sharded state: every rank writes its shards with
    ``torch.distributed.checkpoint`` (a path every node sees); rank 0 writes the manifest
    once they all have, and every rank returns with the checkpoint complete."""

    def __init__(self, durable: Tier | None, rank: int, world_size: int) -> None:
        self.durable = durable
        self.rank = rank
        self.world_size = world_size

    def settle(self) -> None:
        pass

    def write(self, staged: Any, job: Job, blocked: float | None) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        step = job.step
        tier = sharded_tier(self.durable)
        path = local_path(tier, f"{mf.directory(step)}/{SHARDS}")
        if self.rank == 0:
            tier.begin(step)
        dcp_save(staged, checkpoint_id=path)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.barrier()  # every shard is written before the manifest
        if self.rank != 0:
            if distributed:
                dist.barrier()  # returns once rank 0 has written the manifest
            return
        files = {}
        prefix = f"{mf.directory(step)}/{SHARDS}/"
        for name in tier.storage.names():
            if name.startswith(prefix) and not name.endswith(f"/{BEGUN}"):
                with tier.storage.reader(name) as handle:
                    files[name.removeprefix(f"{mf.directory(step)}/")] = _entry(handle.read())
        tier.commit(step, self.world_size, "dcp", files)
        if distributed:
            dist.barrier()  # every rank returns with the checkpoint complete
        seconds = time.perf_counter() - job.began
        worker_channel.send(
            "checkpoint_saved",
            step=step,
            seconds=seconds,
            bytes=sum(entry.size for entry in files.values()),
            blocked_seconds=seconds,
            asynchronous=False,
            tier=tier.source,
        )

    def wait(self) -> None:
        pass


def tell_agent(saved: arena.Saved) -> None:
    """Tell the agent of a save its arena committed (``checkpoint_saved``)."""
    worker_channel.send(
        "checkpoint_saved",
        step=saved.step,
        seconds=saved.seconds,
        bytes=saved.bytes,
        blocked_seconds=saved.blocked,
        asynchronous=saved.asynchronous,
        tier=MEMORY,
        format=saved.format,
    )


def _entry(data: bytes) -> mf.FileEntry:
    return mf.FileEntry(len(data), hashlib.sha256(data).hexdigest())

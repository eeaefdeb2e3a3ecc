"""Saving and loading checkpoints in a worker: atomic, verified, rotated, optionally in the
background, whichever storage ``--checkpoint-dir`` names.

A ``Checkpointer`` holds the tiers and decides, once, how each kind of save runs: a stager
and a writer (``rallypoint.checkpoint.saving``, ``.writers``). A load chooses among the
copies of every tier (``rallypoint.checkpoint.candidates``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rallypoint.checkpoint import slot
from rallypoint.checkpoint.candidates import (
    Checkpoint,
    Tiers,
    loading_into,
    newest,
    ranks_tier,
    shared_ranks,
)
from rallypoint.checkpoint.copies import Copies
from rallypoint.checkpoint.reading import STATE_FILE
from rallypoint.checkpoint.saving import HostStaging, Job, Placed, SaveMode, Unstaged
from rallypoint.checkpoint.storage import FileStorage
from rallypoint.checkpoint.tier import PEER, Tier
from rallypoint.checkpoint.writers import ArenaSlot, DcpWriter, DurableWriter
from rallypoint.interfaces import CheckpointError, CheckpointStorage
from rallypoint.redact import redact_endpoint
from rallypoint.worker import notice_watch as notice
from rallypoint.worker import progress, variables

__all__ = [
    "PEER_FOLDER",
    "STATE_FILE",
    "URL_ENV",
    "Checkpoint",
    "Checkpointer",
    "open_storage",
    "ranks_tier",
    "shared_ranks",
]

#: The variable the agent sets from ``--checkpoint-dir``.
URL_ENV = variables.CHECKPOINT_URL
#: The agent's memory directory: where a peer's copies go (the node's own are in arena/).
PEER_FOLDER = "peer"


def open_storage(url: str) -> CheckpointStorage:
    """The storage of the checkpoint backend that serves ``url``'s scheme.

    Raises:
        CheckpointError: the backend could not open it. A plugin's ``open`` that raised
            anything else (its bug, or its client library's error) is one sentence naming
            the plugin, as a plugin failing in the agent is, not its own traceback.
    """
    from rallypoint.plugins import get_plugin_manager
    from rallypoint.registry import CHECKPOINT_BACKENDS, describe, plugin_failure

    store = get_plugin_manager().registry.checkpoint_backend_for(url)
    if store.open is None:
        raise CheckpointError(f"checkpoint backend {store.name!r} cannot open {url!r}")
    try:
        return store.open(url)
    except CheckpointError:
        raise
    except Exception as error:
        who = describe(CHECKPOINT_BACKENDS, store)
        outcome = f"no checkpoint can be saved to or loaded from {redact_endpoint(url)!r}"
        raise CheckpointError(plugin_failure(who, "open", error, outcome)) from None


class Checkpointer:
    """Checkpoints of one job: saved to one place, loaded from the newest complete copy
    anywhere.

    ``save`` writes from rank 0 only (replicated state, as with DDP); every rank can
    ``load_latest``. Under ``rallypoint run --checkpoint-memory`` saves go to this node's
    memory (the worker's arena, ``rallypoint.checkpoint.arena``), which the agent sends to
    a peer and copies to ``--checkpoint-dir``; else, or with ``storage`` given, to the
    durable storage, atomically (payload first, manifest last), the ``keep_last`` newest
    kept.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        keep_last: int = 3,
        storage: CheckpointStorage | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        url = url or os.environ.get(URL_ENV)
        memory = os.environ.get(variables.CHECKPOINT_MEMORY_DIR) if storage is None else None
        if storage is None and url:
            storage = open_storage(url)
        if storage is None and not memory:
            raise CheckpointError(
                "no checkpoint location: run under `rallypoint run --checkpoint-dir DIR` "
                f"or pass a URL (the agent sets {URL_ENV})"
            )
        self.durable = None if storage is None else Tier(storage, keep_last)
        #: The agent's memory directory (``--checkpoint-memory``): saves go to its arena.
        self.memory = Path(memory) if memory else None
        self.copies = None if self.memory is None else Copies(self.memory / slot.ARENA)
        self.peer = None
        if self.memory is not None:
            self.peer = Tier(FileStorage(str(self.memory / PEER_FOLDER)), 1, PEER)
        #: The step the round resumes from (decided by the agents), loaded in any tier.
        self.resume = variables.env_int(variables.CHECKPOINT_STEP) if memory else None
        self.keep_last = keep_last
        self.rank = (variables.env_int(variables.RANK) or 0) if rank is None else rank
        self.world_size = (
            (variables.env_int(variables.WORLD_SIZE) or 1) if world_size is None else world_size
        )
        #: How a save runs, by ``asynchronous``: decided here, once.
        self._modes = self._save_modes()
        self._dcp = SaveMode(Unstaged(), DcpWriter(self.durable, self.rank, self.world_size))

    def _save_modes(self) -> dict[bool, SaveMode]:
        """Into the arena, which copies the state itself (asynchronously or not, as the
        save says); or to ``--checkpoint-dir``, from the state itself (synchronous) or from
        its copy in host memory (asynchronous)."""
        if self.memory is not None:
            into_slot = SaveMode(Unstaged(), ArenaSlot(self.memory, self.rank, self.world_size))
            return {False: into_slot, True: into_slot}
        assert self.durable is not None  # the constructor refuses neither
        durable = DurableWriter(self.durable, self.world_size, settle=self.wait)
        return {False: SaveMode(Unstaged(), durable), True: SaveMode(HostStaging(), durable)}

    @property
    def storage(self) -> CheckpointStorage:
        """The durable storage (``--checkpoint-dir``)."""
        if self.durable is None:
            raise CheckpointError("no --checkpoint-dir: memory checkpoints only")
        return self.durable.storage

    # --- saving ---------------------------------------------------------------------------

    def should_save(self, step: int, every: int | None = None) -> bool:
        """Whether to save at ``step``: every ``every`` steps, and whenever the agent asks
        for a save on notice (its node was told to stop: ``rallypoint.worker.notice``).
        Call it on every rank at the end of each step::

            if store.should_save(step, every=100):
                store.save(state, step)

        A save on notice is the worker's last act in the round: ``save`` returns once the
        agent withdraws the notice, and the agent stops the worker first."""
        return notice.should_save(step, every)

    def save(self, state: Any, step: int, *, asynchronous: bool = False) -> None:
        """Save ``state`` (what ``torch.save`` takes) as the checkpoint of ``step``.

        Only rank 0 writes; on other ranks this returns at once. Under
        ``--checkpoint-memory`` the state's tensors are copied into the worker's arena in
        node memory (a pinned DMA for GPU tensors): a synchronous save returns once the copy
        is complete, so a worker killed right after loses nothing; an asynchronous one
        returns at once and is committed when its copy is done, every optimizer's next
        ``step`` waiting for that (``rallypoint.checkpoint.arena``). Without it, the state
        is written to ``--checkpoint-dir`` with ``torch.save``; with ``asynchronous`` from a
        copy in CPU memory, by a thread, one save at a time.

        Raises:
            CheckpointError: the checkpoint could not be written (a full disk, a read-only
                directory, no room left in ``--checkpoint-memory``), naming the cause; what
                it had written is removed and the checkpoints saved before are intact. An
                asynchronous save that fails logs the error at once and raises it from the
                next ``save`` or ``wait``, unless a newer save is complete by then.
        """
        progress.progress(step=step)  # every rank: the step is what the agent accounts by
        with progress.phase(progress.CHECKPOINT_SAVE):  # holding on notice included
            if self.rank == 0:
                self._modes[asynchronous].save(Job(state, step, asynchronous))
            self._hold_on_notice(step)

    def _hold_on_notice(self, step: int) -> None:
        """After a save on notice: the save complete, wait for the agent to stop us."""
        if notice.requested(step):
            self.wait()
            notice.hold(step)

    def wait(self) -> None:
        """Wait for the background saves to finish; raise the error of one that failed."""
        for mode in dict.fromkeys(self._modes.values()):
            mode.wait()

    # --- sharded state (torch.distributed.checkpoint) -------------------------------------

    def save_sharded(self, state: dict[str, Any], step: int, *, asynchronous: bool = False) -> None:
        """Save state sharded across ranks (FSDP2, DTensor, tensor parallelism); every rank
        calls it with its own state dict.

        Under ``--checkpoint-memory`` each rank copies its share into its arena, as
        ``save`` does (a ``DTensor``'s local shard, with its place in the whole tensor), and
        returns once its own copy is committed (``asynchronous`` as for ``save``); the agent
        sends it to a peer and copies it to ``--checkpoint-dir``. Without it, every rank
        writes its shards with ``torch.distributed.checkpoint`` to ``--checkpoint-dir`` (a
        path every node sees) and returns once the checkpoint is complete (manifest
        written)."""
        if self.memory is not None:
            self.save_shares(state, step, asynchronous=asynchronous)
            return
        with progress.phase(progress.CHECKPOINT_SAVE):
            self._dcp.save(Job(state, step))
            self._hold_on_notice(step)

    def save_shares(
        self,
        state: dict[str, Any],
        step: int,
        *,
        asynchronous: bool = False,
        placed: Placed | None = None,
    ) -> None:
        """This rank's share of a sharded state into its arena (``save_sharded`` under
        ``--checkpoint-memory``; ``placed`` as for ``Arena.save``)."""
        if self.memory is None:
            raise CheckpointError("no --checkpoint-memory: no arena to save into")
        progress.progress(step=step)
        job = Job(state, step, asynchronous, format="sharded", placed=placed)
        with progress.phase(progress.CHECKPOINT_SAVE):
            self._modes[asynchronous].save(job)
            self._hold_on_notice(step)

    def load_sharded(self, state: dict[str, Any]) -> Checkpoint | None:
        """Load the newest complete sharded checkpoint into ``state`` in place (every rank,
        each with its own state dict), ``None`` on a fresh start.

        At the world size that saved it, a rank loads its own share: from its node's
        memory, a peer's copy, or ``--checkpoint-dir``. At another world size the shares of
        every rank that saved it, from ``--checkpoint-dir``, are resharded by
        ``torch.distributed.checkpoint`` (``rallypoint.checkpoint.slot_reader``), as are
        checkpoints that ``save_sharded`` wrote there with DCP itself."""
        reading = loading_into(state)
        with progress.phase(progress.CHECKPOINT_LOAD):
            return newest(self._tiers().sharded(reading))

    # --- loading --------------------------------------------------------------------------

    def load_latest(
        self, *, map_location: Any = "cpu", weights_only: bool = True
    ) -> Checkpoint | None:
        """The newest checkpoint that is complete and intact, in node memory (this node's
        own copies, a peer's) or the durable storage (memory first when both hold a step),
        or ``None`` if there is none; ``source`` says which it came from. Under
        ``--checkpoint-memory``, none newer than the round's step.

        A newer one that is unfinished, truncated or fails its checksum is skipped with a
        warning naming it and the reason, and the one before it is loaded.
        ``map_location``: where the tensors go, as for ``torch.load`` (a device, or a dict
        from the saved device to another); a memory copy goes straight to a GPU.
        """
        options = {"map_location": map_location, "weights_only": weights_only}
        with progress.phase(progress.CHECKPOINT_LOAD):
            return newest(self._tiers().replicated(options))

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints anywhere (memory, a peer's, durable),
        oldest first."""
        return self._tiers().steps()

    def _tiers(self) -> Tiers:
        """The tiers a load looks in, as this checkpointer holds them now."""
        return Tiers(
            self.copies, self.peer, self.durable,
            rank=self.rank, world_size=self.world_size, resume=self.resume,
        )  # fmt: skip

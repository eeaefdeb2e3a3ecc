"""Saving and loading checkpoints in a worker: atomic, verified, rotated, optionally in the
background, whichever storage ``--checkpoint-dir`` names."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import mmap
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rallypoint import events
from rallypoint.checkpoint import arena, loading, slot
from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint.copies import FILE, FORMAT, SHARDED, Copies
from rallypoint.checkpoint.copying import Staging
from rallypoint.checkpoint.storage import FileStorage, Prefixed
from rallypoint.checkpoint.tier import BEGUN, DURABLE, MEMORY, PEER, Tier
from rallypoint.interfaces import CheckpointError, CheckpointStorage
from rallypoint.worker import channel as worker_channel
from rallypoint.worker import notice, progress, variables

logger = logging.getLogger("rallypoint.checkpoint")

#: The variable the agent sets from ``--checkpoint-dir``.
URL_ENV = variables.CHECKPOINT_URL
STATE_FILE = "state.pt"
SHARDS = "shards"
#: The agent's memory directory: where a peer's copies go (the node's own are in arena/).
PEER_FOLDER = "peer"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        step: the step it was saved at.
        world_size: the world size of the job that saved it.
        state: what was saved (``None`` for a sharded checkpoint, loaded in place).
        skipped: the newer checkpoints that were damaged or unfinished, with the reason.
        source: where it was loaded from: ``memory`` (this node's, ``--checkpoint-memory``),
            ``peer`` (a copy another node sent to this one's memory) or ``durable``
            (``--checkpoint-dir``).
    """

    step: int
    world_size: int
    state: Any = None
    skipped: tuple[str, ...] = field(default_factory=tuple)
    source: str = DURABLE


def open_storage(url: str) -> CheckpointStorage:
    """The storage of the checkpoint backend that serves ``url``'s scheme."""
    from rallypoint.plugins import get_plugin_manager

    store = get_plugin_manager().registry.checkpoint_backend_for(url)
    if store.open is None:
        raise CheckpointError(f"checkpoint backend {store.name!r} cannot open {url!r}")
    return store.open(url)


#: What a sharded candidate's ``open(stack)`` returns: a ``StorageReader`` over its files,
#: the world size that saved it, its size in bytes.
Opened = tuple[Any, int, int]
Opener = Callable[[contextlib.ExitStack], Opened]


@dataclass(frozen=True)
class _Candidate:
    """A copy a load may take: its step, where it is (``source``, ``order`` among copies of
    one step: memory first), and what loads it (the state, the saving world size)."""

    step: int
    order: int
    source: str
    where: str
    load: Callable[[], tuple[Any, int, int]]  # (state, world size, bytes)
    url: str = ""  # the storage it is in, which a refusal names


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
        memory = os.environ.get(variables.CHECKPOINT_MEMORY) if storage is None else None
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
        self._arena: arena.Arena | None = None
        self._staging = Staging()  # asynchronous saves to the durable storage

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
        progress.heartbeat(step=step)  # every rank: the step is what the agent accounts by
        if self.rank == 0:
            self._save(state, step, asynchronous)
        self._hold_on_notice(step)

    def _hold_on_notice(self, step: int) -> None:
        """After a save on notice: the save complete, wait for the agent to stop us."""
        if notice.requested(step):
            self.wait()
            notice.hold(step)

    def _save(self, state: Any, step: int, asynchronous: bool) -> None:
        if self.memory is not None:
            self._memory_arena().save(
                state, step, rank=self.rank, world_size=self.world_size, asynchronous=asynchronous
            )
            return
        began = time.perf_counter()
        self.wait()
        if not asynchronous:
            self._write(state, step, began, blocked=None)
            return
        # Copied into host memory first (the loop waits for none of it, its optimizer's
        # next step for the copy), then written by the copying thread.
        self._staging.stage(
            state,
            f"checkpoint of step {step}",
            began,
            lambda staged, blocked: self._write(staged, step, began, blocked),
        )

    def wait(self) -> None:
        """Wait for the background saves to finish; raise the error of one that failed."""
        if self._arena is not None:
            self._arena.wait()
        while (done := self._staging.copier.next_done()) is not None:
            if done.error is not None:
                raise CheckpointError(
                    f"the background checkpoint save failed: {done.error}"
                ) from done.error

    def _memory_arena(self) -> arena.Arena:
        if self._arena is None:
            assert self.memory is not None
            local_rank = variables.env_int(variables.NODE_LOCAL_RANK)
            self._arena = arena.for_process(
                self.memory,
                (variables.env_int(variables.LOCAL_RANK) or 0)
                if local_rank is None
                else local_rank,
                keep=variables.env_int(variables.CHECKPOINT_MEMORY_KEEP) or 1,
                budget=variables.env_int(variables.CHECKPOINT_MEMORY_BYTES),
                saved=_tell_agent,
            )
        return self._arena

    def _write(self, state: Any, step: int, began: float, blocked: float | None) -> None:
        import torch

        tier = self.durable
        assert tier is not None
        name = mf.directory(step)
        # A synchronous save holds up training: its writes are the worker's progress.
        writer: mf.HashingWriter | None = None
        try:
            tier.begin(step)
            with tier.writer(f"{name}/{STATE_FILE}") as handle:
                writer = mf.HashingWriter(handle, progress.heartbeat if blocked is None else None)
                torch.save(state, writer)  # type: ignore[arg-type]
            tier.commit(step, self.world_size, "torch", {STATE_FILE: writer.entry})
        except Exception as error:
            raise tier.failed(step, (writer and writer.error) or error) from error
        seconds = time.perf_counter() - began
        worker_channel.send(
            "checkpoint_saved",
            step=step,
            seconds=seconds,
            bytes=writer.size,
            blocked_seconds=seconds if blocked is None else blocked,
            asynchronous=blocked is not None,
            tier=tier.source,
        )

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
        self._save_dcp(state, step)
        self._hold_on_notice(step)

    def _save_dcp(self, state: dict[str, Any], step: int) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        began = time.perf_counter()
        tier = self._sharded_tier()
        path = _local_path(tier, f"{mf.directory(step)}/{SHARDS}")
        if self.rank == 0:
            tier.begin(step)
        dcp_save(state, checkpoint_id=path)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.barrier()  # every shard is written before the manifest
        if self.rank != 0:
            if distributed:
                dist.barrier()  # returns once rank 0 has written the manifest
            return
        files = {}
        for name in tier.storage.names():
            prefix = f"{mf.directory(step)}/{SHARDS}/"
            if name.startswith(prefix) and not name.endswith(f"/{BEGUN}"):
                with tier.storage.reader(name) as handle:
                    files[name.removeprefix(f"{mf.directory(step)}/")] = _entry(handle.read())
        tier.commit(step, self.world_size, "dcp", files)
        if distributed:
            dist.barrier()  # every rank returns with the checkpoint complete
        total = sum(entry.size for entry in files.values())
        seconds = time.perf_counter() - began
        worker_channel.send(
            "checkpoint_saved",
            step=step,
            seconds=seconds,
            bytes=total,
            blocked_seconds=seconds,
            asynchronous=False,
            tier=tier.source,
        )

    def load_sharded(self, state: dict[str, Any]) -> Checkpoint | None:
        """Load the newest complete sharded checkpoint into ``state`` in place (every rank,
        each with its own state dict), ``None`` on a fresh start.

        At the world size that saved it, a rank loads its own share: from its node's
        memory, a peer's copy, or ``--checkpoint-dir``. At another world size the shares of
        every rank that saved it, from ``--checkpoint-dir``, are resharded by
        ``torch.distributed.checkpoint`` (``rallypoint.checkpoint.slot_reader``), as are
        checkpoints that ``save_sharded`` wrote there with DCP itself."""
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        def reading(open_reader: Opener) -> Callable[[], tuple[Any, int, int]]:
            def load() -> tuple[Any, int, int]:
                with contextlib.ExitStack() as stack:
                    reader, world, size = open_reader(stack)
                    with warnings.catch_warnings():  # no_dist: this rank reads alone
                        warnings.simplefilter("ignore", UserWarning)
                        dcp_load(state, storage_reader=reader, no_dist=True)
                return None, world, size

            return load

        return self._load_newest(self._sharded_candidates(reading))

    def _sharded_candidates(
        self, reading: Callable[[Opener], Callable[[], tuple[Any, int, int]]]
    ) -> list[_Candidate]:
        """Every sharded checkpoint this rank could load, each loaded by ``reading(open)``:
        ``open(stack)`` checks its files, holds them open in ``stack``, and returns a
        ``StorageReader`` over them, the world size that saved it and its size."""
        candidates = []
        if self.copies is not None:
            for copy in self.copies.newest(self.rank, self.resume, sharded=True):
                if copy.record.world_size != self.world_size:
                    continue

                def open_copy(stack: contextlib.ExitStack, copy: slot.Copy = copy) -> Opened:
                    try:
                        stack.enter_context(slot.lease(copy))
                    except slot.Busy:
                        raise mf.Damaged("written over while it was read") from None
                    return _slot_reader([copy.path]), copy.record.world_size, copy.record.size

                where = f"{mf.directory(copy.step)} ({MEMORY})"
                candidates.append(_Candidate(copy.step, 0, MEMORY, where, reading(open_copy)))

        def read_with(opener: Callable[[str, mf.Manifest, contextlib.ExitStack], Opened]) -> Any:
            """A format's ``(name, manifest) -> (state, bytes)`` for ``_tier_candidates``."""

            def read(name: str, manifest: mf.Manifest) -> tuple[Any, int]:
                state, _, size = reading(functools.partial(opener, name, manifest))()
                return state, size

            return read

        if self.peer is not None:
            mine = ranks_tier(self.peer, self.rank)

            def open_peer(name: str, manifest: mf.Manifest, stack: contextlib.ExitStack) -> Opened:
                reader, size = _open_shares(stack, [(mine, name, manifest)])
                return reader, manifest.world_size, size

            candidates += self._tier_candidates(mine, 1, {FORMAT: read_with(open_peer)})
        if self.durable is not None:
            candidates += self._shared_candidates(self.durable, reading)
            durable = self.durable

            def open_dcp(name: str, manifest: mf.Manifest, stack: contextlib.ExitStack) -> Opened:
                from torch.distributed.checkpoint.filesystem import FileSystemReader

                durable.verify_files(name, manifest)
                size = sum(entry.size for entry in manifest.files.values())
                reader = FileSystemReader(_local_path(durable, f"{name}/{SHARDS}"))
                return reader, manifest.world_size, size

            candidates += self._tier_candidates(durable, 3, {"dcp": read_with(open_dcp)})
        if self.resume is not None:
            candidates = [c for c in candidates if c.step <= self.resume]
        if not candidates and self.durable is None and self.memory is None:
            self._sharded_tier()  # says what is missing
        return candidates

    def _shared_candidates(
        self, durable: Tier, reading: Callable[[Opener], Callable[[], tuple[Any, int, int]]]
    ) -> list[_Candidate]:
        """The sharded memory copies the agents made durable: a step every rank of the
        world that saved it made durable, loaded (resharded) from all of their shares."""
        steps: dict[int, list[Tier]] = {}
        for tier in (ranks_tier(durable, rank) for rank in shared_ranks(durable)):
            for step in tier.complete_steps():
                steps.setdefault(step, []).append(tier)
        found = []
        for step, held in steps.items():
            name = mf.directory(step)

            def open_all(
                stack: contextlib.ExitStack, name: str = name, held: list[Tier] = held
            ) -> Opened:
                manifests = [(tier, name, tier.manifest(name)) for tier in held]
                world = manifests[0][2].world_size
                if len(manifests) < world:
                    raise mf.Damaged(f"{len(manifests)} of the {world} ranks' shares made durable")
                reader, size = _open_shares(stack, manifests)
                return reader, world, size

            where = f"{name} ({DURABLE})"
            found.append(_Candidate(step, 2, DURABLE, where, reading(open_all), durable.url))
        return found

    def save_shares(
        self,
        state: dict[str, Any],
        step: int,
        *,
        asynchronous: bool = False,
        placed: Mapping[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
    ) -> None:
        """This rank's share of a sharded state into its arena (``save_sharded`` under
        ``--checkpoint-memory``; ``placed`` as for ``Arena.save``)."""
        if self.memory is None:
            raise CheckpointError("no --checkpoint-memory: no arena to save into")
        progress.heartbeat(step=step)
        self._memory_arena().save(
            state, step, rank=self.rank, world_size=self.world_size, format="sharded",
            asynchronous=asynchronous, placed=placed,
        )  # fmt: skip
        self._hold_on_notice(step)

    def _sharded_tier(self) -> Tier:
        if self.durable is None:
            raise CheckpointError(
                "sharded checkpoints need a shared file system path as --checkpoint-dir; "
                "they do not go to --checkpoint-memory"
            )
        return self.durable

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
        candidates = []
        if self.copies is not None:
            for copy in self.copies.newest(rank=0, most=self.resume):

                def load(copy: slot.Copy = copy) -> tuple[Any, int, int]:
                    try:
                        state = loading.load_copy(copy, **options)
                    except slot.Busy:
                        raise mf.Damaged("written over while it was read") from None
                    return state, copy.record.world_size, copy.record.size

                where = f"{mf.directory(copy.step)} ({MEMORY})"
                candidates.append(_Candidate(copy.step, 0, MEMORY, where, load))
        readers = {
            "torch": lambda tier, name, manifest: _load_torch(tier, name, manifest, options),
            FORMAT: lambda tier, name, manifest: _load_slot_file(tier, name, manifest, options),
        }
        for order, tier in enumerate(t for t in (self.peer, self.durable) if t is not None):
            formats = {
                name: (lambda name, manifest, read=read, tier=tier: read(tier, name, manifest))
                for name, read in readers.items()
            }
            candidates += self._tier_candidates(tier, order + 1, formats)
        if self.resume is not None:
            # Every rank of the round loads the same step: none newer than the round's.
            candidates = [c for c in candidates if c.step <= self.resume]
            if not any(c.step == self.resume for c in candidates):
                logger.warning(
                    "this node holds no copy of step %d, the round's checkpoint: loading an "
                    "older one, which the other nodes' ranks will not",
                    self.resume,
                )
        return self._load_newest(candidates)

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints anywhere (memory, a peer's, durable),
        oldest first."""
        found = set() if self.copies is None else self.copies.complete_steps()
        for tier in (self.peer, self.durable):
            if tier is not None:
                found |= tier.complete_steps()
        return sorted(found)

    def _tier_candidates(
        self, tier: Tier, order: int, formats: Mapping[str, Callable[[str, mf.Manifest], Any]]
    ) -> list[_Candidate]:
        """A candidate per checkpoint in ``tier``, loaded by its format's function (``(name,
        manifest) -> (state, bytes)``)."""
        found = []
        for step in tier.all_steps():
            name = mf.directory(step)

            def load(name: str = name) -> tuple[Any, int, int]:
                manifest = tier.manifest(name)
                read = formats.get(manifest.format)
                if read is None:
                    raise mf.Damaged(
                        f"it is a {manifest.format} checkpoint, not {' or '.join(formats)}"
                    )
                state, size = read(name, manifest)
                return state, manifest.world_size, size

            where = f"{name} ({tier.source})"
            found.append(_Candidate(step, order, tier.source, where, load, tier.url))
        return found

    def _load_newest(self, candidates: list[_Candidate]) -> Checkpoint | None:
        """The newest candidate that loads; of two copies of one step, the first's."""
        began = time.perf_counter()
        skipped: list[str] = []
        several = len({c.source for c in candidates}) > 1
        for candidate in sorted(candidates, key=lambda c: (-c.step, c.order)):
            where = candidate.where if several else mf.directory(candidate.step)
            try:
                state, world_size, size = candidate.load()
            except mf.Damaged as reason:
                skipped.append(f"{where}: {reason}")
                logger.warning("checkpoint %s skipped: %s", where, reason)
                if isinstance(reason, mf.Unsafe):  # written by no rallypoint: the agent counts it
                    peer = candidate.url or candidate.where
                    worker_channel.send(events.PEER_REFUSED, peer=peer, reason=str(reason))
                continue
            if skipped:
                logger.warning("loaded checkpoint %s instead", where)
            worker_channel.send(
                "checkpoint_loaded",
                step=candidate.step,
                seconds=time.perf_counter() - began,
                bytes=size,
                skipped=len(skipped),
                source=candidate.source,
            )
            return Checkpoint(candidate.step, world_size, state, tuple(skipped), candidate.source)
        return None


def ranks_tier(tier: Tier, rank: int) -> Tier:
    """The checkpoints of ``rank``'s shares in ``tier``'s storage (``sharded/rank-R/``)."""
    return Tier(
        Prefixed(tier.storage, SHARDED.format(rank=rank)), tier.keep_last, tier.source, tier.budget
    )


def shared_ranks(tier: Tier) -> set[int]:
    """The ranks whose shares ``tier``'s storage holds (``sharded/rank-R/``, R below
    ``manifest.MAX_RANKS``, spelt as ``ranks_tier`` spells it)."""
    found = set()
    for name in tier.storage.names():
        match = _RANK_FOLDER.match(name)
        if match is not None:
            rank = int(match.group(2))
            if rank < mf.MAX_RANKS and SHARDED.format(rank=rank) == match.group(1):
                found.add(rank)
    return found


_RANK_FOLDER = re.compile(r"(sharded/rank-([0-9]{5,7}))/")


def _slot_reader(paths: list[Path]) -> Any:
    from rallypoint.checkpoint.slot_reader import SlotReader

    return SlotReader(paths)


def _open_shares(
    stack: contextlib.ExitStack, found: list[tuple[Tier, str, mf.Manifest]]
) -> tuple[Any, int]:
    """A ``SlotReader`` over shares in checkpoint folders (``(tier, name, manifest)``
    each), each file checked against its manifest first and kept open in ``stack``; and
    their size."""
    paths = []
    size = 0
    for tier, name, manifest in found:
        (file_name, _), *_ = manifest.files.items()  # a share's one file, rank-R.slot
        path, entry = stack.enter_context(_verified_file(tier, name, manifest, file_name))
        paths.append(path)
        size += entry.size
    return _slot_reader(paths), size


def _tell_agent(saved: arena.Saved) -> None:
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


def _load_torch(
    tier: Tier, name: str, manifest: mf.Manifest, options: dict[str, Any]
) -> tuple[Any, int]:
    """A checkpoint ``torch.save`` wrote (``save`` to durable storage)."""
    import torch

    entry = manifest.files.get(STATE_FILE)
    if entry is None:
        raise mf.Damaged(f"the manifest lists no {STATE_FILE}")
    data = tier.read(f"{name}/{STATE_FILE}")
    mf.verify(STATE_FILE, data, entry)
    state = torch.load(
        io.BytesIO(data), map_location=options["map_location"], weights_only=options["weights_only"]
    )
    return state, entry.size


def _load_slot_file(
    tier: Tier, name: str, manifest: mf.Manifest, options: dict[str, Any]
) -> tuple[Any, int]:
    """A memory checkpoint an agent sent or made durable: a slot's bytes in one file,
    checked against its manifest, then loaded as a slot is (from a local file as it lies;
    from another storage, through a temporary file)."""
    verified = _verified_file(tier, name, manifest, FILE.format(rank=0))
    with verified as (path, entry), open(path, "rb") as handle:
        record, _ = slot.read(handle)
        return loading.load_file(handle.fileno(), record, path, **options), entry.size


@contextlib.contextmanager
def _verified_file(
    tier: Tier, name: str, manifest: mf.Manifest, file_name: str
) -> Iterator[tuple[Path, mf.FileEntry]]:
    """The file ``file_name`` of checkpoint ``name`` on this machine (``_local_file``),
    checked against its manifest entry, which comes with it."""
    entry = manifest.files.get(file_name)
    if entry is None:
        raise mf.Damaged(f"the manifest lists no {file_name}")
    with _local_file(tier, f"{name}/{file_name}") as path:
        with open(path, "rb") as handle:
            mf.verify(file_name, _mapped(handle), entry)
        yield path, entry


@contextlib.contextmanager
def _local_file(tier: Tier, name: str) -> Iterator[Path]:
    """The file ``name`` of ``tier`` on this machine: where it lies, or a temporary copy."""
    storage = tier.storage
    path = storage.path(name) if isinstance(storage, (FileStorage, Prefixed)) else None
    if path is not None:
        if not path.is_file():
            raise mf.Damaged(f"{name.rsplit('/', 1)[-1]} is missing")
        yield path
        return
    import tempfile

    with tempfile.NamedTemporaryFile(prefix="rallypoint-load-") as copy:
        copy.write(tier.read(name))
        copy.flush()
        yield Path(copy.name)


def _local_path(tier: Tier, name: str) -> str:
    if not isinstance(tier.storage, FileStorage):
        raise CheckpointError(f"sharded checkpoints need a file system path, not {tier.url!r}")
    return str(tier.storage.path(name))


def _mapped(handle: Any) -> Any:
    """A file's bytes, mapped (read only) to be checked: no copy of it is made."""
    size = os.fstat(handle.fileno()).st_size
    return mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ) if size else b""


def _entry(data: bytes) -> mf.FileEntry:
    import hashlib

    return mf.FileEntry(len(data), hashlib.sha256(data).hexdigest())

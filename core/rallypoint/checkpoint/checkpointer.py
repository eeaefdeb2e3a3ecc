"""Saving and loading checkpoints in a worker: atomic, verified, rotated, optionally in the
background, whichever storage ``--checkpoint-dir`` names."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint import writers
from rallypoint.checkpoint.storage import FileStorage
from rallypoint.checkpoint.tier import BEGUN, DURABLE, MEMORY, PEER, NoRoom, Tier, room_error
from rallypoint.interfaces import CheckpointError, CheckpointStorage
from rallypoint.worker import channel as worker_channel
from rallypoint.worker import env, progress
from rallypoint.worker.lifetime import die_with_parent

logger = logging.getLogger("rallypoint.checkpoint")

#: Saves to node memory written at once: a save begins while the one before it is still
#: being written (a worker that dies meanwhile loses neither), but not while two are.
IN_FLIGHT = 2

#: The variable the agent sets from ``--checkpoint-dir``.
URL_ENV = env.CHECKPOINT_URL
STATE_FILE = "state.pt"
SHARDS = "shards"


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


@dataclass
class _Pending:
    """A background save: its step, the thread that writes it (or waits for its writer),
    the state's bytes it will add to its tier, and the error it failed with."""

    step: int
    thread: threading.Thread | None = None
    size: int = 0
    error: BaseException | None = None


def memory_tiers() -> list[Tier]:
    """This node's memory tiers as the agent's ``--checkpoint-memory`` set them up for the
    workers (its own copies, where saves go, and the copy a peer sent); none without it."""
    path = os.environ.get(env.CHECKPOINT_MEMORY)
    if not path:
        return []
    budget = env.env_int(env.CHECKPOINT_MEMORY_BYTES)
    keep = env.env_int(env.CHECKPOINT_MEMORY_KEEP) or 1
    return [
        Tier(FileStorage(os.path.join(path, writers.CHECKPOINTS)), keep, MEMORY, budget),
        Tier(FileStorage(os.path.join(path, writers.PEER)), 1, PEER, budget),
    ]


class Checkpointer:
    """Checkpoints of one job: saved to one tier, loaded from the newest complete copy in
    any.

    ``save`` writes from rank 0 only (replicated state, as with DDP); every rank can
    ``load_latest``. A save is atomic: payload first, manifest last, each through the
    storage's atomic write; the ``keep_last`` newest checkpoints are kept. Under
    ``rallypoint run --checkpoint-memory``, saves go to this node's memory (the agent
    copies them to ``--checkpoint-dir``), unless ``storage`` is given.
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
        memory = memory_tiers() if storage is None else []
        if storage is None and url:
            storage = open_storage(url)
        if storage is None and not memory:
            raise CheckpointError(
                "no checkpoint location: run under `rallypoint run --checkpoint-dir DIR` "
                f"or pass a URL (the agent sets {URL_ENV})"
            )
        self.durable = None if storage is None else Tier(storage, keep_last)
        self.memory = memory[0] if memory else None
        #: Saves go to the first: node memory when there is some, else the durable storage.
        self.tiers = [*memory, *([self.durable] if self.durable is not None else [])]
        #: The step the round resumes from (decided by the agents), loaded in any tier.
        self.resume = env.env_int(env.CHECKPOINT_STEP) if memory else None
        self.keep_last = keep_last
        self.rank = (env.env_int(env.RANK) or 0) if rank is None else rank
        self.world_size = (env.env_int(env.WORLD_SIZE) or 1) if world_size is None else world_size
        self._pending: list[_Pending] = []  # oldest first

    @property
    def storage(self) -> CheckpointStorage:
        """The storage saves go to."""
        return self.tiers[0].storage

    # --- saving ---------------------------------------------------------------------------

    def save(self, state: Any, step: int, *, asynchronous: bool = False) -> None:
        """Save ``state`` (anything ``torch.save`` takes) as the checkpoint of ``step``.

        Only rank 0 writes; on other ranks this returns at once. With ``asynchronous``,
        training goes on while the file is written, from a snapshot of ``state`` taken now:
        state in CPU memory is snapshotted by forking a writer process (copy-on-write:
        no copy while the caller waits), state on a GPU is copied to CPU memory and
        written by a background thread. A crash during the write leaves the previous
        checkpoint as the newest; in node memory the writer outlives a crash of the
        worker, and finishes the copy. A save waits for the previous one to finish,
        except in node memory: there it waits only while two are being written (or
        while the tier has no room for one more), so that a crash right after ``save``
        returns loses no step.

        Raises:
            CheckpointError: the checkpoint could not be written (a full disk, a read-only
                directory, no room left in ``--checkpoint-memory``), naming the cause; what
                it had written is removed and the checkpoints saved before are intact. An
                asynchronous save that fails logs the error at once and raises it from the
                next ``save`` or ``wait``, unless a newer save is complete by then.
        """
        progress.heartbeat(step=step)  # every rank: the step is what the agent accounts by
        if self.rank != 0:
            return
        began = time.perf_counter()
        forked = asynchronous and hasattr(os, "fork") and _in_cpu_memory(state)
        size = _tensor_bytes(state) if asynchronous else 0
        if forked and self.tiers[0] is self.memory:
            self._make_way(size)
        else:
            self.wait()
        if not asynchronous:
            self._write(state, step, began, blocked=None)
            return
        pending = _Pending(step, size=size)
        if forked:
            background = self._fork_writer(state, step, began, pending)
        else:
            snapshot = snapshot_to_cpu(state)
            blocked = time.perf_counter() - began

            def background() -> None:
                self._write_in_background(snapshot, step, began, blocked, pending)

        pending.thread = threading.Thread(
            target=background, name=f"rallypoint-checkpoint-{step}"
        )  # not a daemon: a worker that returns normally finishes its last save first
        pending.thread.start()
        self._pending.append(pending)

    def wait(self) -> None:
        """Wait for the background saves to finish; raise the error of one that failed."""
        while self._pending:
            self._finish_oldest()

    def _make_way(self, size: int) -> None:
        """Before a save to node memory: finish the saves already written; wait for the
        oldest while IN_FLIGHT are being written, or while the tier's budget has no room
        for ``size`` more bytes beside what they will take."""
        while self._pending and not self._pending[0].thread.is_alive():  # type: ignore[union-attr]
            self._finish_oldest()
        tier = self.tiers[0]
        while self._pending:
            writing = sum(p.size for p in self._pending)
            room = None if tier.budget is None else tier.budget - tier.used() - writing
            if len(self._pending) < IN_FLIGHT and (room is None or size <= room):
                return
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        """Wait for the oldest background save; raise its error, unless a save begun after
        it is complete (its step is superseded: nothing is lost)."""
        pending = self._pending.pop(0)
        assert pending.thread is not None
        pending.thread.join()
        error = pending.error
        if error is None:
            return
        if self._pending and max(self.tiers[0].complete_steps(), default=-1) > pending.step:
            logger.info("checkpoint %d not saved (%s); a newer one is", pending.step, error)
            return
        raise CheckpointError(f"the background checkpoint save failed: {error}") from error

    def _fork_writer(
        self, state: Any, step: int, began: float, pending: _Pending
    ) -> Callable[[], None]:
        """Fork a process that writes ``state`` as the fork left it; return what waits
        for it. The child shares the parent's memory copy-on-write, so the parent only
        pays for the pages it changes while the child writes.

        A writer to durable storage dies with the worker. A writer to node memory outlives
        it, in a session of its own (the worker's process group is killed on a restart),
        and says so in the tier (``writers.mark``): the agent waits for it before it
        stops what the workers left behind, so a crash loses no step that was saved."""
        outlive = self.tiers[0] is self.memory
        if outlive:
            self._check_room(pending.size, step)
        parent = os.getpid()
        errors, error_pipe = os.pipe()  # the child's error, for the parent to raise
        wall = time.time() - (time.perf_counter() - began)
        pid = os.fork()
        if pid == 0:  # the child: write, report, and leave without running any cleanup
            code = 1
            try:
                if outlive:  # out of the worker's group first: a restart's SIGTERM misses it
                    os.setsid()
                os.close(errors)
                _without_zip_checksums()
                if outlive:
                    self._write_to_memory(state, step, wall, time.perf_counter() - began)
                else:
                    die_with_parent(parent)  # a worker killed mid-write takes the write along
                    self._write(state, step, began, blocked=time.perf_counter() - began)
                code = 0
            except BaseException as error:
                logger.error("asynchronous save: %s", error)
                with contextlib.suppress(BaseException):  # a pipe's buffer holds 4 KiB
                    os.write(error_pipe, str(error).encode()[:4096])
            finally:
                os._exit(code)
        os.close(error_pipe)
        if outlive:
            writers.mark(os.environ[env.CHECKPOINT_MEMORY], pid)

        def wait_for_child() -> None:
            _, status = os.waitpid(pid, 0)
            if outlive:  # gone for good now (reaped): its exit took a while to finish
                writers.unmark(os.environ[env.CHECKPOINT_MEMORY], pid)
            with os.fdopen(errors, "rb") as pipe:
                message = pipe.read().decode("utf-8", "replace")
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                reason = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                pending.error = CheckpointError(
                    message or f"the process writing checkpoint {step} failed ({reason})"
                )

        return wait_for_child

    def _check_room(self, size: int, step: int) -> None:
        """Before a memory save forks: its tensors alone (``size`` bytes) must fit in the
        tier's budget, beside the copies it keeps (the exact size is checked once it is
        written)."""
        tier = self.tiers[0]
        if tier.budget is None:
            return
        room = tier.budget - tier.used()
        if size > room:
            raise CheckpointError(room_error(f"{mf.directory(step)}/{STATE_FILE}", tier, room))

    def _write_to_memory(self, state: Any, step: int, began: float, blocked: float) -> None:
        """A save to node memory, in the writer: ``torch.save`` straight to a file there
        (the fastest way out), then let go of the worker's memory (as long as the writer
        maps it, every page training changes is copied), then hash the file and write the
        manifest. ``began``: wall time."""
        import torch

        tier = self.tiers[0]
        assert isinstance(tier.storage, FileStorage)
        name = f"{mf.directory(step)}/{STATE_FILE}"
        target = tier.storage.path(name)
        partial = target.with_name(f".tmp-{STATE_FILE}-{os.getpid()}")
        try:
            tier.begin(step)
            torch.save(state, partial)
            os.replace(partial, target)
            _release(state)
            entry = _file_entry(target)
            room = tier.budget - tier.used() if tier.budget is not None else None
            if room is not None and entry.size > room:
                raise NoRoom(room_error(name, tier, room))
            tier.commit(step, self.world_size, "torch", {STATE_FILE: entry})
        except BaseException as error:
            partial.unlink(missing_ok=True)
            raise tier.failed(step, error) from error
        worker_channel.send(
            "checkpoint_saved",
            step=step,
            seconds=time.time() - began,
            bytes=entry.size,
            blocked_seconds=blocked,
            asynchronous=True,
            tier=tier.source,
        )

    def _write_in_background(
        self, state: Any, step: int, began: float, blocked: float, pending: _Pending
    ) -> None:
        try:
            self._write(state, step, began, blocked)
        except BaseException as error:
            logger.error("asynchronous save: %s", error)
            pending.error = error

    def _write(self, state: Any, step: int, began: float, blocked: float | None) -> None:
        import torch

        tier = self.tiers[0]
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

    def save_sharded(self, state: dict[str, Any], step: int) -> None:
        """Save state sharded across ranks with ``torch.distributed.checkpoint``; every
        rank calls it, and every rank returns once the checkpoint is complete (manifest
        written). Needs a file system storage (a path shared by every node) as
        ``--checkpoint-dir``; sharded saves do not go to node memory."""
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
        """Load the newest valid sharded checkpoint into ``state`` in place (every rank)."""
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        tier = self._sharded_tier()

        def load(tier: Tier, name: str, manifest: mf.Manifest) -> None:
            tier.verify_files(name, manifest)
            dcp_load(state, checkpoint_id=_local_path(tier, f"{name}/{SHARDS}"))

        return self._load_newest("dcp", load, [tier])

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
        """The newest checkpoint that is complete and intact, in node memory or the durable
        storage (memory first when both hold a step), or ``None`` if there is none;
        ``source`` says which it came from.

        A newer one that is unfinished, truncated or fails its checksum is skipped with a
        warning naming it and the reason, and the one before it is loaded.
        """
        import torch

        loaded: list[Any] = []

        def load(tier: Tier, name: str, manifest: mf.Manifest) -> None:
            entry = manifest.files.get(STATE_FILE)
            if entry is None:
                raise mf.Damaged(f"the manifest lists no {STATE_FILE}")
            data = tier.read(f"{name}/{STATE_FILE}")
            mf.verify(STATE_FILE, data, entry)
            loaded.append(
                torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
            )

        checkpoint = self._load_newest("torch", load, self.tiers, self.resume)
        if checkpoint is None:
            return None
        return replace(checkpoint, state=loaded[0])

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints (manifest written) in any tier, oldest
        first."""
        return sorted(set().union(*(tier.complete_steps() for tier in self.tiers)))

    def _load_newest(
        self, format_: str, load: Any, tiers: list[Tier], resume: int | None = None
    ) -> Checkpoint | None:
        began = time.perf_counter()
        skipped: list[str] = []
        # Newest first; of two copies of one step, the first tier's (memory: faster).
        candidates = sorted(
            ((step, -i, tier) for i, tier in enumerate(tiers) for step in tier.all_steps()),
            key=lambda c: (c[0], c[1]),
            reverse=True,
        )
        if resume is not None:
            # Every rank of the round loads the same step: none newer than the round's.
            candidates = [c for c in candidates if c[0] <= resume]
            if not any(step == resume for step, _, _ in candidates):
                logger.warning(
                    "this node holds no copy of step %d, the round's checkpoint: loading an "
                    "older one, which the other nodes' ranks will not",
                    resume,
                )
        for step, _, tier in candidates:
            name = mf.directory(step)
            where = f"{name} ({tier.source})" if len(tiers) > 1 else name
            try:
                manifest = tier.manifest(name)
                if manifest.format != format_:
                    raise mf.Damaged(f"it is a {manifest.format} checkpoint, not {format_}")
                load(tier, name, manifest)
            except mf.Damaged as reason:
                skipped.append(f"{where}: {reason}")
                logger.warning("checkpoint %s skipped: %s", where, reason)
                continue
            if skipped:
                logger.warning("loaded checkpoint %s instead", where)
            size = sum(entry.size for entry in manifest.files.values())
            worker_channel.send(
                "checkpoint_loaded",
                step=step,
                seconds=time.perf_counter() - began,
                bytes=size,
                skipped=len(skipped),
                source=tier.source,
            )
            return Checkpoint(step, manifest.world_size, None, tuple(skipped), tier.source)
        return None


def _local_path(tier: Tier, name: str) -> str:
    if not isinstance(tier.storage, FileStorage):
        raise CheckpointError(f"sharded checkpoints need a file system path, not {tier.url!r}")
    return str(tier.storage.path(name))


def _without_zip_checksums() -> None:
    """In a writer process: ``torch.save`` leaves out the CRC-32 of each record of its zip
    file (a third of the time of a save to memory): the manifest's SHA-256 of the whole
    file is what a load checks, and ``torch.load`` reads such a file as any other."""
    import torch.serialization

    setter = getattr(torch.serialization, "set_crc32_options", None)  # torch 2.6 and later
    if setter is not None:
        setter(False)


def _release(state: Any) -> None:
    """In a writer forked from the worker, once ``state`` is written: unmap its tensors'
    memory here (``MADV_DONTNEED``), so that the worker's pages are its own again and
    training writes them without the kernel copying each first. Best effort."""
    import ctypes

    import torch

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = os.sysconf("SC_PAGE_SIZE")
    seen: set[int] = set()
    for tensor in _tensors(state):
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if start in seen or not size:
            continue
        seen.add(start)
        first = -(-start // page) * page  # whole pages inside the storage only
        last = (start + size) // page * page
        if last > first:
            madvise(first, last - first, _MADV_DONTNEED)
    del torch


_MADV_DONTNEED = 4


def _tensors(state: Any) -> list[Any]:
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, Mapping):
        return [t for value in state.values() for t in _tensors(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in _tensors(value)]
    return []


def _file_entry(path: Any) -> mf.FileEntry:
    """The size and SHA-256 of the file at ``path``, hashed where it lies (mapped: a file
    in shared memory is not copied to be read)."""
    import hashlib
    import mmap

    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if not size:
            return mf.FileEntry(0, hashlib.sha256().hexdigest())
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return mf.FileEntry(size, hashlib.sha256(mapped).hexdigest())


def _tensor_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (what its ``torch.save`` holds, but a little)."""
    return sum(t.numel() * t.element_size() for t in _tensors(state))


def _in_cpu_memory(state: Any) -> bool:
    """Whether every tensor in ``state`` lives in CPU memory (what a fork can snapshot)."""
    return all(t.device.type == "cpu" for t in _tensors(state))


def snapshot_to_cpu(state: Any) -> Any:
    """A copy of ``state`` whose tensors live in CPU memory, independent of the original:
    training may change the originals while the copy is written."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, Mapping):
        result: dict[Any, Any] = OrderedDict() if isinstance(state, OrderedDict) else {}
        result.update((k, snapshot_to_cpu(v)) for k, v in state.items())
        if hasattr(state, "_metadata"):  # a module's state_dict keeps its versions here
            result._metadata = copy.deepcopy(state._metadata)  # type: ignore[attr-defined]
        return result
    if isinstance(state, list):
        return [snapshot_to_cpu(v) for v in state]
    if isinstance(state, tuple):
        items = [snapshot_to_cpu(v) for v in state]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    return copy.deepcopy(state)


def _entry(data: bytes) -> mf.FileEntry:
    import hashlib

    return mf.FileEntry(len(data), hashlib.sha256(data).hexdigest())

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
from dataclasses import dataclass, field
from typing import Any

from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint.storage import FileStorage
from rallypoint.interfaces import CheckpointError, CheckpointStorage
from rallypoint.worker import channel as worker_channel
from rallypoint.worker import env, progress
from rallypoint.worker.lifetime import die_with_parent

logger = logging.getLogger("rallypoint.checkpoint")

#: The variable the agent sets from ``--checkpoint-dir``.
URL_ENV = env.CHECKPOINT_URL
STATE_FILE = "state.pt"
BEGUN = "begun"  # written first: a checkpoint with it and no manifest was never finished
SHARDS = "shards"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        step: the step it was saved at.
        world_size: the world size of the job that saved it.
        state: what was saved (``None`` for a sharded checkpoint, loaded in place).
        skipped: the newer checkpoints that were damaged or unfinished, with the reason.
    """

    step: int
    world_size: int
    state: Any = None
    skipped: tuple[str, ...] = field(default_factory=tuple)


def open_storage(url: str) -> CheckpointStorage:
    """The storage of the checkpoint backend that serves ``url``'s scheme."""
    from rallypoint.plugins import get_plugin_manager

    store = get_plugin_manager().registry.checkpoint_backend_for(url)
    if store.open is None:
        raise CheckpointError(f"checkpoint backend {store.name!r} cannot open {url!r}")
    return store.open(url)


class Checkpointer:
    """Checkpoints of one job in one storage.

    ``save`` writes from rank 0 only (replicated state, as with DDP); every rank can
    ``load_latest``. A save is atomic: payload first, manifest last, each through the
    storage's atomic write; the ``keep_last`` newest checkpoints are kept.
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
        if storage is None:
            if not url:
                raise CheckpointError(
                    "no checkpoint location: run under `rallypoint run --checkpoint-dir DIR` "
                    f"or pass a URL (the agent sets {URL_ENV})"
                )
            storage = open_storage(url)
        if keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}: keep at least one checkpoint")
        self.storage = storage
        self.keep_last = keep_last
        self.rank = (env.env_int(env.RANK) or 0) if rank is None else rank
        self.world_size = (env.env_int(env.WORLD_SIZE) or 1) if world_size is None else world_size
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None

    # --- saving ---------------------------------------------------------------------------

    def save(self, state: Any, step: int, *, asynchronous: bool = False) -> None:
        """Save ``state`` (anything ``torch.save`` takes) as the checkpoint of ``step``.

        Only rank 0 writes; on other ranks this returns at once. With ``asynchronous``,
        training goes on while the file is written, from a snapshot of ``state`` taken now:
        state in CPU memory is snapshotted by forking a writer process (copy-on-write:
        no copy while the caller waits), state on a GPU is copied to CPU memory and
        written by a background thread. A crash during the write leaves the previous
        checkpoint as the newest. One save runs at a time: a save waits for the previous
        one to finish.

        Raises:
            CheckpointError: the checkpoint could not be written (a full disk, a read-only
                directory), naming the cause; what it had written is removed and the
                checkpoints saved before are intact. An asynchronous save that fails logs
                the error at once and raises it from the next ``save`` or ``wait``.
        """
        if self.rank != 0:
            return
        self.wait()
        began = time.perf_counter()
        if not asynchronous:
            self._write(state, step, began, blocked=None)
            return
        if hasattr(os, "fork") and _in_cpu_memory(state):
            background = self._fork_writer(state, step, began)
        else:
            snapshot = snapshot_to_cpu(state)
            blocked = time.perf_counter() - began

            def background() -> None:
                self._write_in_background(snapshot, step, began, blocked)

        self._pending = threading.Thread(
            target=background, name=f"rallypoint-checkpoint-{step}"
        )  # not a daemon: a worker that returns normally finishes its last save first
        self._pending.start()

    def wait(self) -> None:
        """Wait for a background save to finish; raise its error if it failed."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise CheckpointError(f"the background checkpoint save failed: {error}") from error

    def _fork_writer(self, state: Any, step: int, began: float) -> Callable[[], None]:
        """Fork a process that writes ``state`` as the fork left it; return what waits
        for it. The child shares the parent's memory copy-on-write, so the parent only
        pays for the pages it changes while the child writes."""
        parent = os.getpid()
        errors, error_pipe = os.pipe()  # the child's error, for the parent to raise
        pid = os.fork()
        if pid == 0:  # the child: write, report, and leave without running any cleanup
            code = 1
            try:
                os.close(errors)
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

        def wait_for_child() -> None:
            _, status = os.waitpid(pid, 0)
            with os.fdopen(errors, "rb") as pipe:
                message = pipe.read().decode("utf-8", "replace")
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                reason = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                self._pending_error = CheckpointError(
                    message or f"the process writing checkpoint {step} failed ({reason})"
                )

        return wait_for_child

    def _write_in_background(self, state: Any, step: int, began: float, blocked: float) -> None:
        try:
            self._write(state, step, began, blocked)
        except BaseException as error:
            logger.error("asynchronous save: %s", error)
            self._pending_error = error

    def _write(self, state: Any, step: int, began: float, blocked: float | None) -> None:
        import torch

        name = mf.directory(step)
        # A synchronous save holds up training: its writes are the worker's progress.
        writer: mf.HashingWriter | None = None
        try:
            self._begin(step)
            with self.storage.writer(f"{name}/{STATE_FILE}") as handle:
                writer = mf.HashingWriter(handle, progress.heartbeat if blocked is None else None)
                torch.save(state, writer)  # type: ignore[arg-type]
            self._commit(step, "torch", {STATE_FILE: writer.entry})
        except Exception as error:
            raise self._failed(step, (writer and writer.error) or error) from error
        seconds = time.perf_counter() - began
        worker_channel.send(
            "checkpoint_saved",
            step=step,
            seconds=seconds,
            bytes=writer.size,
            blocked_seconds=seconds if blocked is None else blocked,
            asynchronous=blocked is not None,
        )

    def _begin(self, step: int) -> None:
        """Mark the checkpoint as begun, so that a save that never finished (the worker
        died mid-write) is seen, and removed by a later save's rotation.

        A checkpoint of the same step saved before loses its manifest first: its files
        are about to be replaced one by one, and until the new manifest is written it is
        unfinished, not a mix of old and new files. Best effort: where the storage refuses
        deletes, the checksums still tell such a mix from a complete checkpoint."""
        with contextlib.suppress(Exception):
            self.storage.delete(f"{mf.directory(step)}/{mf.MANIFEST}")
        with self.storage.writer(f"{mf.directory(step)}/{BEGUN}") as handle:
            handle.write(b"")

    def _failed(self, step: int, cause: BaseException) -> CheckpointError:
        """Remove what a failed save of ``step`` wrote (space a full disk needs), and say
        why it failed."""
        with contextlib.suppress(Exception):  # a read-only directory keeps it: harmless
            self.storage.delete(mf.directory(step))
        if isinstance(cause, CheckpointError):
            return cause
        return CheckpointError(
            f"checkpoint of step {step} not saved in {self.storage.url}: {cause}; "
            "the checkpoints saved before it are intact"
        )

    def _commit(self, step: int, format_: str, files: Mapping[str, mf.FileEntry]) -> None:
        manifest = mf.Manifest(step, self.world_size, time.time(), format_, dict(files))
        with self.storage.writer(f"{mf.directory(step)}/{mf.MANIFEST}") as handle:
            handle.write(manifest.encode())
        self._rotate(step)

    def _rotate(self, newest: int) -> None:
        """Keep the ``keep_last`` newest complete checkpoints; remove the rest, and
        anything unfinished (only rank 0 writes, and only one save at a time)."""
        try:
            complete = sorted(self._complete_steps(), reverse=True)
            keep = set(complete[: self.keep_last]) | {newest}
            for step in self._all_steps():
                if step not in keep:
                    self.storage.delete(mf.directory(step))
        except Exception as error:  # the new checkpoint is complete: that is what counts
            logger.warning("checkpoint %s saved, but older ones not removed: %s", newest, error)

    # --- sharded state (torch.distributed.checkpoint) -------------------------------------

    def save_sharded(self, state: dict[str, Any], step: int) -> None:
        """Save state sharded across ranks with ``torch.distributed.checkpoint``; every
        rank calls it, and every rank returns once the checkpoint is complete (manifest
        written). Needs a file system storage (a path shared by every node)."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        began = time.perf_counter()
        path = self._local_path(f"{mf.directory(step)}/{SHARDS}")
        if self.rank == 0:
            self._begin(step)
        dcp_save(state, checkpoint_id=path)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.barrier()  # every shard is written before the manifest
        if self.rank != 0:
            if distributed:
                dist.barrier()  # returns once rank 0 has written the manifest
            return
        files = {}
        for name in self.storage.names():
            prefix = f"{mf.directory(step)}/{SHARDS}/"
            if name.startswith(prefix) and not name.endswith(f"/{BEGUN}"):
                with self.storage.reader(name) as handle:
                    files[name.removeprefix(f"{mf.directory(step)}/")] = _entry(handle.read())
        self._commit(step, "dcp", files)
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
        )

    def load_sharded(self, state: dict[str, Any]) -> Checkpoint | None:
        """Load the newest valid sharded checkpoint into ``state`` in place (every rank)."""
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        def load(name: str, manifest: mf.Manifest) -> None:
            self._verify_files(name, manifest)
            dcp_load(state, checkpoint_id=self._local_path(f"{name}/{SHARDS}"))

        return self._load_newest("dcp", load)

    def _local_path(self, name: str) -> str:
        if not isinstance(self.storage, FileStorage):
            raise CheckpointError(
                f"sharded checkpoints need a file system path, not {self.storage.url!r}"
            )
        return str(self.storage.path(name))

    # --- loading --------------------------------------------------------------------------

    def load_latest(
        self, *, map_location: Any = "cpu", weights_only: bool = True
    ) -> Checkpoint | None:
        """The newest checkpoint that is complete and intact, or ``None`` if there is none.

        A newer one that is unfinished, truncated or fails its checksum is skipped with a
        warning naming it and the reason, and the one before it is loaded.
        """
        import torch

        loaded: list[Any] = []

        def load(name: str, manifest: mf.Manifest) -> None:
            entry = manifest.files.get(STATE_FILE)
            if entry is None:
                raise mf.Damaged(f"the manifest lists no {STATE_FILE}")
            data = self._read(f"{name}/{STATE_FILE}")
            mf.verify(STATE_FILE, data, entry)
            loaded.append(
                torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
            )

        checkpoint = self._load_newest("torch", load)
        if checkpoint is None:
            return None
        return Checkpoint(checkpoint.step, checkpoint.world_size, loaded[0], checkpoint.skipped)

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints (manifest written), oldest first."""
        return sorted(self._complete_steps())

    def _load_newest(self, format_: str, load: Any) -> Checkpoint | None:
        began = time.perf_counter()
        skipped: list[str] = []
        for step in sorted(self._all_steps(), reverse=True):
            name = mf.directory(step)
            try:
                manifest = self._manifest(name)
                if manifest.format != format_:
                    raise mf.Damaged(f"it is a {manifest.format} checkpoint, not {format_}")
                load(name, manifest)
            except mf.Damaged as reason:
                skipped.append(f"{name}: {reason}")
                logger.warning("checkpoint %s skipped: %s", name, reason)
                continue
            if skipped:
                logger.warning("loaded checkpoint %s instead", name)
            size = sum(entry.size for entry in manifest.files.values())
            worker_channel.send(
                "checkpoint_loaded",
                step=step,
                seconds=time.perf_counter() - began,
                bytes=size,
                skipped=len(skipped),
            )
            return Checkpoint(step, manifest.world_size, None, tuple(skipped))
        return None

    def _manifest(self, name: str) -> mf.Manifest:
        try:
            raw = self._read(f"{name}/{mf.MANIFEST}")
        except mf.Damaged:
            raise mf.Damaged("unfinished (no manifest)") from None
        return mf.Manifest.decode(raw)

    def _verify_files(self, name: str, manifest: mf.Manifest) -> None:
        for file_name, entry in manifest.files.items():
            mf.verify(file_name, self._read(f"{name}/{file_name}"), entry)

    def _read(self, name: str) -> bytes:
        try:
            with self.storage.reader(name) as handle:
                return handle.read()
        except FileNotFoundError:
            raise mf.Damaged(f"{name.rsplit('/', 1)[-1]} is missing") from None
        except OSError as error:
            # Not damage: the storage failed (a network error, a permission). Skipping a
            # good checkpoint here would restart training from an older one, or from zero.
            raise CheckpointError(
                f"cannot read checkpoint file {name} from {self.storage.url} ({error}); "
                "not skipping it, since it may be intact"
            ) from None

    def _all_steps(self) -> set[int]:
        steps = (mf.step_of(name.split("/", 1)[0]) for name in self.storage.names())
        return {step for step in steps if step is not None}

    def _complete_steps(self) -> set[int]:
        names = set(self.storage.names())
        return {s for s in self._all_steps() if f"{mf.directory(s)}/{mf.MANIFEST}" in names}


def _in_cpu_memory(state: Any) -> bool:
    """Whether every tensor in ``state`` lives in CPU memory (what a fork can snapshot)."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.device.type == "cpu"
    if isinstance(state, Mapping):
        return all(_in_cpu_memory(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return all(_in_cpu_memory(value) for value in state)
    return True


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

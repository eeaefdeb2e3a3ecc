"""A worker's arena: the slot files in node shared memory that its memory checkpoints go
to, mapped once, pinned once for CUDA, and reused by every save (``rallypoint.checkpoint.slot``
says what a slot holds).

The agent owns the arena's folder (``RALLYPOINT_MEMORY_TIER``/arena, one folder per local
rank): it outlives every worker, and the agent removes it at the end. A save takes the
oldest slot that is neither one of the ``keep`` newest copies nor held by a reader, marks
it WRITING, writes the state's tree and each tensor's raw bytes, and marks it COMMITTED.
Nothing is pickled but the few leaves JSON cannot hold, and nothing is hashed.

The tensors are copied by ``rallypoint.checkpoint.copying``: a CUDA tensor by the GPU's
copy engine into the pinned slot, a CPU tensor with one ``copy_``. A synchronous save (the
default) returns once the copy is complete and committed: a worker killed right after it
loses nothing. An asynchronous save returns at once and is committed when its copy is
done, by a thread; the loop's next change of the state runs after the copy (``copying``
says how). A worker killed before the commit loses that save, never the one before.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rallypoint.checkpoint import copying, pinning, slot, tree
from rallypoint.checkpoint.copying import Copier, Copy
from rallypoint.interfaces import CheckpointError

logger = logging.getLogger("rallypoint.checkpoint")

#: Saves being copied at once: a save begins while the one before is still copied (both
#: slots are then taken: the newest committed copy is never written over).
IN_FLIGHT = 2
_LOCK = ".lock"
_GROW = 2 << 20  # a slot grows in steps of this many bytes


@dataclass
class Saved:
    """What a committed save reports to the agent (``checkpoint_saved``)."""

    step: int
    bytes: int
    blocked: float
    seconds: float
    asynchronous: bool
    format: str = "state"  # slot.FORMATS


class _Mapped:
    """One slot file, open and mapped (shared) for as long as the arena lives; pinned for
    CUDA the first time a CUDA tensor is copied into it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR)
        self.size = 0
        self.mm: mmap.mmap | None = None
        self.buffer: Any = None  # a uint8 tensor over the mapping
        self.pinned: Any = None  # the device it was pinned from
        self._map()

    def _map(self) -> None:
        import torch

        self.size = os.fstat(self.fd).st_size
        if self.size:
            self.mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED)
            self.buffer = torch.frombuffer(self.mm, dtype=torch.uint8)

    def _unmap(self) -> None:
        self.unpin()
        self.buffer = None
        if self.mm is not None:
            self.mm.close()
            self.mm = None

    def grow(self, size: int) -> None:
        """Make the file (and the mapping) ``size`` bytes long, its space reserved."""
        pinned = self.pinned
        self._unmap()
        try:
            reserve(self.fd, size, self.path)
        finally:  # grown or not, mapped (and pinned) again as the file now is
            self._map()
            if pinned is not None:
                self.pin(pinned)

    def pin(self, device: Any) -> None:
        """Page-lock the mapping for the GPU's copy engine, once for the life of the
        arena (``pinning``: on ``device``, portable to the others)."""
        if self.pinned is not None or not self.size:
            return
        pinning.register(
            self.buffer.data_ptr(), self.size, device, f"memory checkpoint slot {self.path}"
        )
        self.pinned = device

    def unpin(self) -> None:
        if self.pinned is not None:
            pinning.unregister(self.buffer.data_ptr(), self.pinned)
            self.pinned = None

    def lock(self) -> bool:
        """Take the slot for writing, unless a reader holds it."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def record(self) -> slot.Record | None:
        """The record in the slot (any state), if it holds one."""
        if self.mm is None:
            return None
        raw = bytes(self.mm[: slot.PAGE])
        header_len = int.from_bytes(raw[40:48], "little")
        if slot.PAGE + header_len > self.size:
            return None
        return slot.unpack(raw, bytes(self.mm[slot.PAGE : slot.PAGE + header_len]))

    def write(self, offset: int, data: bytes) -> None:
        assert self.mm is not None
        self.mm[offset : offset + len(data)] = data

    def view(self, start: int, entry: slot.Tensor) -> Any:
        """The slot's bytes of tensor ``entry`` as a tensor of its dtype and shape."""
        import torch

        flat = self.buffer[start + entry.offset : start + entry.offset + entry.nbytes]
        return flat.view(getattr(torch, entry.dtype)).view(entry.shape)

    def close(self) -> None:
        self._unmap()
        os.close(self.fd)


class Arena:
    """The memory checkpoints of one worker (``local_rank``) under the agent's memory
    directory ``memory``: at most ``budget`` bytes of slots in all the node's arenas
    together, the ``keep`` newest copies never written over. ``saved(Saved)`` is told of
    every committed save (the worker tells its agent)."""

    def __init__(
        self,
        memory: Path,
        local_rank: int,
        keep: int = 1,
        budget: int | None = None,
        saved: Callable[[Saved], object] = lambda _saved: None,
    ) -> None:
        self.root = Path(memory) / slot.ARENA
        self.folder = self.root / f"local-{local_rank}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.budget = budget
        self._saved = saved
        self._mapped: dict[Path, _Mapped] = {}
        self._copier = Copier()
        self._said_waiting = False

    # --- saving ---------------------------------------------------------------------------

    def save(
        self,
        state: Any,
        step: int,
        *,
        rank: int,
        world_size: int,
        format: str = "state",
        asynchronous: bool = False,
        placed: Mapping[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
    ) -> None:
        """Copy ``state`` into a slot as the copy of ``step``; see the module for when it
        returns. ``CheckpointError`` when it does not fit in the budget. ``placed``: for a
        tensor that is a part of a larger one (by ``id``), the whole one's shape and the
        part's offset in it (as a ``DTensor`` says of itself)."""
        began = time.perf_counter()
        node, tensors, entries, data_len, header = _encode(state, format, placed or {})
        self._make_way()
        mapped, generation = self._take(slot.data_start(len(header)) + data_len)
        record = slot.Record(
            slot.WRITING, rank, world_size, generation, step, len(header), data_len,
            slot.FORMATS.index(format),
        )  # fmt: skip

        unlocked = False

        def release(copy: Copy) -> None:
            nonlocal unlocked
            if not unlocked:
                unlocked = True
                mapped.unlock()

        def commit(copy: Copy) -> None:
            mapped.write(0, record.committed().pack(header))
            release(copy)  # before the agent hears of the copy, so that it can read it
            seconds = time.perf_counter() - copy.began
            blocked = copy.blocked if copy.asynchronous else seconds
            self._saved(Saved(step, record.size, blocked, seconds, copy.asynchronous, format))

        copy = Copy(f"checkpoint of step {step}", commit, release, began)
        copy.payload = mapped
        try:
            mapped.write(0, record.pack(header))  # the copy this slot held is gone from here
            mapped.write(slot.PAGE, header)
            gpu = next((t.device for t in tensors if t.is_cuda), None)
            if gpu is not None:
                mapped.pin(gpu)
        except BaseException:
            mapped.unlock()
            raise
        start = record.data_start
        paths = tree.paths(node)
        pairs = [
            (mapped.view(start, entry), tensor, path)
            for entry, tensor, path in zip(entries, tensors, paths, strict=True)
        ]
        self._copier.start(copy, pairs, asynchronous)

    def wait(self) -> None:
        """Until every save begun has been committed (or failed: its error is raised)."""
        while (copy := self._copier.next_done()) is not None:
            if copy.error is not None and not self._superseded(copy):
                raise CheckpointError(f"the asynchronous save failed: {copy.error}")

    def before_change(self) -> None:
        """What an optimizer's step does first (``copying.Copier.before_change``)."""
        self._copier.before_change()

    def _superseded(self, copy: Copy) -> bool:
        """Whether a copy newer than the failed ``copy`` is committed: nothing is lost."""
        step = int(copy.label.rsplit(" ", 1)[-1])
        return max((c.step for c in slot.committed(self.root)), default=-1) > step

    def _make_way(self) -> None:
        """Forget the saves already committed; wait for the oldest while ``IN_FLIGHT`` are
        being copied."""
        self._copier.forget_done()
        flying = self._copier.in_flight()
        if len(flying) >= IN_FLIGHT:
            flying[0].done.wait()

    # --- slots ----------------------------------------------------------------------------

    def _take(self, size: int) -> tuple[_Mapped, int]:
        """A slot of at least ``size`` bytes, locked for writing, and the generation its
        copy gets: neither one of the ``keep`` newest copies, nor one being copied, nor one
        a reader holds. A new slot file when there is none such and the budget has room;
        else the save waits for a copy in flight, or for a reader to let go of its slot
        (said once). ``CheckpointError`` when not even that would make room."""
        while True:
            flying = self._copier.in_flight()
            busy = {copy.payload.path for copy in flying}
            for path in slot.slots(self.folder):
                if path not in self._mapped:
                    self._mapped[path] = _Mapped(path)
            records = {path: mapped.record() for path, mapped in self._mapped.items()}
            generation = 1 + max((r.generation for r in records.values() if r), default=0)
            newest = sorted(
                (p for p, r in records.items() if r and r.state == slot.COMMITTED),
                key=lambda p: records[p].generation,  # type: ignore[union-attr]
                reverse=True,
            )[: self.keep]
            free = [p for p in records if p not in newest and p not in busy]
            # Large enough first; of those, an unfinished one, else the oldest copy.
            free.sort(key=lambda p: (self._mapped[p].size < size, _age(records[p])))
            held = []
            for path in free:
                mapped = self._mapped[path]
                if not mapped.lock():
                    held.append(mapped)
                elif self._fits(mapped, size):
                    return mapped, generation
                else:
                    mapped.unlock()
            with self._budget():
                if self._room(_rounded(size), 0):
                    return self._new_slot(size), generation
            if flying:
                flying[0].done.wait()
            elif held:
                self._wait_for_reader(held[0])
            else:
                with self._budget():
                    raise CheckpointError(self._room_error(_rounded(size), 0))

    def _fits(self, mapped: _Mapped, size: int) -> bool:
        """Grow ``mapped`` to ``size`` if it is smaller and the budget has room; whether it
        holds ``size`` bytes now."""
        if mapped.size >= size:
            return True
        with self._budget():
            if not self._room(_rounded(size), mapped.size):
                return False
            mapped.grow(_rounded(size))
        return True

    def _wait_for_reader(self, mapped: _Mapped) -> None:
        if not self._said_waiting:
            self._said_waiting = True
            logger.warning(
                "a memory checkpoint save waits for the agent to finish copying the slot it "
                "needs: give --checkpoint-memory room for %d copies per worker that saves",
                self.keep + 2,
            )
        fcntl.flock(mapped.fd, fcntl.LOCK_EX)  # until the reader lets go
        mapped.unlock()

    def _new_slot(self, size: int) -> _Mapped:
        """A new slot file of ``size`` bytes, locked (called with the budget held)."""
        index = 0
        while (self.folder / f"{slot.PREFIX}{index}").exists():
            index += 1
        path = self.folder / f"{slot.PREFIX}{index}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            reserve(fd, _rounded(size), path)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        mapped = self._mapped[path] = _Mapped(path)
        mapped.lock()
        return mapped

    @contextlib.contextmanager
    def _budget(self) -> Iterator[None]:
        """Held while a slot is made or grown: the node's arenas share one budget."""
        with open(self.root / _LOCK, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def _used(self) -> int:
        return sum(
            path.stat().st_size
            for folder in self.root.iterdir()
            if folder.is_dir()
            for path in slot.slots(folder)
        )

    def _room(self, size: int, current: int) -> bool:
        """Whether a slot of ``current`` bytes may become ``size`` bytes (budget held)."""
        return self.budget is None or self._used() - current + size <= self.budget

    def _room_error(self, size: int, current: int) -> str:
        from rallypoint.checkpoint.tier import size_text

        budget = self.budget or 0
        taken = self._used() - current
        return (
            f"a memory checkpoint of {size_text(size)} does not fit in the node memory "
            f"given to checkpoints (--checkpoint-memory {size_text(budget)}, "
            f"{size_text(taken)} taken by the node's slots): give it at least "
            f"{self.keep + 2} times the size of one checkpoint per worker that saves"
        )

    def close_at_exit(self) -> None:
        """``close``, unless a copy is still in flight (the exit's wait ran out): its DMA
        may still write into the slot, which stays mapped until the process is gone."""
        if not self._copier.in_flight():
            self.close()

    def close(self) -> None:
        """Unpin and unmap every slot (the files stay: the agent's)."""
        with contextlib.suppress(CheckpointError):
            self.wait()
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()


_ARENAS: dict[Path, Arena] = {}


def for_process(
    memory: Path,
    local_rank: int,
    keep: int = 1,
    budget: int | None = None,
    saved: Callable[[Saved], object] = lambda _saved: None,
) -> Arena:
    """This process's one arena for ``local_rank``: every ``Checkpointer`` shares it (DCP
    users make one per save, through ``RallypointWriter``), so each slot is mapped and
    pinned once, not once per save. It closes at the interpreter's exit, after the saves
    in flight (``copying.at_exit``): unpinned before unmapped, so that no registration
    outlives its mapping."""
    folder = (Path(memory) / slot.ARENA / f"local-{local_rank}").resolve()
    found = _ARENAS.get(folder)
    if found is None:
        found = _ARENAS[folder] = Arena(memory, local_rank, keep, budget, saved)
        copying.at_exit(found.close_at_exit)
    return found


def reserve(fd: int, size: int, path: Path) -> None:
    """Make the slot file ``size`` bytes long with every byte of it allocated now: a sparse
    file in a full /dev/shm would kill the worker with SIGBUS at the first write to an
    unallocated page; the reservation fails here instead, with a sentence."""
    from rallypoint.checkpoint.tier import size_text

    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        raise CheckpointError(
            f"cannot reserve {size_text(size)} of shared memory for the memory checkpoint "
            f"slot {path}: {error.strerror}; free some of {path.parent.parent.parent} or "
            "give --checkpoint-memory less"
        ) from None


def _age(record: slot.Record | None) -> tuple[int, int]:
    if record is None or record.state != slot.COMMITTED:
        return (0, 0)
    return (1, record.generation)


def _rounded(size: int) -> int:
    return -(-size // _GROW) * _GROW


def _encode(
    state: Any, format: str, placed: Mapping[int, tuple[tuple[int, ...], tuple[int, ...]]]
) -> tuple[tree.Node, list[Any], tuple[slot.Tensor, ...], int, bytes]:
    """What a save writes of ``state`` apart from the tensors' bytes: its tree, the tensors
    to copy (a ``DTensor``'s local part), their entries, the length of their data, and the
    slot's header."""
    import torch

    node, leaves, others = tree.encode(state)
    local = _local(leaves, placed)
    tensors = [tensor for tensor, _, _ in local]
    for index, tensor in enumerate(tensors):
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise CheckpointError(
                f"{tree.paths(node)[index]!r}: a {tensor.layout} tensor cannot go to a memory "
                "checkpoint; save it with --checkpoint-dir alone"
            )
    entries, data_len = _layout(local)
    extra = b""
    if others:
        buffer = io.BytesIO()
        torch.save(others, buffer)
        extra = buffer.getvalue()
    header = slot.Header(format, time.time(), node, entries, len(extra)).encode(extra)
    return node, tensors, entries, data_len, header


def _local(
    tensors: list[Any], placed: Mapping[int, tuple[tuple[int, ...], tuple[int, ...]]]
) -> list[tuple[Any, tuple[int, ...] | None, tuple[int, ...] | None]]:
    """Each tensor as it is saved: a ``DTensor``'s local part, with the whole tensor's
    shape and the part's offset in it (as ``torch.distributed.checkpoint`` records them);
    a tensor in ``placed`` with its place; any other tensor as it is."""
    sharded: Any = ()  # no DTensor in a torch built without distributed
    with contextlib.suppress(ImportError):
        from torch.distributed.tensor import DTensor

        sharded = DTensor
    found: list[tuple[Any, tuple[int, ...] | None, tuple[int, ...] | None]] = []
    for tensor in tensors:
        if id(tensor) in placed:
            found.append((tensor, *placed[id(tensor)]))
        elif isinstance(tensor, sharded):
            chunks: Any = tensor.__create_chunk_list__  # what DCP records of a shard
            (chunk,) = chunks()
            found.append((tensor.to_local(), tuple(tensor.shape), tuple(chunk.offsets)))
        else:
            found.append((tensor, None, None))
    return found


def _layout(tensors: list[Any]) -> tuple[tuple[slot.Tensor, ...], int]:
    """Each tensor's place in the data, ``ALIGN``-aligned; the data's length. ``tensors``:
    ``_local``'s."""
    entries = []
    offset = 0
    for tensor, global_shape, global_offset in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries.append(
            slot.Tensor(
                dtype,
                tuple(tensor.shape),
                offset,
                nbytes,
                str(tensor.device),
                global_shape,
                global_offset,
            )
        )
        offset += -(-nbytes // slot.ALIGN) * slot.ALIGN
    return tuple(entries), offset

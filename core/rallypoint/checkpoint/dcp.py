"""rallypoint's memory tier for ``torch.distributed.checkpoint`` (DCP) users: the writer
and the reader to pass to ``dcp.save`` / ``dcp.async_save`` and ``dcp.load``
(docs/checkpointing.md "DCP users"). This module imports torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from rallypoint.checkpoint.candidates import Checkpoint, Loaded, Opener, newest
from rallypoint.checkpoint.checkpointer import Checkpointer
from rallypoint.interfaces import CheckpointError


class RallypointWriter(StorageWriter):
    """``dcp.save(state, storage_writer=RallypointWriter(step))``: each rank's part of
    ``state`` goes to its arena in node memory, as ``Checkpointer.save_sharded`` puts it
    there (needs ``rallypoint run --checkpoint-memory``); the agent sends it to a peer
    and copies every K-th to ``--checkpoint-dir``. ``dcp.save`` returns once this rank's
    copy is committed; with ``dcp.async_save`` DCP first stages the state to CPU memory,
    and this writer copies the staged tensors in DCP's background thread."""

    def __init__(self, step: int, checkpointer: Checkpointer | None = None) -> None:
        super().__init__()
        self.step = step
        self._items: list[Any] = []
        self.checkpointer = checkpointer or Checkpointer()
        if self.checkpointer.memory is None:
            raise CheckpointError(
                "RallypointWriter saves to node memory: run under `rallypoint run "
                "--checkpoint-memory SIZE` (or give DCP its FileSystemWriter)"
            )

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        # Every item of this rank's state: DCP's global plan then writes a replicated
        # tensor from one rank only, but a rank's copy in memory must restore it alone.
        self._items = list(plan.items)
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def write_data(self, plan: Any, planner: Any) -> Any:
        import torch
        from torch.distributed.checkpoint.planner import WriteItemType
        from torch.distributed.checkpoint.storage import WriteResult

        state: dict[str, Any] = {}
        placed: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        results = []
        planned = {item.index for item in plan.items}
        dropped = [item for item in self._items if item.index not in planned]
        for item in [*plan.items, *dropped]:
            fqn = item.index.fqn
            if fqn in state:
                raise CheckpointError(
                    f"{fqn!r}: this rank holds several parts of it (a ShardedTensor?); "
                    "RallypointWriter saves one part of a tensor per rank, as a DTensor has"
                )
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                size = len(data.getbuffer())
                # DCP's own pickle of the leaf, stored as save_sharded stores one: only what
                # a load with weights_only (as every rallypoint load) gives back is kept.
                data.seek(0)
                try:
                    state[fqn] = torch.load(data, weights_only=True)
                except Exception:  # an UnpicklingError: weights_only refused something
                    raise CheckpointError(
                        f"{fqn!r} is neither a tensor nor a plain value (numbers, strings, "
                        "lists, dicts), so it cannot go to a memory checkpoint"
                    ) from None
            else:
                tensor = data.detach()
                state[fqn] = tensor
                size = tensor.numel() * tensor.element_size()
                if item.type == WriteItemType.SHARD:
                    chunk = item.tensor_data.chunk
                    placed[id(tensor)] = (tuple(item.tensor_data.size), tuple(chunk.offsets))
            if item.index in planned:
                results.append(WriteResult(item.index, size_in_bytes=size, storage_data=None))
        self.checkpointer.save_shares(state, self.step, placed=placed)
        done: Any = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        pass  # no global metadata: a reader makes it from the ranks' headers

    def storage_meta(self) -> Any:
        return None


class RallypointReader(StorageReader):
    """``dcp.load(state, storage_reader=RallypointReader())``: the newest sharded
    checkpoint this rank can load, chosen as ``Checkpointer.load_sharded`` chooses (its
    own share in node memory, a peer's copy, ``--checkpoint-dir``; at another world size
    every rank's shares from ``--checkpoint-dir``, resharded). ``step`` (``checkpoint``)
    says which; None on a fresh start, when there is nothing to load. The chosen files are
    held open (a memory copy against a rewrite) until ``dcp.load`` has read them."""

    def __init__(self, checkpointer: Checkpointer | None = None) -> None:
        super().__init__()
        self.checkpointer = checkpointer or Checkpointer()
        self._chosen: tuple[Checkpoint | None] | None = None
        self._inner: Any = None
        self._stack = contextlib.ExitStack()

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The checkpoint chosen (``state`` is None: ``dcp.load`` loads it)."""
        if self._chosen is None:

            def holding(open_reader: Opener) -> Callable[[], Loaded]:
                def hold() -> Loaded:
                    stack = contextlib.ExitStack()
                    try:
                        self._inner, world, size = open_reader(stack)
                    except BaseException:
                        stack.close()
                        raise
                    self._stack = stack
                    return None, world, size

                return hold

            candidates = self.checkpointer._tiers().sharded(holding)
            self._chosen = (newest(candidates),)
        return self._chosen[0]

    @property
    def step(self) -> int | None:
        chosen = self.checkpoint
        return None if chosen is None else chosen.step

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self.checkpoint is None:
            raise CheckpointError("no sharded checkpoint to load (check `reader.step` first)")
        return self._inner.read_metadata(*args, **kwargs)

    def set_up_storage_reader(
        self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._inner.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        return self._inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        planned: list[Any] = self._inner.prepare_global_plan(plans)
        return planned

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            done = self._inner.read_data(plan, planner)
            done.wait()
        finally:
            self._stack.close()  # read: a memory copy may be written over again
        return done

"""``ElasticSampler``: an epoch's samples seen exactly once, across restarts at any world size.

torch's ``DistributedSampler`` splits an epoch by rank at its start; when an elastic job
restarts mid-epoch with a different number of workers, that split no longer holds and the
epoch is either started over (samples repeated) or left (samples skipped). This sampler
instead keeps one global order per epoch and a count of how much of it the whole job has
consumed, and divides only what is left among the ranks of the current round:

- the order of epoch ``e`` is a permutation of ``range(len(dataset))`` that depends on
  ``(seed, e)`` alone: the same on every rank and at every world size;
- ``consumed`` counts the samples of the epoch the job has used: the training loop calls
  ``advance(batch_size)`` after each step, which adds ``world_size * batch_size``;
- rank ``r`` of ``w`` reads ``order[consumed + r :: w]``; after every rank has taken ``k``
  samples, the job as a whole has taken exactly ``order[consumed : consumed + k * w]``, so a
  checkpoint of ``consumed`` taken between steps marks a clean prefix of the epoch;
- ``state_dict()`` is a small dict of plain ints and bools for the user's checkpoint; after a
  restart, ``load_state_dict()`` puts every rank of the new world at the same position.

The tail of an epoch (fewer than ``world_size`` samples per rank left over) is spread one
sample per rank with ``drop_last=False``: no sample repeated, none skipped, but the ranks'
last batches may differ by one sample and the number of batches by one (see
docs/elastic-data.md for running DDP over such uneven inputs). ``drop_last=True`` instead
drops the last ``len(remaining) % world_size`` samples of the epoch so every rank gets the
same number.

The module imports torch (it is for workers) and nothing of the agent.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from rallypoint.worker.progress import progress

#: Version of the ``state_dict()`` layout, kept in it for future changes.
STATE_VERSION = 1


class ElasticSampler(Sampler[int]):
    """Sampler for ``DataLoader(dataset, batch_size=B, sampler=...)`` in an elastic job.

    Args:
        dataset: anything with a length; only ``len(dataset)`` is used.
        rank: this worker's global rank; default: the ``RANK`` environment variable that
            rallypoint and torchrun set, or 0 without one.
        world_size: the number of workers; default: ``WORLD_SIZE``, or 1 without it.
        shuffle: visit the epoch in a random order, drawn from ``(seed, epoch)``, rather than
            ``0, 1, 2, ...``.
        seed: seed of the shuffle; must be the same on every rank and every restart.
        drop_last: leave out the last samples of an epoch that would give some ranks one
            sample more than others (at most ``world_size - 1`` samples).

    In the training loop, call ``advance(B)`` once per batch taken from the loader (with the
    loader's ``batch_size``, also for a shorter last batch), and put ``state_dict()`` in the
    checkpoint.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        self.world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", 1)
        self.rank = rank if rank is not None else _env_int("RANK", 0)
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size}: it must be at least 1.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank={self.rank} with world_size={self.world_size}: "
                f"the rank must be in 0..{self.world_size - 1}."
            )
        self.length = len(dataset)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._consumed = 0
        #: Batches advanced over every epoch and restart (kept in ``state_dict``): the
        #: training step, as the agent counts it.
        self.steps = 0
        self._order: tuple[int, torch.Tensor] | None = None

    # -- position in the epoch

    @property
    def consumed(self) -> int:
        """How many samples of this epoch the whole job has used (all ranks together)."""
        return self._consumed

    @consumed.setter
    def consumed(self, samples: int) -> None:
        if not 0 <= samples <= self.length:
            raise ValueError(
                f"consumed={samples}: it must be in 0..{self.length}, the dataset's length."
            )
        self._consumed = samples

    @property
    def remaining(self) -> int:
        """How many samples of this epoch the job has not used yet."""
        return self.length - self._consumed

    def advance(self, batch_size: int, steps: int = 1) -> None:
        """Record that every rank took ``steps`` batches of ``batch_size`` from the loader.

        Pass the DataLoader's ``batch_size``, not ``len(batch)``: a short last batch is the
        end of the epoch, and ``consumed`` stops at the dataset's length.
        """
        if batch_size < 0 or steps < 0:
            raise ValueError(
                f"advance(batch_size={batch_size}, steps={steps}): both must be non-negative."
            )
        self._consumed = min(self.length, self._consumed + self.world_size * batch_size * steps)
        self.steps += steps
        progress(step=self.steps - 1)  # the agent's account: the step just done

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first sample, unless it is the current epoch.

        Calling it with the current epoch keeps the position, so that the usual
        ``for epoch in range(sampler.epoch, epochs): sampler.set_epoch(epoch)`` resumes a
        loaded checkpoint mid-epoch instead of starting the epoch over.
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self._consumed = 0

    # -- the indices

    def order(self) -> list[int]:
        """The whole epoch's order: the same on every rank and at every world size."""
        return self._epoch_order().tolist()

    def indices(self) -> list[int]:
        """This rank's share of what is left of the epoch, in the order it reads them."""
        remaining = self.remaining
        stop = self.length
        if self.drop_last:
            stop = self._consumed + remaining - remaining % self.world_size
        order = self._epoch_order()
        return order[self._consumed + self.rank : stop : self.world_size].tolist()

    def __iter__(self) -> Iterator[int]:
        # The share is fixed when iteration starts: advance() during the epoch moves the
        # checkpointed position, not the indices of the iteration already under way.
        return iter(self.indices())

    def __len__(self) -> int:
        remaining = self.remaining
        if self.drop_last:
            return remaining // self.world_size
        return max(0, (remaining - self.rank + self.world_size - 1) // self.world_size)

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None or self._order[0] != self.epoch:
            if self.shuffle:
                generator = torch.Generator()
                # Not seed + epoch (torch's DistributedSampler): seed 1 epoch 0 would
                # repeat seed 0 epoch 1.
                generator.manual_seed((self.seed % 2**32) << 32 | self.epoch % 2**32)
                order = torch.randperm(self.length, generator=generator)
            else:
                order = torch.arange(self.length)
            self._order = (self.epoch, order)
        return self._order[1]

    # -- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """The position, as plain ints and bools: save it in the training checkpoint."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "consumed": self._consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "length": self.length,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``, saved at any world size.

        Raises ``ValueError`` when the state describes another order (a different dataset
        length, seed or shuffle): resuming it would repeat and skip samples.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"sampler state version {state.get('version')!r} is not {STATE_VERSION}: "
                "it was saved by another version of rallypoint."
            )
        saved = (state["length"], state["seed"], state["shuffle"])
        ours = (self.length, self.seed, self.shuffle)
        if saved != ours:
            raise ValueError(
                "the checkpoint's sampler order (length={}, seed={}, shuffle={}) differs from "
                "this sampler's (length={}, seed={}, shuffle={}): create the sampler with the "
                "same dataset, seed and shuffle as the run that saved it.".format(*saved, *ours)
            )
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self.steps = int(state.get("steps", 0))  # saved by rallypoint 0.1 without it


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer.") from None

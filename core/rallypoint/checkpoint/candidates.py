"""What a load chooses from: every copy of a checkpoint that this rank could load, in node
memory (this node's own, a peer's) and in the durable storage, and the choice of the newest
one that loads (memory first when several tiers hold a step)."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rallypoint import events
from rallypoint.checkpoint import loading, slot
from rallypoint.checkpoint import manifest as mf
from rallypoint.checkpoint.copies import FORMAT, SHARDED, Copies
from rallypoint.checkpoint.reading import (
    SHARDS,
    load_slot_file,
    load_torch,
    local_path,
    open_shares,
    sharded_tier,
    slot_reader,
)
from rallypoint.checkpoint.storage import Prefixed
from rallypoint.checkpoint.tier import DURABLE, MEMORY, Tier
from rallypoint.worker import channel as worker_channel

logger = logging.getLogger("rallypoint.checkpoint")


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


#: What a candidate's load returns: the state, the world size that saved it, its bytes.
Loaded = tuple[Any, int, int]
#: What a sharded candidate's ``open(stack)`` returns: a ``StorageReader`` over its files,
#: the world size that saved it, its size in bytes.
Opened = tuple[Any, int, int]
Opener = Callable[[contextlib.ExitStack], Opened]
#: How a sharded candidate is loaded, from what opens it: ``reading(open)() -> Loaded``.
Reading = Callable[[Opener], Callable[[], Loaded]]
#: A format's ``(name, manifest) -> (state, bytes)``, for the checkpoints of one tier.
Read = Callable[[str, mf.Manifest], tuple[Any, int]]


@dataclass(frozen=True)
class Candidate:
    """A copy a load may take: its step, where it is (``source``, ``order`` among copies of
    one step: memory first), and what loads it (the state, the saving world size)."""

    step: int
    order: int
    source: str
    where: str
    load: Callable[[], Loaded]
    url: str = ""  # the storage it is in, which a refusal names


class Tiers:
    """The places one rank loads from: this node's own memory copies (``copies``), the
    copies peers sent to its memory (``peer``), the durable storage (``durable``); and the
    candidates each holds. ``resume``: the round's step, none newer taken."""

    def __init__(
        self,
        copies: Copies | None,
        peer: Tier | None,
        durable: Tier | None,
        *,
        rank: int,
        world_size: int,
        resume: int | None,
    ) -> None:
        self.copies = copies
        self.peer = peer
        self.durable = durable
        self.rank = rank
        self.world_size = world_size
        self.resume = resume

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints anywhere, oldest first."""
        found = set() if self.copies is None else self.copies.complete_steps()
        for tier in (self.peer, self.durable):
            if tier is not None:
                found |= tier.complete_steps()
        return sorted(found)

    # --- replicated state (``save``) ------------------------------------------------------

    def replicated(self, options: dict[str, Any]) -> list[Candidate]:
        """Every copy of rank 0's state a load could take, loaded with ``options``
        (``torch.load``'s ``map_location``, ``weights_only``); none newer than the round's."""
        candidates = self._memory_copies(options)
        readers = {"torch": load_torch, FORMAT: load_slot_file}
        for order, tier in enumerate(t for t in (self.peer, self.durable) if t is not None):
            formats: dict[str, Read] = {
                name: functools.partial(read, tier, options=options)
                for name, read in readers.items()
            }
            candidates += self._in_tier(tier, order + 1, formats)
        if self.resume is not None:
            # Every rank of the round loads the same step: none newer than the round's.
            candidates = [c for c in candidates if c.step <= self.resume]
            if not any(c.step == self.resume for c in candidates):
                logger.warning(
                    "this node holds no copy of step %d, the round's checkpoint: loading an "
                    "older one, which the other nodes' ranks will not",
                    self.resume,
                )
        return candidates

    def _memory_copies(self, options: dict[str, Any]) -> list[Candidate]:
        found: list[Candidate] = []
        if self.copies is None:
            return found
        for copy in self.copies.newest(rank=0, most=self.resume):

            def load(copy: slot.Copy = copy) -> Loaded:
                try:
                    state = loading.load_copy(copy, **options)
                except slot.Busy:
                    raise mf.Damaged("written over while it was read") from None
                return state, copy.record.world_size, copy.record.size

            where = f"{mf.directory(copy.step)} ({MEMORY})"
            found.append(Candidate(copy.step, 0, MEMORY, where, load))
        return found

    def _in_tier(self, tier: Tier, order: int, formats: Mapping[str, Read]) -> list[Candidate]:
        """A candidate per checkpoint in ``tier``, loaded by its format's ``Read``."""
        found = []
        for step in tier.all_steps():
            name = mf.directory(step)

            def load(name: str = name) -> Loaded:
                manifest = tier.manifest(name)
                read = formats.get(manifest.format)
                if read is None:
                    raise mf.Damaged(
                        f"it is a {manifest.format} checkpoint, not {' or '.join(formats)}"
                    )
                state, size = read(name, manifest)
                return state, manifest.world_size, size

            where = f"{name} ({tier.source})"
            found.append(Candidate(step, order, tier.source, where, load, tier.url))
        return found

    # --- sharded state (``save_sharded``) -------------------------------------------------

    def sharded(self, reading: Reading) -> list[Candidate]:
        """Every sharded checkpoint this rank could load, each loaded by ``reading(open)``:
        ``open(stack)`` checks its files, holds them open in ``stack``, and returns a
        ``StorageReader`` over them, the world size that saved it and its size."""
        candidates = self._own_shares(reading)
        if self.peer is not None:
            mine = ranks_tier(self.peer, self.rank)

            def open_peer(name: str, manifest: mf.Manifest, stack: contextlib.ExitStack) -> Opened:
                reader, size = open_shares(stack, [(mine, name, manifest)])
                return reader, manifest.world_size, size

            candidates += self._in_tier(mine, 1, {FORMAT: _read_with(reading, open_peer)})
        if self.durable is not None:
            candidates += self._shared(self.durable, reading)
            durable = self.durable

            def open_dcp(name: str, manifest: mf.Manifest, stack: contextlib.ExitStack) -> Opened:
                from torch.distributed.checkpoint.filesystem import FileSystemReader

                durable.verify_files(name, manifest)
                size = sum(entry.size for entry in manifest.files.values())
                reader = FileSystemReader(local_path(durable, f"{name}/{SHARDS}"))
                return reader, manifest.world_size, size

            candidates += self._in_tier(durable, 3, {"dcp": _read_with(reading, open_dcp)})
        if self.resume is not None:
            candidates = [c for c in candidates if c.step <= self.resume]
        if not candidates and self.durable is None and self.copies is None:
            sharded_tier(self.durable)  # says what is missing
        return candidates

    def _own_shares(self, reading: Reading) -> list[Candidate]:
        """This rank's shares in this node's memory, saved at this world size."""
        found: list[Candidate] = []
        if self.copies is None:
            return found
        for copy in self.copies.newest(self.rank, self.resume, sharded=True):
            if copy.record.world_size != self.world_size:
                continue

            def open_copy(stack: contextlib.ExitStack, copy: slot.Copy = copy) -> Opened:
                try:
                    stack.enter_context(slot.lease(copy))
                except slot.Busy:
                    raise mf.Damaged("written over while it was read") from None
                return slot_reader([copy.path]), copy.record.world_size, copy.record.size

            where = f"{mf.directory(copy.step)} ({MEMORY})"
            found.append(Candidate(copy.step, 0, MEMORY, where, reading(open_copy)))
        return found

    def _shared(self, durable: Tier, reading: Reading) -> list[Candidate]:
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
                reader, size = open_shares(stack, manifests)
                return reader, world, size

            where = f"{name} ({DURABLE})"
            found.append(Candidate(step, 2, DURABLE, where, reading(open_all), durable.url))
        return found


def newest(candidates: list[Candidate]) -> Checkpoint | None:
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


def loading_into(state: dict[str, Any]) -> Reading:
    """``Reading`` for ``load_sharded``: DCP loads the chosen checkpoint into ``state`` in
    place, this rank alone."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    def reading(open_reader: Opener) -> Callable[[], Loaded]:
        def load() -> Loaded:
            with contextlib.ExitStack() as stack:
                reader, world, size = open_reader(stack)
                with warnings.catch_warnings():  # no_dist: this rank reads alone
                    warnings.simplefilter("ignore", UserWarning)
                    dcp_load(state, storage_reader=reader, no_dist=True)
            return None, world, size

        return load

    return reading


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


def _read_with(
    reading: Reading, opener: Callable[[str, mf.Manifest, contextlib.ExitStack], Opened]
) -> Read:
    """A format's ``Read`` for ``Tiers._in_tier``: ``reading`` what ``opener`` opens."""

    def read(name: str, manifest: mf.Manifest) -> tuple[Any, int]:
        state, _, size = reading(functools.partial(opener, name, manifest))()
        return state, size

    return read

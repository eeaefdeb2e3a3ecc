"""A save as a stager and a writer, as ``torch.distributed.checkpoint`` splits ``async_save``
(its ``AsyncStager``): the stager copies the state out of the training loop's way, the writer
puts what was staged where the save goes. A ``Checkpointer`` picks the pair for each kind of
save once, when it is made (``Checkpointer`` says which); a save then runs whichever it got.

The stagers are here: ``Unstaged`` (the writer gets the state itself, at once) and
``HostStaging`` (host buffers, ``copying.Staging``, the writer running in the copying thread).
The writers are in ``rallypoint.checkpoint.writers``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rallypoint.checkpoint.copying import Copier, Staging
from rallypoint.interfaces import CheckpointError

#: A part's place in a whole tensor, by the part's ``id``: (the whole's shape, the part's
#: offset in it), as ``Arena.save`` takes it.
Placed = Mapping[int, tuple[tuple[int, ...], tuple[int, ...]]]

#: What a stager hands its staged state to: ``write(staged, blocked)``, ``blocked`` the
#: seconds an asynchronous save held the loop up, ``None`` when the loop waits for the write.
Write = Callable[[Any, float | None], object]


@dataclass(frozen=True)
class Job:
    """One save: ``state`` as the checkpoint of ``step``, in ``format`` (``slot.FORMATS``),
    ``placed`` as for ``Arena.save``; ``began`` when the caller asked for it."""

    state: Any
    step: int
    asynchronous: bool = False
    format: str = "state"
    placed: Placed | None = None
    began: float = field(default_factory=time.perf_counter)

    @property
    def label(self) -> str:
        """What the save is, for its messages."""
        return f"checkpoint of step {self.step}"


class Stager(Protocol):
    """How a save's state is copied out of the training loop's way before it is written."""

    def stage(self, job: Job, write: Write) -> None:
        """Stage ``job``'s state, then ``write`` what was staged (now, or in a thread)."""

    def wait(self) -> None:
        """Until every save staged has been written; raise the error of one that failed."""


class Writer(Protocol):
    """Where a save goes."""

    def settle(self) -> None:
        """Before a save is staged: wait for what must be done first (its error raised)."""

    def write(self, staged: Any, job: Job, blocked: float | None) -> None:
        """Write ``staged`` (``job``'s state, or its staged copy) as ``job``'s checkpoint;
        ``blocked`` as for ``Write``."""

    def wait(self) -> None:
        """Until every save it writes in the background is done; raise the error of one
        that failed."""


@dataclass(frozen=True)
class SaveMode:
    """One kind of save: its stager and its writer."""

    stager: Stager
    writer: Writer

    def save(self, job: Job) -> None:
        self.writer.settle()
        writer = self.writer
        self.stager.stage(job, lambda staged, blocked: writer.write(staged, job, blocked))

    def wait(self) -> None:
        self.writer.wait()
        self.stager.wait()


class Unstaged:
    """No staging: the writer gets the state itself, now, in the caller's thread. A
    synchronous save to ``--checkpoint-dir`` is written while the loop waits; the arena
    copies the state into its slot itself (its slots are its staging buffers), now or while
    the loop goes on, as ``Job.asynchronous`` says (``rallypoint.checkpoint.arena``)."""

    def stage(self, job: Job, write: Write) -> None:
        write(job.state, None)

    def wait(self) -> None:
        pass


class HostStaging:
    """The state copied into host memory (``copying.Staging``: buffers allocated once and
    reused, pinned for CUDA tensors) while the loop goes on; the writer writes the copy in
    the copying thread."""

    def __init__(self) -> None:
        self.staging = Staging()

    @property
    def copier(self) -> Copier:
        """The copies of the saves staged, the one in flight included."""
        return self.staging.copier

    def stage(self, job: Job, write: Write) -> None:
        self.staging.stage(job.state, job.label, job.began, write)

    def wait(self) -> None:
        while (done := self.copier.next_done()) is not None:
            if done.error is not None:
                raise CheckpointError(
                    f"the background checkpoint save failed: {done.error}"
                ) from done.error

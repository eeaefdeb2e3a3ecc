"""The interfaces plugins implement and the agent drives, apart from the registrations.

A registration (``rallypoint.extensions``) is what a plugin yields; these are what its
callables return: a ``CoordinationStore`` (a rendezvous backend's ``connect``), a whole
``RendezvousHandler`` (its ``create_handler``) with the ``Assignment`` of each round, a
``CheckpointStorage`` (a checkpoint backend's ``open``); and the errors they raise. They
import nothing but ``rallypoint.errors`` and ``rallypoint.events``, so that every other
module can depend on them and none of them on another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

from rallypoint.errors import RallypointError
from rallypoint.events import RoundInfo

# --- the coordination store of the rendezvous protocol -------------------------------------


class StoreError(RallypointError):
    """The store failed, or holds what it should not; the message names it and what to do."""


class StoreUnavailable(StoreError):
    """The store cannot be reached right now (restarting, failing over, network).

    The protocol retries the operation with backoff, for ``retry_timeout`` seconds, and
    leaves running workers alone meanwhile; any other ``StoreError`` ends the rendezvous.
    """


class CoordinationStore(Protocol):
    """Atomic operations on a shared key-value store. Keys are ``/``-separated text.

    Raise ``StoreUnavailable`` when the service cannot be reached (the operation will be
    retried) and ``StoreError`` for anything else; never the client library's own errors.
    """

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if absent); return the sum."""
        ...

    def add_and_get(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        """``add(key, amount)`` and ``get(other)``, in one request where the service
        allows (an etcd transaction, a Redis script): every node joins a round this way,
        taking its join number and reading the job's round at once. ``add`` then ``get``
        is a correct implementation."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value at ``key``, or ``None`` if there is none; never blocks."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values at ``keys``, in order (``None`` where absent), in as few requests as
        the service allows: the round's leader reads every joiner's record with it."""
        ...

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` at ``key``."""
        ...

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``None``: if it is absent).

        Returns the value ``key`` holds afterwards: ``desired`` when the swap happened,
        ``b""`` when ``key`` is absent and ``expected`` was not ``None``.
        """
        ...

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Block until every key exists (without polling); ``False`` after ``timeout`` s."""
        ...

    def wait_value(self, key: str, timeout: float) -> bytes | None:
        """Block until ``key`` exists (without polling) and return its value; ``None``
        after ``timeout`` s. Every node reads the round's record this way once the leader
        has written it: a store whose notification carries the value (an etcd watch
        event, a Redis message) answers without another request. ``wait`` then ``get``
        is a correct implementation."""
        ...

    def keep_alive(self, key: str, ttl: float) -> None:
        """Say "``key``'s owner is alive" for ``ttl`` more seconds. The owner calls this
        every ``ttl / 3`` s; a lease (etcd) or a key expiry (Redis) ends it when they stop,
        and ``close`` ends it at once."""
        ...

    def alive(self, key: str, ttl: float) -> bool:
        """Whether ``key``'s owner called ``keep_alive`` within the last ``ttl`` seconds."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key that starts with ``prefix``, with the liveness kept under it (a
        key, or a key's expiry); return how many keys were deleted. The protocol calls it
        once a run has finished cleanly, with the run's root (``<prefix>/<run id>/``), so
        that a finished job leaves nothing behind. Liveness kept outside the key space (an
        etcd lease) is ended by ``close``. A ``wait`` on a deleted key waits for it to be
        set again."""
        ...

    def clone(self) -> CoordinationStore:
        """A second connection to the same store, for another thread."""
        ...

    def close(self) -> None:
        """Release the connection (and the server, if this process hosts it). The keys
        kept alive through this connection stop being alive now (etcd revokes the lease,
        Redis deletes the key): a node that leaves (its agent stopped, say by a
        preemption's SIGTERM) is seen gone at once, not ``heartbeat_timeout`` later."""
        ...


class RendezvousTimeout(RallypointError):
    """Not enough nodes joined in time; the message says which round and which timeout."""


class RendezvousFailed(RallypointError):
    """The round could not form, or another node failed the job; the message says why."""


# --- a rendezvous of a backend's own --------------------------------------------------------


@dataclass(frozen=True)
class Assignment:
    """A completed round, as this node takes part in it.

    Attributes:
        info: the round's public description (number, ranks, sizes, master, members).
        local_world_sizes: workers per node, indexed by group rank; global ranks are their
            prefix sums, as in torchrun.
        offers: what each member's agent offered the round, indexed by group rank (where
            it serves its memory checkpoints, and which steps it holds); empty when the
            handler carries none, or no member made one.
    """

    info: RoundInfo
    local_world_sizes: tuple[int, ...]
    offers: tuple[Mapping[str, str], ...] = ()

    @property
    def rank_offset(self) -> int:
        """The global rank of this node's local rank 0."""
        return sum(self.local_world_sizes[: self.info.group_rank])


class RendezvousHandler(Protocol):
    """A rendezvous as the agent drives it: what a backend's ``create_handler`` returns.

    The first five methods are required. ``gone``, ``fail``, ``paces``, ``waits``,
    ``give_notice`` and ``noticed`` have defaults here (a handler that knows nothing of
    them): inherit from this class to get them, and override those your rendezvous can
    answer. The agent calls every method directly; what a handler needs from the agent (a
    node's offer, its pace, its waits, whether it is ready) comes in the
    ``RendezvousRequest``.

    Example::

        class MyRendezvous(RendezvousHandler):
            def next_round(self) -> Assignment: ...
            def nodes_waiting(self) -> int: ...
            def request_new_round(self) -> None: ...
            def exit_barrier(self, timeout: float) -> None: ...
            def close(self) -> None: ...
    """

    def next_round(self) -> Assignment:
        """Join the next round and block until it completes; raise on timeout or close."""
        ...

    def nodes_waiting(self) -> int:
        """Nodes that arrived after the current round completed (they trigger a new round)."""
        ...

    def request_new_round(self) -> None:
        """This node's workers failed and will restart: make every node start a new round."""
        ...

    def exit_barrier(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, for every node of the round to finish."""
        ...

    def close(self) -> None:
        """Leave the rendezvous and release what the handler holds (ports, connections)."""
        ...

    def gone(self, node_ids: Sequence[str]) -> list[str]:
        """Those of ``node_ids`` (the last round's members) that did not come back to the
        round this node last waited in: the agent names them when a round cannot form.
        Default: none known."""
        return []

    def fail(self, reason: str) -> None:
        """This node's restart policy gave up: make every node of the job stop, for
        ``reason``. Default: nothing (the others see this node leave)."""
        return None

    def paces(self) -> dict[str, float]:
        """The current round's members' paces (node id -> workers' CPU seconds per step)
        when the request carried a ``pace``; the agent names stragglers from them.
        Default: none."""
        return {}

    def waits(self) -> dict[str, Mapping[str, Any]]:
        """What the current round's other members shared of their ranks' long waits in
        collectives (node id -> ``WaitSource.shared``'s value, unchecked), when the request
        carried ``waits`` and it wanted them; the agent's hang detection takes them as
        evidence. Default: none."""
        return {}

    def give_notice(self, step: int) -> int:
        """This node was told to stop (SIGTERM) with its workers at ``step``: ask every
        node of the round to save at that step, mark this node as leaving, and end the
        round. Returns the step every node saves at (the first notice given, when several
        nodes were told at once). Default: ``step``, for this node only (the others lose
        what they did since their last save, as before)."""
        return step

    def noticed(self, proposal: int | None = None) -> int | None:
        """Once this node's round ended: the step every member saves at before its workers
        stop. The notice a node told to stop gave; else, when the round ended for a
        newcomer, the first member's ``proposal`` (this node's workers' step plus a lead;
        None: it proposes none), the same for every member. None: no save on notice.
        Default: None."""
        return None


# --- checkpoint storage -------------------------------------------------------------------


class CheckpointError(RallypointError):
    """A checkpoint could not be written or read; the message says which and why."""


class CheckpointStorage(Protocol):
    """Named objects under one root (a directory, a bucket prefix).

    What ``Checkpointer`` writes through it, for the checkpoint of step 120, in this order:
    ``step-000000000120/begun``, an empty object (zero bytes) that marks the checkpoint as
    begun, so that a save that never finished is listed by ``names`` and removed by a
    later rotation; the payload, ``state.pt`` (a sharded save's files under ``shards/``
    are written by ``torch.distributed.checkpoint`` on the file system itself); and last
    ``manifest.json``, whose presence makes the checkpoint complete. ``begun`` is never
    read, only listed and deleted with its prefix: a storage must keep, list and delete an
    empty object like any other.
    """

    url: str

    def writer(self, name: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A binary file to write ``name`` into. The object appears, whole, only when the
        block ends without an exception; before that, and after a crash, readers see the
        previous state (no object, or the old one)."""
        ...

    def reader(self, name: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """``name`` opened for reading; ``FileNotFoundError`` when there is none."""
        ...

    def names(self) -> list[str]:
        """Every complete object, by name (never one still being written)."""
        ...

    def delete(self, name: str) -> None:
        """Remove ``name`` and everything under ``name/``; nothing to remove is fine."""
        ...

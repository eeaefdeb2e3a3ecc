"""What the agent needs from a rendezvous, whatever the backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rallypoint.events import RoundInfo


@dataclass(frozen=True)
class Assignment:
    """A completed round, as this node takes part in it.

    Attributes:
        info: the round's public description (number, ranks, sizes, master, members).
        local_world_sizes: workers per node, indexed by group rank; global ranks are their
            prefix sums, as in torchrun.
    """

    info: RoundInfo
    local_world_sizes: tuple[int, ...]

    @property
    def rank_offset(self) -> int:
        """The global rank of this node's local rank 0."""
        return sum(self.local_world_sizes[: self.info.group_rank])


class RendezvousHandler(Protocol):
    """A rendezvous as the agent drives it."""

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

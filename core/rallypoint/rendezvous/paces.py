"""Paces shared through the round: each member's workers' CPU seconds per step.

The agent's straggler detection (``agent.stragglers``) compares them; the heartbeat shares
them, one write and one read of the round's members per beat, when the agent gives the
handler a pace (``--straggler-factor``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from rallypoint.rendezvous import calls
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.node import Membership


class PaceBoard:
    """This node's pace written, and the round's members' read, on each heartbeat."""

    def __init__(self, node_id: str, pace: Callable[[], float | None]) -> None:
        self.node_id = node_id
        self.pace = pace
        self._read: tuple[int, dict[str, float]] = (-1, {})  # (round, paces): replaced whole

    def share(self, view: Membership) -> Steps[None]:
        """On a heartbeat in a round: write this node's pace, read the members'."""
        round_, record = view.round, view.record
        if round_ is None or record is None or view.joining is not None:
            return
        keys = view.keys
        pace = self.pace()
        if pace is not None:
            yield from calls.set_(keys.of_round(round_, "pace", self.node_id), str(pace).encode())
        names = [keys.of_round(round_, "pace", node) for node in record.node_ids]
        paces = {}
        for node, raw in zip(record.node_ids, (yield from calls.get_many(names)), strict=True):
            with contextlib.suppress(ValueError, TypeError):
                if raw is not None:
                    paces[node] = float(raw)
        self._read = (round_, paces)

    def paces(self, round_: int | None) -> dict[str, float]:
        """The paces read in ``round_`` (this node's included); empty before the first."""
        read_in, paces = self._read
        return dict(paces) if read_in == round_ else {}

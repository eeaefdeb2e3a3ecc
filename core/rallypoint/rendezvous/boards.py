"""What a node shares with its round's other nodes on each heartbeat, through the store.

* ``PaceBoard``: each member's workers' CPU seconds per step, when ``--straggler-factor``
  is on; the agent's straggler detection (``agent.monitoring.stragglers``) compares them.
  One write and one read of the round's members per beat.
* ``WaitBoard``: where a node's ranks have waited in a collective for long, for the hang
  detection of the others (``agent.monitoring.hangs``): a rank stuck on one node is found
  from its peers waiting on another. Written only while a rank waits that long (and once
  more, empty, when none does), and read only by a node that holds a suspect: a healthy
  job costs the store nothing.

What is read is the store's, so hostile until checked: a value too long, not JSON, or not
of the expected shape is dropped here; ``agent.monitoring.hangs`` checks each field.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rallypoint.extensions import WaitSource
from rallypoint.rendezvous import calls
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.node import Membership

#: The longest value of a node's waits that is read: SHARED_PLACES places and their ranks
#: (``agent.monitoring.hangs``) fit in it with room to spare.
MAX_WAITS_BYTES = 16 * 1024


class Board(Protocol):
    """Something a node shares on each heartbeat in a round."""

    def share(self, view: Membership) -> Steps[None]: ...


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


class WaitBoard:
    """This node's waits written when it has some to tell, and the round's other members'
    read when its hang detection wants them, on each heartbeat."""

    def __init__(self, node_id: str, source: WaitSource) -> None:
        self.node_id = node_id
        self.source = source
        self._written: tuple[int, bytes] = (-1, b"")  # (round, value) last written
        self._read: tuple[int, dict[str, Mapping[str, Any]]] = (-1, {})  # replaced whole

    def share(self, view: Membership) -> Steps[None]:
        round_, record = view.round, view.record
        if round_ is None or record is None or view.joining is not None:
            return
        keys = view.keys
        mine = self.source.shared()
        value = b"" if mine is None else json.dumps(mine, separators=(",", ":")).encode()
        if (round_, value) != self._written and (value or self._written[0] == round_):
            # Written when it changes; an empty value says its ranks wait no longer.
            yield from calls.set_(keys.of_round(round_, "waits", self.node_id), value)
            self._written = (round_, value)
        if not self.source.wanted():
            self._read = (round_, {})  # what was read is old news by the next time
            return
        others = [node for node in record.node_ids if node != self.node_id]
        names = [keys.of_round(round_, "waits", node) for node in others]
        read = {}
        for node, raw in zip(others, (yield from calls.get_many(names)), strict=True):
            summary = _decoded(raw)
            if summary is not None:
                read[node] = summary
        self._read = (round_, read)

    def waits(self, round_: int | None) -> dict[str, Mapping[str, Any]]:
        """The other members' waits read in ``round_``: node id -> what it shared."""
        read_in, waits = self._read
        return dict(waits) if read_in == round_ else {}


def _decoded(raw: bytes | None) -> Mapping[str, Any] | None:
    if not raw or len(raw) > MAX_WAITS_BYTES:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None

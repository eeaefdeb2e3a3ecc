"""How a job ends for its nodes: cleanly, each member waiting at the exit barrier until
every one finished; or failed, one node saying why for all.

The exit barrier's marks are per member (``<round>/done/<group rank>``); its count
(``<round>/done``) only says when to look, since a stray can add to a count, not to a
sealed mark. A failure is one record (``failed``) that every node reads before it joins a
later round.
"""

from __future__ import annotations

import contextlib
import json
import logging

from rallypoint.interfaces import RendezvousFailed, StoreError
from rallypoint.rendezvous import calls
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.node import NodeState
from rallypoint.rendezvous.rounds import RunChecks

logger = logging.getLogger("rallypoint.rendezvous")


class Exits:
    """One node's way out of a job: the exit barrier, and failing the job or learning that
    another node failed it."""

    def __init__(self, node: NodeState, checks: RunChecks) -> None:
        self.node = node
        self.settings = node.settings
        self.checks = checks

    @property
    def keys(self) -> Keys:
        return self.node.view.keys

    def exit_barrier(self, timeout: float) -> Steps[int | None]:
        """Wait, at most ``timeout`` s, until every member of this node's round finished.

        Each member writes its own mark (``done/<group rank>``, sealed in a sealed job),
        then counts itself; the count only says when to look: the member that finds every
        mark written says so for all (``done/all``). A count a stray added to makes a
        member look early, never pass early; one a stray took from would keep them from
        looking, so group rank 0 looks at the marks on every turn, whatever the count
        says (one read of N marks, by one node). The round passed; None if none was."""
        node = self.node
        view = node.publish(watch=None)  # finished nodes stop beating at different times
        round_, record, keys = view.round, view.record, view.keys
        if round_ is None or record is None or node.node_id not in record.node_ids:
            return None
        size = len(record.node_ids)
        rank = record.node_ids.index(node.node_id)
        yield from calls.set_(keys.of_round(round_, "done", rank), b"1")
        count = yield from calls.add(keys.of_round(round_, "done"), 1)
        marks = [keys.of_round(round_, "done", rank) for rank in range(size)]
        passed = keys.of_round(round_, "done", "all")
        deadline = node.clock() + timeout
        slice_ = self.settings.heartbeat_timeout / 3
        while True:
            looks = count >= size or rank == 0
            if looks and all(v is not None for v in (yield from calls.get_many(marks))):
                yield from calls.set_(passed, b"1")
                break
            if (yield from calls.wait([passed], min(slice_, max(0.0, deadline - node.clock())))):
                break
            if (yield from self.checks.ended(round_)):
                # The others went on without this node (they took it for gone while it
                # finished): they will not pass this round's barrier; waiting is for nothing.
                logger.warning(
                    "exit barrier: the job went on to a later round without this node; "
                    "not waiting for the others"
                )
                return None
            if node.clock() >= deadline:
                logger.warning("exit barrier: not every node finished within %.0f s", timeout)
                return None
            count = yield from calls.add(keys.of_round(round_, "done"), 0)
        return round_

    def fail(self, reason: str) -> Steps[None]:
        """Fail the job for every node: each reads why before it joins (``check_failed``)."""
        record = json.dumps({"node": self.node.node_id, "reason": reason}).encode()
        with contextlib.suppress(StoreError):  # leaving tells the others it went, at least
            yield from calls.set_(self.keys.failed(), record)

    def check_failed(self) -> Steps[None]:
        """Stop when another node failed the job (``fail``)."""
        raw = yield from calls.get(self.keys.failed())
        if raw is None:
            return
        try:
            data = json.loads(raw)
            node, reason = str(data["node"]), str(data["reason"])
        except (ValueError, KeyError, TypeError):
            node, reason = "?", raw.decode("utf-8", "replace")[:200]
        raise RendezvousFailed(f"the job failed on node {node}: {reason}")

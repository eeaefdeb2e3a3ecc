"""A node that comes to a running job gets ready beside it before it enters a round.

Entering a round ends the running one: every node stops its workers and starts new ones
with the newcomer. So a newcomer first gets ready to start its workers at once (its
agent's preloaded interpreter up, the newest memory checkpoint fetched from a member)
while the job trains on, and only then joins. While it waits it says what it is doing
(``ready/<n>`` under the run's keys, which ``rallypoint rendezvous status`` lists, and
a log line when that changes); one that is not ready within ``ready_timeout`` gives up.
A node that comes to a new job (no round has closed yet) joins at once.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rallypoint.interfaces import RendezvousTimeout
from rallypoint.rendezvous import calls, records
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.generations import MOST_CHECKED, job_round, newest_closed
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.node import NodeState

logger = logging.getLogger("rallypoint.rendezvous")

#: The agent's readiness: given the running round's offers (by group rank), what this node
#: is still doing ("importing torch"), or None once it can start workers at once.
Ready = Callable[[Sequence[Mapping[str, str]]], "str | None"]
#: Seconds between two looks at whether this node is ready.
LOOK = 0.1
#: Seconds between two lines that say the same thing is still being done (as the
#: rendezvous' own progress lines).
SAY_EVERY = 5.0


def running_round(node: NodeState) -> Steps[records.RoundRecord | None]:
    """The record of the round the job trained in last, if it has trained (the newest
    closed round, without error, a member alive) and this node is not in it. The job may
    be between rounds (a member left): it forms the next without the newcomer, and trains
    on while the newcomer gets ready, rather than wait in that round for its start-up."""
    keys = node.view.keys
    record = yield from newest_closed(keys, (yield from job_round(keys)))
    if record is None:
        return None  # a new job: every node joins at once, importing meanwhile
    if record.error or node.node_id in record.node_ids:
        return None
    for node_id in record.node_ids:
        if (yield from node.alive(node_id)):
            return record
    return None


def get_ready(node: NodeState, ready: Ready) -> Steps[None]:
    """Wait beside the running round, if there is one, until ``ready`` says this node is
    ready; RendezvousTimeout after ``ready_timeout`` seconds."""
    record = yield from running_round(node)
    if record is None:
        return
    keys, limit = node.view.keys, node.settings.ready_timeout
    began, number, shown, said = node.clock(), None, None, -math.inf
    while (doing := ready(record.offers)) is not None:
        if doing != shown:
            if number is None:
                number = yield from calls.add(keys.ready_count(), 1)
            yield from calls.set_(keys.ready(number), encode(node.node_id, doing))
            logger.info("getting ready beside round %d: %s", record.round, doing)
            shown, said = doing, node.clock()
        elif node.clock() - said >= SAY_EVERY:
            logger.info(
                "getting ready beside round %d for %.0f s: %s (ready_timeout=%g s)",
                record.round, node.clock() - began, doing, limit,
            )  # fmt: skip
            said = node.clock()
        if node.clock() - began >= limit:
            raise RendezvousTimeout(
                f"this node was not ready to start workers within ready_timeout={limit:g} s "
                f"(still {doing}); it does not join the job"
            )
        yield from calls.pause(LOOK)
    if number is not None:
        yield from calls.set_(keys.ready(number), encode(node.node_id, ""))
        logger.info("ready after %.1f s: joining the job", node.clock() - began)


def encode(node_id: str, doing: str) -> bytes:
    return json.dumps({"kind": "ready", "node": node_id, "doing": doing}).encode()


def getting_ready(keys: Keys) -> Steps[list[tuple[str, str]]]:
    """The nodes that said they are getting ready, and what they do (done ones left out;
    whether they are alive is the reader's to ask)."""
    # A count anyone who reaches the store can add to: capped, it sizes no read beyond.
    count = min((yield from calls.add(keys.ready_count(), 0)), MOST_CHECKED)
    names = [keys.ready(i) for i in range(1, count + 1)]
    found: dict[str, str] = {}
    for raw in (yield from calls.get_many(names)) if names else []:
        entry = _decode(raw)
        if entry is not None:
            found[entry["node"]] = entry["doing"]
    return [(node_id, doing) for node_id, doing in found.items() if doing]


def _decode(raw: bytes | None) -> dict[str, Any] | None:
    try:
        entry = json.loads(raw or b"")
    except ValueError:
        return None
    ok = isinstance(entry, dict) and entry.get("kind") == "ready"
    return entry if ok and isinstance(entry.get("node"), str) else None

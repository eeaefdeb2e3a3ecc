"""What one node knows of the rendezvous, shared by its joining and its heartbeat.

The joining (the agent's thread, in ``next_round``) is the only writer of the node's
``Membership``, and replaces it whole; the heartbeat (a thread of its own) reads it once
per beat and so always sees one consistent round, record and generation without a lock.
The heartbeat is the only writer of ``ended``. Stalls are noted by both, under
``Stalls``'s lock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from rallypoint.extensions import NodeSpec
from rallypoint.interfaces import StoreError
from rallypoint.rendezvous import calls
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.liveness import Stalls
from rallypoint.rendezvous.records import RoundRecord
from rallypoint.rendezvous.settings import Settings


@dataclass(frozen=True)
class Watch:
    """The member this node watches in its round (the next one in rank order: a ring)."""

    round: int
    node_id: str
    host: str
    size: int


@dataclass(frozen=True)
class Membership:
    """Where this node stands: never changed in place, replaced by the joining."""

    keys: Keys
    round: int | None = None  # the round this node is a member of
    record: RoundRecord | None = None  # that round's record
    last_joined: int | None = None  # the round this node last joined (or waits in)
    joining: float | None = None  # the join deadline while next_round runs
    last_call: tuple[int, float] | None = None  # as a new job's leader: round, its end
    watch: Watch | None = None


class NodeState:
    """One node in the protocol: who it is, its settings and clock, where it stands."""

    def __init__(
        self,
        spec: NodeSpec,
        nproc: int,
        settings: Settings,
        keys: Keys,
        clock: Callable[[], float],
        *,
        sealed: bool = False,
    ) -> None:
        self.spec = spec
        #: Whether its records are sealed with a job token (``rendezvous.signing``): then
        #: a first look at liveness can be fooled, and is looked at again before a run is
        #: taken for abandoned.
        self.sealed = sealed
        self.nproc = nproc
        self.settings = settings
        self.clock = clock
        self.view = Membership(keys)
        self.stalls = Stalls(settings.heartbeat_timeout, clock)
        #: (generation, round): the newest round the heartbeat saw end; its only writer.
        self.ended: tuple[int, int] = (-1, -1)
        #: Why the heartbeat stopped (the store out of reach for longer than
        #: retry_timeout), if it did: this node is no longer kept alive, so it fails.
        self.heartbeat_failed: StoreError | None = None
        #: When this node last renewed its liveness (``renewed``), on ``clock``.
        self.kept_at = -float("inf")

    def renewed(self) -> None:
        """This node's liveness was renewed just now (by its heartbeat, or a join)."""
        self.kept_at = self.clock()

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    def publish(self, **changes: object) -> Membership:
        """Replace the membership with one that has ``changes``."""
        self.view = dataclasses.replace(self.view, **changes)  # type: ignore[arg-type]
        return self.view

    def round_ended(self) -> bool:
        """Whether the round this node is a member of has ended (the heartbeat saw it)."""
        view = self.view
        if view.round is None:
            return False
        return self.ended >= (view.keys.generation, view.round)

    def alive(self, node_id: str, keys: Keys | None = None) -> Steps[bool]:
        """Whether ``node_id`` keeps itself alive; every node counts as alive while this one
        has just come back from a stall (``Stalls``)."""
        return self.alive_key((keys or self.view.keys).heartbeat(node_id))

    def alive_key(self, key: str) -> Steps[bool]:
        if self.stalls.in_grace():
            return True
        began = self.clock()
        answer = yield from calls.alive(key, self.settings.heartbeat_timeout)
        # A read that waited out an outage says "gone" of a node that could not renew
        # either: the stall it spanned starts the grace, and the answer is not trusted.
        self.stalls.note(began)
        return answer or self.stalls.in_grace()

"""How the job moves on: a node ends a round for every node (``advance``), and learns that
the job went on without it (``RunChecks``: a later round, a newer generation, its own
heartbeat stopped).

The joining, the leader, the exit barrier, the heartbeat and the notices all end rounds
or ask whether theirs ended; these steps sit below all of them.
"""

from __future__ import annotations

import logging

from rallypoint.interfaces import StoreError
from rallypoint.rendezvous import calls, generations, records
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.generations import job_round
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.node import NodeState

logger = logging.getLogger("rallypoint.rendezvous")

#: For how many heartbeat_timeouts after a stall a node checks whether the run was started
#: afresh without it (``newer_generation``): a newcomer that read its lapsed liveness may
#: move the generation a little after the stall ended.
STALL_WATCH = 3
#: How many times ``advance`` replaces a state lower than the round it ends.
_STALE_TRIES = 4


class LeaderLost(Exception):
    """The round being formed was ended before it closed: its leader died, or another node
    ended it (having found the leader dead); this node goes on to the next round."""


def advance(keys: Keys, from_round: int, expected: int) -> Steps[None]:
    """End round ``from_round`` for every node (unless another node already did).

    ``expected`` is how many nodes the next round should wait for before closing; it is
    written before the round changes, so the next leader always finds it.

    The state this node knows the job reached is ``from_round`` at least: a lower one in
    the store was written back there (a stray's copy of an older sealed state) and is
    replaced, so that a replayed state can neither keep a round from ending nor end one
    twice.
    """
    yield from calls.compare_set(keys.of_round(from_round + 1, "expected"), None, _int(expected))
    following = _int(from_round + 1)
    want = _int(from_round) if from_round > 0 else None
    now = b""
    for _ in range(_STALE_TRIES):
        now = yield from calls.compare_set(keys.state(), want, following)
        state = records.decode_state(keys.state(), now or None)
        if not now or state > from_round or now == want:
            break
        want = now  # 0 written out (a round that ended before its first), or a stale state
    # Only an opened round may close: a node that came to a full job waits for this; and
    # only a round the job has reached opens (no node waiting for room starts a job of
    # its own beside the running one).
    if records.decode_state(keys.state(), now or None) > from_round:
        yield from calls.set_(keys.of_round(from_round + 1, "open"), b"1")


def store_lost(round_: int) -> StoreError:
    """What a node says when the store no longer has what every member read (``round_``'s
    record, the state that opened it): it restarted without its data, or the agent that
    hosted it (c10d) died and another hosts an empty one. Joining there would start a
    second job beside the running one: the node stops instead."""
    return StoreError(
        f"the rendezvous store no longer has round {round_} of this run: it lost its data "
        "(restarted empty, or the agent that hosted it died); restart the job"
    )


def newer_generation(node: NodeState) -> Steps[Keys | None]:
    """The run's keys in its current generation if a node took this one's generation for
    dead (no agent of it alive) and started the next, else None. Only two kinds of node
    can be left behind so, and the key is read only for them: one whose liveness lapsed,
    that is one that stalled (within STALL_WATCH heartbeat_timeouts of it); and one that
    has yet to be in a round, whose join a newcomer can miss while it reads the run."""
    view = node.view
    stalled = node.stalls.stalled_within(STALL_WATCH * node.settings.heartbeat_timeout)
    if not stalled and view.round is not None:
        return None
    keys = view.keys
    now = yield from generations.current(keys)
    return now if now.generation > keys.generation else None


class RunChecks:
    """Whether the job went on without this node: every wait of the joining, the leader
    and the exit barrier asks, so that none waits for what will not come."""

    def __init__(self, node: NodeState) -> None:
        self.node = node
        self.settings = node.settings

    @property
    def keys(self) -> Keys:
        return self.node.view.keys

    def ended(self, round_: int, state: int | None = None) -> Steps[bool]:
        """Whether the job has moved past ``round_`` (one read of the state, unless the
        caller has just read it: ``state``), or the run was started afresh without this
        node (one more read, after this node stalled). Raises the heartbeat's error if it
        stopped: the others will take this node for gone, and whatever it waits for will
        not come."""
        if self.node.heartbeat_failed is not None:
            raise self.node.heartbeat_failed
        if state is None:
            state = yield from job_round(self.keys)
        if state > round_:
            return True
        return (yield from newer_generation(self.node)) is not None

    def follow_generation(self) -> Steps[bool]:
        """Move to the run's current generation if it left this node's behind (see
        ``generations``): this node then joins it as a new node, at round 0."""
        current = yield from newer_generation(self.node)
        if current is None:
            return False
        logger.warning(
            "run %s was started afresh while this node could not reach the rendezvous "
            "store: joining it as a new node",
            current.run_id,
        )
        left = self.keys
        # Alive in the new generation before its first join record there, as a node is
        # before its first join: the heartbeat renews only every heartbeat_timeout / 3,
        # and a member that read the record first would take this node for gone.
        yield from calls.keep_alive(
            current.heartbeat(self.node.node_id), self.settings.heartbeat_timeout
        )
        self.node.publish(keys=current, round=None, record=None, last_joined=None, last_call=None)
        # The node that moved the run on deleted the old keys; what this node wrote there
        # since (a join, a counter read) is nobody's: delete it too.
        yield from calls.delete_prefix(left.root)
        return True


def _int(value: int) -> bytes:
    return records.encode_int(value)

"""The rendezvous protocol, written once over a ``CoordinationStore``.

Keys live under ``<prefix>/<run id>/`` (``prefix`` is ``/rallypoint`` unless the backend
has a ``prefix`` option), so two jobs never meet. For round ``r``:

* ``state`` - the round the job is in (a counter record), absent while it is in round 0
  (so a new job's nodes only read it); moving it from ``r`` to ``r+1`` (compare-and-set)
  ends round ``r`` for everybody: a node died, a worker failed, or a late node wants in.
  ``r+1/open`` is set right after, and that is what members wait on.
* ``r/joined`` - an atomic counter; each joiner's value is its join index ``i``. The
  request that takes it also reads ``state`` (``add_and_get``): a node joins the round
  after its last (or round 0) and learns in the same request whether the job is further
  on; then it voids the number it took (an empty ``r/node/<i>``) and joins the job's round.
* ``r/node/<i>`` - the joiner's ``NodeRecord``; its existence also marks "``i`` joined",
  which is what the leader waits on, so waiting is event-driven (``wait`` on a key).
* ``r/expected`` - how many nodes a re-formed round expects (survivors plus newcomers), so
  it closes as soon as they are in, instead of waiting for the last call.
* ``r/closed`` - the ``RoundRecord`` the leader (join index 1) writes: members ordered by
  group rank and the master address. One record, read once by each node.
* ``r/done/<g>`` - the exit barrier: each member's mark, by group rank ``g``; ``r/done`` a
  count, a hint of when to look at the marks, and ``r/done/all`` once all are in.
* ``hb/<node id>`` - the node's liveness, kept by ``keep_alive`` every
  ``heartbeat_timeout / 3`` (a counter on TCPStore, a lease on etcd, a TTL on Redis); each
  member watches the next one in rank order (a ring), so liveness costs O(N) in all.

Every node does a constant number of operations per round, and the leader reads the N
records in one request: the store sees O(N) operations per round, not O(N^2). An
unreachable store (``StoreUnavailable``) is retried with backoff for ``retry_timeout``
seconds; running workers are not touched meanwhile. A node that could not reach the store
for longer than ``heartbeat_timeout`` (the others may not have been able to renew their
liveness either) takes no node for dead during the next ``heartbeat_timeout``.

When every member of the last round passed the exit barrier, the one that finds every
member's ``r/left/<g>`` mark written deletes everything of the run (``delete_prefix``): a
finished run leaves nothing in the store. A run that did not finish cleanly keeps its
keys: a node may come back. Counts (``add``) are hints only: anyone who reaches the store
can add to them, so a count read is capped (``Settings.most_joins``) and what it suggests
is checked against sealed marks before anything is decided on it.

The protocol's parts: ``keys`` (this layout), ``joining`` (from ``next_round`` to a round's
record), ``leading`` (a round's leader forms it), ``rounds`` (whether the job went on
without this node), ``exits`` (the exit barrier, a job's failure), ``heartbeat``
(liveness, the ring, the end of a round), ``generations`` (a run id used again),
``boards`` (paces and waits shared through the round), all written as steps that yield
their store calls (``calls``). This module is the handler the agent drives: it performs
the steps on the store (``calls.drive``), the joining in the agent's thread and the
heartbeat in a thread of its own, all through its ``world`` (``rendezvous.world``): this
process's, or in ``rallypoint.testing.simulation`` a simulated node's, where this same
handler runs on a simulated store and clock.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rallypoint.errors import RallypointError
from rallypoint.extensions import NodeSpec, RankAssigner, WaitSource
from rallypoint.interfaces import (
    Assignment,
    CoordinationStore,
    RendezvousFailed,
    RendezvousHandler,
    StoreError,
)
from rallypoint.rendezvous import calls, notices, records
from rallypoint.rendezvous.boards import PaceBoard, WaitBoard
from rallypoint.rendezvous.calls import Steps
from rallypoint.rendezvous.generations import job_behind
from rallypoint.rendezvous.heartbeat import WAKE_SLICE, Heartbeat
from rallypoint.rendezvous.joining import Joining
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.node import NodeState
from rallypoint.rendezvous.readiness import Ready
from rallypoint.rendezvous.retrying import RetryingStore
from rallypoint.rendezvous.settings import Settings
from rallypoint.rendezvous.signing import CLAIM_GRACE, Seal, SignedStore, sealed
from rallypoint.rendezvous.world import REAL, Flag, Strand, World

logger = logging.getLogger("rallypoint.rendezvous")

#: The longest a node hosting the store waits, when it leaves, for the others to leave.
LEAVE_GRACE = 5.0
#: Seconds between two looks at how many have left, where no mark can be waited on.
_LOOK = 0.1


class StoreRendezvous(RendezvousHandler):
    """The protocol's ``RendezvousHandler`` for one node, over any ``CoordinationStore``.

    ``offer``: what this node offers the others in each round it joins (its memory
    checkpoints); every member reads all of them (``Assignment.offers``). ``pace``: this
    node's workers' CPU seconds per step, shared with the round's other nodes on every
    heartbeat (``paces``) and put in the record of each round it joins. ``waits``: its
    hang detection, whose ranks' long waits go to the others, and theirs to it, on the
    heartbeat (``waits``). ``host``: whether
    this process hosts the store, where it lives in an agent; None where it does not.
    ``world``: its clocks, pauses, threads and ports (the simulation's, in the simulation).

    Its store calls go through ``calls.drive`` over the retrying store, but for three, each
    for a reason: the token claim (``_claim_token``: once, before any step, retried as a
    whole); the first renewal of this node's liveness (``_start_heartbeats``: it must exist
    before the first join record, from the heartbeat thread's own connection); and the
    sealed liveness's "gone" mark (``close``). The ``leave`` steps retry for LEAVE_GRACE
    only: leaving rides out a lost reply, not an outage.
    """

    def __init__(
        self,
        store: CoordinationStore,
        run_id: str,
        node: NodeSpec,
        nproc_per_node: int,
        assigner: RankAssigner,
        settings: Settings,
        *,
        master_addr: str | None = None,
        master_port: int | None = None,
        offer: Callable[[], Mapping[str, str]] | None = None,
        pace: Callable[[], float | None] | None = None,
        waits: WaitSource | None = None,
        ready: Ready | None = None,
        token: bytes | None = None,
        host: bool | None = None,
        world: World = REAL,
    ) -> None:
        if not records.usable_id(node.node_id) or not records.usable_host(node.host):
            raise RallypointError(
                f"node id {node.node_id!r} and host {node.host!r}: a rendezvous needs a "
                "non-empty node id, and neither may contain whitespace"
            )
        # Whether this process hosts the store, where the backend's store lives in an agent
        # (``RendezvousBackend.store_in_agent``: c10d, static); None for a store of its own
        # (etcd, Redis, memory), which keeps what is not deleted (``store_handler``).
        self.hosting = host
        self.world = world
        self.signed = SignedStore(store, Seal(token), world=world) if token else None
        self.store = RetryingStore(self.signed or store, settings.retry_timeout, world)
        self.settings = settings
        self.state = NodeState(
            node,
            nproc_per_node,
            settings,
            Keys(settings.prefix, run_id),
            world.monotonic,
            sealed=token is not None,
        )
        self.joining = Joining(
            self.state,
            assigner,
            world.reserve_port,
            master_addr=master_addr,
            master_port=master_port,
            offer=offer,
            pace=pace,
            ready=ready,
        )
        self.board = PaceBoard(node.node_id, pace) if pace is not None else None
        self.waits_board = WaitBoard(node.node_id, waits) if waits is not None else None
        self._stop_heartbeat = world.flag()
        self._wake_heartbeat = world.flag()  # set when joining ends, or to stop
        self._heartbeat: Strand | None = None
        # The heartbeat thread's own connection, opened now rather than inside next_round:
        # torch's TCPStore client does a reverse DNS lookup on every connect, and a slow or
        # dropped lookup (5 s resolver timeout) must not land in the timed join path.
        self._beat_store = self.store.clone()

    @property
    def keys(self) -> Keys:
        return self.state.view.keys

    def _drive(self, steps: Steps[calls.T]) -> calls.T:
        return calls.drive(steps, self.store, world=self.world)

    # --- RendezvousHandler ----------------------------------------------------------------

    def next_round(self) -> Assignment:
        if not self.joining.started:
            self._claim_token()
        try:
            return self._drive(self.joining.next_round(self._start_heartbeats))
        finally:
            self._wake_heartbeat.set()

    def _claim_token(self) -> None:
        """Every node of a job holds the same token, or none: one that differs stops now,
        in a sentence, before it writes anything (``signing``). The attempt's nonce is in
        the claim: every seal of this node's records is bound to it."""
        keys, signed = self.keys, self.signed
        if signed is not None:
            grace = min(CLAIM_GRACE, self.settings.heartbeat_timeout)
            behind = functools.partial(job_behind, signed.store, keys)
            self.store.retry(lambda: signed.claim(keys.token_key, behind, grace))
            return
        raw = self.store.get(keys.token_key)
        if raw is None or not sealed(raw):
            return
        # A claim alone locks nobody out (anyone can write one): a job without a token
        # stops only where the run's records are sealed too.
        if self.store.retry(lambda: job_behind(self.store.store, keys, sealed_only=True)):
            raise RendezvousFailed(
                "the job's nodes seal their rendezvous records with a job token, and this "
                "node has none: give it the same --rdzv-conf token_file or "
                "RALLYPOINT_JOB_TOKEN"
            )
        logger.warning(
            "ignored the job token claim at %r: no record of the run is sealed (a process "
            "that is not of this job wrote it); if the job's other nodes have a token, give "
            "this node the same",
            keys.token_key[:200],
        )

    def nodes_waiting(self) -> int:
        """1 when the job has moved past this node's round (a member left or a node came).

        The heartbeat thread waits on the next round's ``open`` key; this only reads what
        it found, so the agent's monitor loop costs the store nothing.
        """
        if self.state.heartbeat_failed is not None:
            raise self.state.heartbeat_failed
        return 1 if self.state.round_ended() else 0

    def gone(self, node_ids: Sequence[str]) -> list[str]:
        """Those of ``node_ids`` (a round's members) that did not join the round this node
        last waited in: lost, or gone. Read from the joiners' records, so that a store
        whose liveness takes time to read (TCPStore's counters) answers at once."""
        return self._drive(self.joining.gone(node_ids))

    def fail(self, reason: str) -> None:
        """This node's workers failed and its restart policy gave up: the job fails, on
        every node. Without this the others, whose workers were stopped for the round
        this node ended, would see it leave and go on without it as after a node's loss."""
        self._drive(self.joining.fail(reason))

    def paces(self) -> dict[str, float]:
        """The paces of the current round's members (node id -> CPU seconds per step), as
        they last shared them, this node's included; a member that shared none is absent."""
        return self.board.paces(self.state.view.round) if self.board is not None else {}

    def waits(self) -> dict[str, Mapping[str, Any]]:
        """What the current round's other members last shared of their ranks' long waits
        in collectives, as read on this node's last heartbeat that wanted them."""
        board = self.waits_board
        return board.waits(self.state.view.round) if board is not None else {}

    def give_notice(self, step: int) -> int:
        return self._drive(notices.give(self.state, step))

    def noticed(self, proposal: int | None = None) -> int | None:
        return self._drive(notices.read(self.state, proposal))

    def request_new_round(self) -> None:
        """After a local failure: end the round so that every node restarts its workers."""
        self._drive(self.joining.request_new_round())

    def exit_barrier(self, timeout: float) -> None:
        self._drive(self.joining.exit_barrier(timeout))

    def close(self) -> None:
        # Heartbeats stop first: a node counts as gone from here, and no renewal of its
        # liveness key can come after the last node deleted the run's keys.
        if not self._stop_heartbeats():
            self._beat_store.close()  # else the heartbeat thread closes its store as it ends
        if self.signed is not None:
            with contextlib.suppress(StoreError):  # said gone before the last node deletes
                self.signed.end_liveness()
        with contextlib.suppress(StoreError):  # a store that is gone needs telling nothing
            # A blip is ridden out, not an outage: leaving must not wait one out.
            store = RetryingStore(self.store.store, LEAVE_GRACE, self.world)
            calls.drive(leave(self.joining, self.hosting), store, world=self.world)
        self.joining.release_port()
        self.store.close()

    # --- the heartbeat thread -------------------------------------------------------------

    def _start_heartbeats(self) -> None:
        """Keep this node alive from its first join until ``close``."""
        # Alive before the first join record: a node that reads the record while the
        # thread has yet to beat would take this run for abandoned (``generations``).
        self._beat_store.keep_alive(
            self.keys.heartbeat(self.state.node_id), self.settings.heartbeat_timeout
        )
        self.state.renewed()
        stop = self._stop_heartbeat = self.world.flag()
        store = self._beat_store
        self._heartbeat = self.world.start(
            lambda: self._beat(store, stop), f"rallypoint heartbeat {self.state.node_id}"
        )

    def _beat(self, store: CoordinationStore, stop: Flag) -> None:
        boards = tuple(b for b in (self.board, self.waits_board) if b is not None)
        heartbeat = Heartbeat(self.state, boards)
        try:
            calls.drive(heartbeat.run(stop.is_set), store, self._wake_heartbeat, self.world)
        except StoreError as error:
            if not stop.is_set():
                self.state.heartbeat_failed = error
        finally:
            store.close()

    def _stop_heartbeats(self) -> bool:
        """Stop the heartbeat thread; whether it was running (it then closes its store)."""
        self._stop_heartbeat.set()
        self._wake_heartbeat.set()
        thread, self._heartbeat = self._heartbeat, None
        if thread is None:
            return False
        thread.join(WAKE_SLICE + 1)  # a store call may hold it longer: it ends on its own
        return True


def leave(joining: Joining, hosting: bool | None) -> Steps[None]:
    """Say that this node leaves; a cleanly finished run's keys are deleted by the node
    that finds every member's mark written: the last to leave, as the count says, or the
    round's group rank 0. A node whose process hosts the store (c10d, static) takes the
    store with it, so it first waits, at most LEAVE_GRACE seconds, for the other nodes of
    its last round to leave: they may still have to read how the round ended (a leader's
    error, the exit barrier)."""
    view = joining.node.view
    round_, keys, record = view.last_joined, view.keys, view.record
    if round_ is None:
        return
    count = yield from calls.add(keys.of_round(round_, "left"), 1)  # a hint: see below
    members = record.node_ids if record is not None and record.round == round_ else ()
    if members and joining.rank is not None:
        # The mark last: once every member's is written, none of them writes here again.
        mark = keys.of_round(round_, "left", joining.rank)
        yield from calls.set_(mark, b"1")
        if hosting is None and (yield from calls.get(keys.of_round(round_, "closed"))) is None:
            # The last to leave deleted the run after a first write of this mark whose
            # reply was lost; its retry wrote the mark again: take it back.
            yield from calls.delete_prefix(mark)
    marks = [keys.of_round(round_, "left", g) for g in range(len(members))]
    if hosting is None:  # a store of its own (etcd, Redis): it keeps what is not deleted
        # The count says who looks at the marks: the last to leave. A stray can add to a
        # count (then a node looks early, and waits) or take from it (then nobody would
        # look): group rank 0 looks whatever the count says.
        last = count >= len(members) or joining.rank == 0
        cleaner = joining.finished == round_ and members and last
        if cleaner and (yield from calls.wait(marks, LEAVE_GRACE)):
            yield from delete_run(keys)
        return
    if not hosting:
        return
    if members:
        yield from calls.wait(marks, LEAVE_GRACE)
        return
    # Left while joining: the round's members are not known; the counts, capped, are all.
    joined = min(
        (yield from calls.add(keys.of_round(round_, "joined"), 0)), joining.settings.most_joins
    )
    for _ in range(int(LEAVE_GRACE / _LOOK)):
        if (yield from calls.add(keys.of_round(round_, "left"), 0)) >= joined:
            return
        yield from calls.pause(_LOOK)


def delete_run(keys: Keys) -> Steps[None]:
    """The run finished cleanly (every member passed the exit barrier) and every member
    has left: nobody reads the run's keys any more, so delete them all, every generation's
    and the run's own (its generation markers, its token claim).

    Only then: after a failure, a timeout or a signal a node may still come back and need
    the state. A store whose host is an agent (c10d, static) needs no cleaning: it ends
    with that agent."""
    deleted = 0
    for prefix in keys.prefixes:
        deleted += yield from calls.delete_prefix(prefix)
    logger.debug("deleted the %d keys of the finished run %s", deleted, keys.run_id)

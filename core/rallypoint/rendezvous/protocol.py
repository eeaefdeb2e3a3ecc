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
* ``r/done/<i>`` - the exit barrier.
* ``hb/<node id>`` - the node's liveness, kept by ``keep_alive`` every
  ``heartbeat_timeout / 3`` (a counter on TCPStore, a lease on etcd, a TTL on Redis); each
  member watches the next one in rank order (a ring), so liveness costs O(N) in all.

Every node does a constant number of operations per round, and the leader reads the N
records in one request: the store sees O(N) operations per round, not O(N^2). An
unreachable store (``StoreUnavailable``) is retried with backoff for ``retry_timeout``
seconds; running workers are not touched meanwhile. A node that could not reach the store
for longer than ``heartbeat_timeout`` (the others may not have been able to renew their
liveness either) takes no node for dead during the next ``heartbeat_timeout``.

When every member of the last round passed the exit barrier, the last one to leave deletes
everything under ``<prefix>/<run id>/`` (``delete_prefix``): a finished run leaves nothing
in the store. A run that did not finish cleanly keeps its keys: a node may come back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rallypoint.errors import RallypointError, UsageError
from rallypoint.events import RoundInfo
from rallypoint.extensions import (
    COMMON_RENDEZVOUS_OPTIONS,
    DEFAULT_PREFIX,
    NodeSpec,
    RankAssigner,
)
from rallypoint.interfaces import Assignment, CoordinationStore, StoreError
from rallypoint.registry import RANK_ASSIGNERS, describe, plugin_failure
from rallypoint.rendezvous import records
from rallypoint.rendezvous.ports import PortReservation
from rallypoint.rendezvous.retrying import RetryingStore

logger = logging.getLogger("rallypoint.rendezvous")

#: Seconds between "who has joined" lines while a node waits in a rendezvous.
PROGRESS_INTERVAL = 5.0
#: The longest the heartbeat thread blocks in one store call while a round runs; it bounds
#: how long closing the handler waits for the thread.
WAKE_SLICE = 0.5
#: The longest a node hosting the store waits, when it leaves, for the others to leave.
LEAVE_GRACE = 5.0
#: For how many heartbeat_timeouts after a stall a node checks whether the run was started
#: afresh without it (``_superseded``): a newcomer that read its lapsed liveness may move
#: the generation a little after the stall ended.
STALL_WATCH = 3


class RendezvousTimeout(RallypointError):
    """Not enough nodes joined in time."""


class RendezvousFailed(RallypointError):
    """The round's leader could not form it; the message is its reason."""


class _LeaderLost(Exception):
    """The round being formed was ended before it closed: its leader died, or another node
    ended it (having found the leader dead); this node goes on to the next round."""


@dataclass(frozen=True)
class Settings:
    """The protocol's ``--rdzv-conf`` values (``COMMON_RENDEZVOUS_OPTIONS``, whose defaults
    are the only ones) and the job's size."""

    min_nodes: int
    max_nodes: int
    join_timeout: float
    last_call_timeout: float
    close_timeout: float
    heartbeat_timeout: float
    retry_timeout: float
    prefix: str = DEFAULT_PREFIX

    @classmethod
    def from_conf(cls, min_nodes: int, max_nodes: int, conf: Mapping[str, Any]) -> Settings:
        """From a backend's parsed options; a key the backend does not declare takes the
        protocol's default."""
        values = {
            option.name: float(conf.get(option.name, option.default))
            for option in COMMON_RENDEZVOUS_OPTIONS
        }
        return cls(min_nodes, max_nodes, **values, prefix=str(conf.get("prefix") or DEFAULT_PREFIX))


class Keys:
    """Where a run keeps what, under ``<prefix>/<run id>/`` (generation 0), or
    ``<prefix>/<run id>~<generation>/`` once the run id was started afresh after every
    agent of it had gone (``~`` is in no run id, so no other job's keys look alike)."""

    def __init__(self, prefix: str, run_id: str, generation: int = 0) -> None:
        self.prefix = prefix
        self.run_id = run_id  # written into every node and round record
        base = f"{prefix.rstrip('/')}/{run_id}"
        self.generation = generation
        self.root = f"{base}/" if generation == 0 else f"{base}~{generation}/"
        #: The run's current generation (absent: 0), outside every generation's keys.
        self.generation_key = f"{base}~generation"
        #: Every key of the run, all generations, starts with one of these.
        self.prefixes = (f"{base}/", f"{base}~")

    def at(self, generation: int) -> Keys:
        """The same run's keys in ``generation``."""
        return Keys(self.prefix, self.run_id, generation)

    def state(self) -> str:
        return self.root + "state"

    def failed(self) -> str:
        return self.root + "failed"

    def of_round(self, round_: int, *parts: object) -> str:
        return self.root + "/".join(str(p) for p in (round_, *parts))

    def heartbeat(self, node_id: str) -> str:
        return self.root + f"hb/{node_id}"


class StoreRendezvous:
    """A ``RendezvousHandler`` for one node, over any ``CoordinationStore``."""

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
    ) -> None:
        if not records.usable_id(node.node_id) or not records.usable_host(node.host):
            raise RallypointError(
                f"node id {node.node_id!r} and host {node.host!r}: a rendezvous needs a "
                "non-empty node id, and neither may contain whitespace"
            )
        self.store = RetryingStore(store, settings.retry_timeout)
        self.keys = Keys(settings.prefix, run_id)
        self.node = node
        self.nproc = nproc_per_node
        self.assigner = assigner
        self.settings = settings
        #: Set by the agent: what this node offers the others in each round it joins
        #: (``NodeRecord.offer``); every member reads all of them (``Assignment.offers``).
        self.offer: Callable[[], Mapping[str, str]] | None = None
        #: Set by the agent: this node's pace (its workers' CPU seconds per step), shared
        #: with the round's other nodes on every heartbeat (``paces``), and put in the
        #: record of each round it joins (``NodeSpec.pace``).
        self.pace: Callable[[], float | None] | None = None
        self._paces: dict[str, float] = {}
        low, high = settings.min_nodes, settings.max_nodes
        self._nnodes = str(low) if low == high else f"{low}:{high}"  # as --nnodes says it
        # Given (the static backend), else group rank 0's host and a free port it holds.
        self.master_addr = master_addr
        self.master_port = master_port
        self.round: int | None = None
        self.rank: int | None = None
        self.record: records.RoundRecord | None = None
        self._last_joined: int | None = None
        self._port: PortReservation | None = None
        self._stop_heartbeat = threading.Event()
        self._wake_heartbeat = threading.Event()  # set when joining ends, or to stop
        self._heartbeat: threading.Thread | None = None
        self._heartbeat_error: StoreError | None = None
        self._watch: tuple[int, str, str, int] | None = None  # round, node, host, size
        self._round_ended = -1  # the newest round the heartbeat thread saw end
        # Until then (monotonic), no node counts as dead: this node could not reach the
        # store for longer than heartbeat_timeout, so neither, maybe, could the others.
        self._grace_until = 0.0
        self._stalled_at = -float("inf")  # when this node last came back from a stall
        self._finished: int | None = None  # the round whose exit barrier every member passed
        # As the leader of a new job's round: the round and when its last call ends.
        self._last_call: tuple[int, float] | None = None
        # The join deadline while next_round waits (written by next_round only).
        self._joining: float | None = None
        # The heartbeat thread's own connection, opened now rather than inside next_round:
        # torch's TCPStore client does a reverse DNS lookup on every connect, and a slow or
        # dropped lookup (5 s resolver timeout) must not land in the timed join path.
        self._beat_store = self.store.clone()

    # --- state ----------------------------------------------------------------------------

    def _state(self) -> int:
        """The job's round (one read): 0 while the state key is absent. A new job writes
        nothing here until its first round ends: when a thousand nodes start at once, none
        of them has to create the key (a write, which on etcd goes through Raft)."""
        return records.decode_state(self.keys.state(), self.store.get(self.keys.state()))

    def _advance(
        self, from_round: int, expected: int, store: CoordinationStore | None = None
    ) -> None:
        """End round ``from_round`` for every node (unless another node already did).

        ``expected`` is how many nodes the next round should wait for before closing; it is
        written before the round changes, so the next leader always finds it.
        """
        store = store or self.store
        keys = self.keys
        store.compare_set(keys.of_round(from_round + 1, "expected"), None, _int(expected))
        following = _int(from_round + 1)
        if from_round > 0:
            store.compare_set(keys.state(), _int(from_round), following)
        elif store.compare_set(keys.state(), None, following) == _int(0):
            store.compare_set(keys.state(), _int(0), following)  # round 0, written out
        # Only an opened round may close: a node that came to a full job waits for this.
        store.set(keys.of_round(from_round + 1, "open"), b"1")

    # --- RendezvousHandler ----------------------------------------------------------------

    def next_round(self) -> Assignment:
        self._watch = None  # the previous round's ring no longer applies
        deadline = time.monotonic() + self.settings.join_timeout
        self._joining = deadline
        if self.round is None and self._heartbeat is None:
            self.keys = settle_generation(self.store, self.keys, self._alive_key, self._nnodes)
        elif self.round is not None and not self._follow_generation():
            self._check_failed()  # a later round: did a node fail the job meanwhile?
        self._start_heartbeats()
        # The round after this node's last (or 0): joining it also reads the job's round,
        # and moves on to that one if the job is further on.
        round_ = (self.round + 1) if self.round is not None else 0
        try:
            while True:
                try:
                    record = self._join(round_, deadline)
                except _LeaderLost:
                    if self._follow_generation():
                        round_ = 0
                    else:
                        round_ = max((self._last_joined or 0) + 1, self._state())
                    continue
                if self.node.node_id in record.node_ids:
                    return self._assignment(record)
                # Too late for this round: ask for a new one if there is room, else wait.
                round_ = record.round
                running = len(record.node_ids)
                if running < self.settings.max_nodes:
                    self._advance(round_, running + 1)
                round_ += 1
        finally:
            self._joining = None
            self._wake_heartbeat.set()

    def nodes_waiting(self) -> int:
        """1 when the job has moved past this node's round (a member left or a node came).

        The heartbeat thread waits on the next round's ``open`` key; this only reads what
        it found, so the agent's monitor loop costs the store nothing.
        """
        if self._heartbeat_error is not None:
            raise self._heartbeat_error
        if self.round is None:
            return 0
        return 1 if self._round_ended >= self.round else 0

    def gone(self, node_ids: Sequence[str]) -> list[str]:
        """Those of ``node_ids`` (a round's members) that did not join the round this node
        last waited in: lost, or gone. Read from the joiners' records, so that a store
        whose liveness takes time to read (TCPStore's counters) answers at once."""
        round_ = self._last_joined
        if round_ is None:
            return []
        count = self.store.add(self.keys.of_round(round_, "joined"), 0)
        keys = [self.keys.of_round(round_, "node", i) for i in range(1, count + 1)]
        joined = {
            node.node_id
            for key, raw in zip(keys, self.store.get_many(keys) if keys else [], strict=True)
            if (node := _node_or_none(key, raw)) is not None
        }
        return [node for node in node_ids if node not in joined and node != self.node.node_id]

    def fail(self, reason: str) -> None:
        """This node's workers failed and its restart policy gave up: the job fails, on
        every node. Without this the others, whose workers were stopped for the round
        this node ended, would see it leave and go on without it as after a node's loss."""
        record = json.dumps({"node": self.node.node_id, "reason": reason}).encode()
        with contextlib.suppress(StoreError):  # leaving tells the others it went, at least
            self.store.set(self.keys.failed(), record)

    def _check_failed(self) -> None:
        """Stop when another node failed the job (``fail``)."""
        raw = self.store.get(self.keys.failed())
        if raw is None:
            return
        try:
            data = json.loads(raw)
            node, reason = str(data["node"]), str(data["reason"])
        except (ValueError, KeyError, TypeError):
            node, reason = "?", raw.decode("utf-8", "replace")[:200]
        raise RendezvousFailed(f"the job failed on node {node}: {reason}")

    def request_new_round(self) -> None:
        """After a local failure: end the round so that every node restarts its workers."""
        if self.round is not None and self.record is not None:
            self._advance(self.round, len(self.record.node_ids))

    def exit_barrier(self, timeout: float) -> None:
        if self.round is None or self.record is None:
            return
        done = self.store.add(self.keys.of_round(self.round, "done"), 1)
        self.store.set(self.keys.of_round(self.round, "done", done), b"1")
        self._watch = None  # finished nodes stop beating at different times
        last = self.keys.of_round(self.round, "done", len(self.record.node_ids))
        deadline = time.monotonic() + timeout
        slice_ = self.settings.heartbeat_timeout / 3
        while not self.store.wait([last], max(0.0, min(slice_, deadline - time.monotonic()))):
            if self._ended(self.round):
                # The others went on without this node (they took it for gone while it
                # finished): they will not pass this round's barrier; waiting is for nothing.
                logger.warning(
                    "exit barrier: the job went on to a later round without this node; "
                    "not waiting for the others"
                )
                return
            if time.monotonic() >= deadline:
                logger.warning("exit barrier: not every node finished within %.0f s", timeout)
                return
        self._finished = self.round

    def close(self) -> None:
        # Heartbeats stop first: a node counts as gone from here, and no renewal of its
        # liveness key can come after the last node deleted the run's keys.
        if not self._stop_heartbeats():
            self._beat_store.close()  # else the heartbeat thread closes its store as it ends
        with contextlib.suppress(StoreError):  # a store that is gone needs telling nothing
            self._leave()
        if self._port is not None:
            self._port.release()
            self._port = None
        self.store.close()

    # --- joining --------------------------------------------------------------------------

    def _leave(self) -> None:
        """Say that this node leaves; the last to leave a cleanly finished run deletes its
        keys. A node whose process hosts the store (c10d, static) takes the store with it,
        so it first waits, at most LEAVE_GRACE seconds, for the other nodes of its last
        round to leave: they may still have to read how the round ended (a leader's error,
        the exit barrier)."""
        round_ = self._last_joined
        if round_ is None:
            return
        store = self.store.store  # no retries: leaving must not wait out an outage
        left = store.add(self.keys.of_round(round_, "left"), 1)
        store.set(self.keys.of_round(round_, "left", left), b"1")
        hosting = getattr(store, "hosting", None)
        if hosting is None:  # a store of its own (etcd, Redis): it keeps what is not deleted
            record = self.record
            if self._finished == round_ and record and left >= len(record.node_ids):
                # The others counted themselves out first, but may not have written their
                # marker yet: a marker written after the delete would stay.
                markers = [self.keys.of_round(round_, "left", i) for i in range(1, left)]
                store.wait(markers, LEAVE_GRACE)
                self._delete_run(store)
            return
        if not hosting:
            return
        if self.record is not None and self.record.round == round_:
            nodes = len(self.record.node_ids)
        else:
            nodes = store.add(self.keys.of_round(round_, "joined"), 0)
        if nodes > left:
            store.wait([self.keys.of_round(round_, "left", nodes)], LEAVE_GRACE)

    def _delete_run(self, store: CoordinationStore) -> None:
        """The run finished cleanly (every member passed the exit barrier) and this node
        left last: nobody reads the run's keys any more, so delete them all.

        Only then: after a failure, a timeout or a signal a node may still come back and
        need the state. A store whose host is an agent (c10d, static) needs no cleaning:
        it ends with that agent."""
        delete = getattr(store, "delete_prefix", None)
        if delete is None:  # a store written before the interface had it
            logger.warning(
                "the rendezvous store has no delete_prefix: the keys under %s stay",
                self.keys.root,
            )
            return
        deleted = delete(self.keys.root)
        if self.keys.generation:
            delete(self.keys.generation_key)  # a key of its own: the run leaves nothing
        logger.debug("deleted the %d keys of the finished run under %s", deleted, self.keys.root)

    def _join(self, round_: int, deadline: float) -> records.RoundRecord:
        """Join ``round_``; return its record (without this node if it came too late)."""
        self._port = self._reserve_port()
        self._last_joined = round_
        index, state = self.store.add_and_get(
            self.keys.of_round(round_, "joined"), 1, self.keys.state()
        )
        ahead = records.decode_state(self.keys.state(), state)
        if ahead > round_:
            # The job is further on: round_ has ended. The number taken there is void (an
            # empty record, which a leader still closing round_ skips without waiting);
            # join the job's round.
            self.store.set(self.keys.of_round(round_, "node", index), b"")
            round_ = self._last_joined = ahead
            index = self.store.add(self.keys.of_round(round_, "joined"), 1)
        mine = records.NodeRecord(
            node_id=self.node.node_id,
            host=self.node.host,
            nproc=self.nproc,
            port=self._port.port,
            labels=dict(self.node.labels),
            previous_rank=self.rank,
            run_id=self.keys.run_id,
            nnodes=self._nnodes,
            offer=dict(self.offer()) if self.offer is not None else {},
            pace=self.pace() if self.pace is not None else None,
        )
        self.store.set(self.keys.of_round(round_, "node", index), records.encode(mine))
        if index == 1:
            return self._lead(round_, deadline)
        return self._wait_closed(round_, deadline)

    def _wait_closed(self, round_: int, deadline: float) -> records.RoundRecord:
        """The record of ``round_`` once its leader closed it (one read, which the wait
        answers); if the leader dies first (it stopped keeping itself alive), end the
        round so that the others form the next one."""
        s = self.settings
        closed_key = self.keys.of_round(round_, "closed")
        leader: str | None = None
        began = time.monotonic()
        while True:
            slice_ = min(s.heartbeat_timeout / 3, max(0.0, deadline - time.monotonic()))
            raw = self.store.wait_value(closed_key, slice_)
            if raw is not None:
                record = records.decode_round(closed_key, raw)
                if record.error:
                    raise RendezvousFailed(record.error)
                return record
            self._note_stall(began)
            began = time.monotonic()
            if time.monotonic() >= deadline:
                raise RendezvousTimeout(
                    f"rendezvous round {round_}: fewer than {s.min_nodes} nodes joined "
                    f"within join_timeout={s.join_timeout:g} s"
                )
            if self._ended(round_):
                raise _LeaderLost()  # another node ended it: its leader is gone
            if leader is None:
                key = self.keys.of_round(round_, "node", 1)
                raw = self.store.get(key)
                leader = records.decode_node(key, raw).node_id if raw else None
            if leader and not self._alive(self.store, leader):
                logger.warning(
                    "node %s, leading rendezvous round %d, died before closing it: "
                    "starting round %d",
                    leader,
                    round_,
                    round_ + 1,
                )
                self._advance(round_, 0)
                raise _LeaderLost()

    def _reserve_port(self) -> PortReservation:
        """This round's master port, held until the next round: a free one, taken while the
        previous is still held so that attempts never share a port; or the fixed one."""
        previous, self._port = self._port, None
        if self.master_port and previous is not None:
            previous.release()  # the same port again: let go of it first
            previous = None
        try:
            return PortReservation(self.master_port or 0)
        except OSError as error:
            raise RallypointError(
                f"--master-port {self.master_port}: cannot use it on this host "
                f"({error.strerror}); choose another port or leave --master-port out to get a free one."
            ) from None
        finally:
            if previous is not None:
                previous.release()

    def _lead(self, round_: int, deadline: float) -> records.RoundRecord:
        """As the first joiner: wait for enough nodes, then close the round; its record."""
        s = self.settings
        keys = self.keys
        before = self._previous(round_)
        running = before.node_ids if before is not None else ()
        if round_ > 0 and not self._wait_leading(
            round_, keys.of_round(round_, "open"), deadline, running
        ):
            raise RendezvousTimeout(
                f"rendezvous round {round_}: the job kept running with its {s.max_nodes} nodes "
                f"(the maximum) for join_timeout={s.join_timeout:g} s; this node was not needed"
            )
        need = keys.of_round(round_, "node", s.min_nodes)
        if not self._wait_leading(round_, need, deadline):
            raise RendezvousTimeout(
                f"rendezvous round {round_}: fewer than {s.min_nodes} nodes joined within "
                f"join_timeout={s.join_timeout:g} s"
            )
        # No record of the previous round: its leader died before closing it (or this is
        # the first round): form this one as a new job.
        previous = self._previous(round_)
        if previous is None:
            # A new job: last call for more nodes, closing at once when MAX are in.
            self._last_call = (round_, time.monotonic() + s.last_call_timeout)
            self.store.wait([keys.of_round(round_, "node", s.max_nodes)], s.last_call_timeout)
            count = min(self.store.add(keys.of_round(round_, "joined"), 0), s.max_nodes)
            nodes = self._joined(round_, count)
        else:
            nodes = self._wait_for_survivors(round_, previous)
        if self._ended(round_) or not nodes:
            # While this node could not reach the store, the others took it for dead and
            # moved on (the round ended, or every join record of it expired): closing this
            # round would start workers nobody joins.
            raise _LeaderLost()
        try:
            record = self._form(round_, nodes)
        except RallypointError as error:
            failed = records.RoundRecord(
                round_, (), (), (), "", 0, error=str(error), run_id=keys.run_id
            )
            self.store.set(keys.of_round(round_, "closed"), records.encode(failed))
            raise
        self.store.set(keys.of_round(round_, "closed"), records.encode(record))
        return record

    def _wait_leading(
        self, round_: int, key: str, deadline: float, running: tuple[str, ...] = ()
    ) -> bool:
        """As the leader of ``round_``: wait for ``key`` until ``deadline``, and give the
        round up (``_LeaderLost``) if the others ended it meanwhile, taking this node for
        dead (it could not reach the store for longer than heartbeat_timeout).

        ``running``: the members of the full round this one waits to follow; when none
        of them is alive any more (a job whose agents were all killed, run again before
        their liveness lapsed), nobody is left to end that round: this node ends it."""
        while True:
            left = deadline - time.monotonic()
            if self.store.wait([key], max(0.0, min(left, self.settings.heartbeat_timeout / 3))):
                return True
            if left <= self.settings.heartbeat_timeout / 3:
                return False
            if self._ended(round_):
                raise _LeaderLost()
            if running and not any(self._alive(self.store, node) for node in running):
                logger.info(
                    "rendezvous round %d: no member of the round before it is alive: "
                    "starting it without them",
                    round_,
                )
                self._advance(round_ - 1, 0)
                running = ()

    def _ended(self, round_: int) -> bool:
        """Whether the job has moved past ``round_`` (one read of the state), or the run
        was started afresh without this node (one more read, after this node stalled)."""
        return self._state() > round_ or self._superseded(self.store)

    def _superseded(self, store: CoordinationStore) -> bool:
        return self._newer_generation(store) is not None

    def _newer_generation(self, store: CoordinationStore) -> Keys | None:
        """The run's keys in its current generation if a node took this one's generation
        for dead (no agent of it alive) and started the next, else None. Only a node whose
        liveness lapsed can be left behind so, that is one that stalled: the key is read
        only within STALL_WATCH heartbeat_timeouts of a stall."""
        if time.monotonic() - self._stalled_at > STALL_WATCH * self.settings.heartbeat_timeout:
            return None
        current = current_generation(store, self.keys)
        return current if current.generation > self.keys.generation else None

    def _follow_generation(self) -> bool:
        """Move to the run's current generation if it left this node's behind (see
        ``settle_generation``): this node then joins it as a new node, at round 0."""
        current = self._newer_generation(self.store)
        if current is None:
            return False
        logger.warning(
            "run %s was started afresh while this node could not reach the rendezvous "
            "store: joining it as a new node",
            self.keys.run_id,
        )
        left, self.keys = self.keys, current
        # Alive in the new generation before its first join record there, as a node is
        # before its first join (``_start_heartbeats``): the heartbeat thread renews only
        # every heartbeat_timeout / 3, and a member that read the record first would take
        # this node for gone.
        self.store.keep_alive(
            self.keys.heartbeat(self.node.node_id), self.settings.heartbeat_timeout
        )
        # The node that moved the run on deleted the old keys; what this node wrote there
        # since (a join, a counter read) is nobody's: delete it too.
        self.store.delete_prefix(left.root)
        self.round = self.record = self._last_joined = self._finished = self._last_call = None
        self._round_ended = -1
        return True

    def _alive(self, store: CoordinationStore, node_id: str) -> bool:
        """Whether ``node_id`` keeps itself alive; every node counts as alive while this one
        has just come back from a store outage (see ``_note_stall``)."""
        return self._alive_key(store, self.keys.heartbeat(node_id))

    def _alive_key(self, store: CoordinationStore, key: str) -> bool:
        if time.monotonic() < self._grace_until:
            return True
        return store.alive(key, self.settings.heartbeat_timeout)

    def _note_stall(self, since: float) -> None:
        """A store call of this node, begun at ``since``, only came back now: if that took
        longer than heartbeat_timeout, the store was out of reach (frozen, restarting, cut
        off from this node) or this host stalled. The other nodes may have been unable to
        renew their liveness meanwhile too: none counts as dead for the next
        heartbeat_timeout, time enough for each to renew it."""
        now = time.monotonic()
        ttl = self.settings.heartbeat_timeout
        if now - since <= ttl:
            return
        self._stalled_at = now
        if now >= self._grace_until:
            logger.warning(
                "this node could not reach the rendezvous store for %.1f s: no node counts "
                "as dead for the next %g s (heartbeat_timeout), while each renews its liveness",
                now - since,
                ttl,
            )
        self._grace_until = max(self._grace_until, now + ttl)

    def _previous(self, round_: int) -> records.RoundRecord | None:
        if round_ == 0:
            return None
        key = self.keys.of_round(round_ - 1, "closed")
        raw = self.store.get(key)
        record = records.decode_round(key, raw) if raw else None
        return record if record and not record.error else None

    def _form(self, round_: int, nodes: list[records.NodeRecord]) -> records.RoundRecord:
        """Order the joiners by the rank assigner's ranks."""
        specs = [
            NodeSpec(
                n.node_id, host=n.host, labels=n.labels, previous_rank=n.previous_rank, pace=n.pace
            )
            for n in nodes
        ]
        who = describe(RANK_ASSIGNERS, self.assigner)
        try:
            ranks = list(self.assigner.assign(specs))
        except RallypointError:  # a deliberate sentence (the static backend's own ranks)
            raise
        except Exception as error:  # a plugin's: the round fails, for every node, in a sentence
            outcome = "the round cannot form, and the job stops on every node"
            failure = plugin_failure(who, "assign", error, outcome)
            raise RendezvousFailed(f"rendezvous round {round_}: {failure}") from None
        if sorted(ranks) != list(range(len(nodes))):
            raise RendezvousFailed(
                f"rendezvous round {round_}: {who} returned {ranks} for {len(nodes)} "
                f"nodes; it must return each of 0..{len(nodes) - 1} once"
            )
        ordered = [node for _, node in sorted(zip(ranks, nodes, strict=True), key=lambda p: p[0])]
        return records.RoundRecord(
            round=round_,
            node_ids=tuple(n.node_id for n in ordered),
            hosts=tuple(n.host for n in ordered),
            nprocs=tuple(n.nproc for n in ordered),
            master_addr=self.master_addr or ordered[0].host,
            master_port=ordered[0].port,
            run_id=self.keys.run_id,
            offers=tuple(n.offer for n in ordered) if any(n.offer for n in ordered) else (),
        )

    def _joined(self, round_: int, count: int, start: int = 1) -> list[records.NodeRecord]:
        """The records of joiners ``start..count``, in one read once they are all written.

        A join number without a record after close_timeout is left out: its node died
        between taking the number and writing the record, or a retried ``add`` after a
        lost reply counted one join twice. The round goes on without it.
        """
        keys = [self.keys.of_round(round_, "node", i) for i in range(start, count + 1)]
        if not keys:
            return []
        complete = self.store.wait(keys, self.settings.close_timeout)
        values = self.store.get_many(keys)
        if not complete:
            logger.warning(
                "rendezvous round %d: %d of join numbers %d..%d have no record after "
                "close_timeout=%g s; closing without them",
                round_,
                sum(v is None for v in values),
                start,
                count,
                self.settings.close_timeout,
            )
        return _usable_joiners(round_, keys, values)

    def _wait_for_survivors(
        self, round_: int, previous: records.RoundRecord
    ) -> list[records.NodeRecord]:
        """A re-formed round closes once every live member of the last one is back (and the
        newcomers it expects), without waiting out the last call for nodes that died.

        Joins are awaited on the store (event-driven); between them the leader asks the
        store, every heartbeat_timeout / 3, whether the members still missing are alive.
        """
        s = self.settings
        keys = self.keys
        raw = self.store.get(keys.of_round(round_, "expected"))
        expected = records.decode_int(keys.of_round(round_, "expected"), raw) if raw else 0
        newcomers = max(0, expected - len(previous.node_ids))
        nodes: list[records.NodeRecord] = []
        read = 0  # join numbers read so far: each record is read once
        end = time.monotonic() + s.last_call_timeout
        while True:
            count = min(self.store.add(keys.of_round(round_, "joined"), 0), s.max_nodes)
            nodes += self._joined(round_, count, start=read + 1)
            read = max(read, count)
            if count >= s.max_nodes or time.monotonic() >= end:
                return nodes
            joined = {n.node_id for n in nodes}
            missing = [
                node_id
                for node_id in previous.node_ids
                if node_id not in joined and self._alive(self.store, node_id)
            ]
            back = sum(1 for node_id in previous.node_ids if node_id in joined)
            if not missing and count >= max(s.min_nodes, min(s.max_nodes, back + newcomers)):
                return nodes
            slice_ = min(s.heartbeat_timeout / 3, max(0.0, end - time.monotonic()))
            began = time.monotonic()
            self.store.wait([keys.of_round(round_, "node", count + 1)], slice_)
            self._note_stall(began)

    def _assignment(self, record: records.RoundRecord) -> Assignment:
        self.round = record.round
        self.record = record
        self._paces = {}  # the last round's: shared again in this one
        self.rank = record.node_ids.index(self.node.node_id)
        if self.rank != 0 and self._port is not None:
            self._port.release()  # only group rank 0's port is used
            self._port = None
        size = len(record.node_ids)
        info = RoundInfo(
            round=record.round,
            group_rank=self.rank,
            group_world_size=size,
            world_size=sum(record.nprocs),
            master_addr=record.master_addr,
            master_port=record.master_port,
            members=record.node_ids,
        )
        if size > 1:
            neighbour = (self.rank + 1) % size
            self._watch = (record.round, record.node_ids[neighbour], record.hosts[neighbour], size)
        return Assignment(info, record.nprocs, record.offers)

    # --- liveness -------------------------------------------------------------------------

    def _start_heartbeats(self) -> None:
        """Keep this node alive from its first join until ``close``."""
        if self._heartbeat is not None:
            return
        # Alive before the first join record: a node that reads the record while the
        # thread has yet to beat would take this run for abandoned (``settle_generation``).
        self._beat_store.keep_alive(
            self.keys.heartbeat(self.node.node_id), self.settings.heartbeat_timeout
        )
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, args=(self._beat_store, self._stop_heartbeat), daemon=True
        )
        self._heartbeat.start()

    def _stop_heartbeats(self) -> bool:
        """Stop the heartbeat thread; whether it was running (it then closes its store)."""
        self._stop_heartbeat.set()
        self._wake_heartbeat.set()
        thread, self._heartbeat = self._heartbeat, None
        if thread is None:
            return False
        thread.join(WAKE_SLICE + 1)  # a store call may hold it longer: it ends on its own
        return True

    def _beat(self, store: CoordinationStore, stop: threading.Event) -> None:
        """The heartbeat thread: keep this node alive every heartbeat_timeout / 3; while
        joining, print progress; in a round, watch the next member (a ring) and wait for
        the round to end (the next round's ``open`` key), so that ``nodes_waiting`` is a
        read of memory."""
        ttl = self.settings.heartbeat_timeout
        next_beat = 0.0
        kept: float | None = None  # when this node last renewed its liveness
        progress: tuple[float, float] | None = None  # (join deadline, next progress line)
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    store.keep_alive(self.keys.heartbeat(self.node.node_id), ttl)
                    if kept is not None:
                        self._note_stall(kept)
                    kept = time.monotonic()
                    round_ = self.round
                    if round_ is not None and self._joining is None and self._superseded(store):
                        self._round_ended = max(self._round_ended, round_)  # leave the round
                    self._check_neighbour(store)
                    self._share_pace(store)
                    next_beat = now + ttl / 3
                joining = self._joining
                if joining is None:
                    progress = None
                elif progress is None or progress[0] != joining:
                    progress = (joining, now + PROGRESS_INTERVAL)
                elif now >= progress[1]:
                    progress = (joining, now + PROGRESS_INTERVAL)
                    self._report_progress(store, joining)
                until_beat = max(0.0, next_beat - time.monotonic())
                round_ = self.round
                if joining is None and round_ is not None and self._round_ended < round_:
                    key = self.keys.of_round(round_ + 1, "open")
                    if store.wait([key], min(until_beat, WAKE_SLICE)):
                        self._round_ended = max(self._round_ended, round_)
                else:
                    until = until_beat
                    if progress is not None:
                        until = min(until, max(0.0, progress[1] - time.monotonic()))
                    self._wake_heartbeat.wait(until)
                    self._wake_heartbeat.clear()
        except StoreError as error:
            if not stop.is_set():
                self._heartbeat_error = error
        finally:
            store.close()

    def paces(self) -> dict[str, float]:
        """The paces of the current round's members (node id -> CPU seconds per step), as
        they last shared them, this node's included; a member that shared none is absent."""
        return dict(self._paces)

    def _share_pace(self, store: CoordinationStore) -> None:
        """On a heartbeat in a round: write this node's pace, read the members'."""
        round_, record = self.round, self.record
        if self.pace is None or round_ is None or record is None or self._joining is not None:
            return
        pace = self.pace()
        if pace is not None:
            store.set(self.keys.of_round(round_, "pace", self.node.node_id), str(pace).encode())
        keys = [self.keys.of_round(round_, "pace", node) for node in record.node_ids]
        paces = {}
        for node, raw in zip(record.node_ids, store.get_many(keys), strict=True):
            with contextlib.suppress(ValueError, TypeError):
                if raw is not None:
                    paces[node] = float(raw)
        self._paces = paces

    def _check_neighbour(self, store: CoordinationStore) -> None:
        """End the round if the member this node watches stopped beating."""
        watch = self._watch
        if watch is None:
            return
        round_, node_id, host, size = watch
        if self._alive(store, node_id):
            return
        logger.warning(
            "node %s (host %s) is gone (no heartbeat within heartbeat_timeout=%g s, or it "
            "left): starting a new round",
            node_id,
            host,
            self.settings.heartbeat_timeout,
        )
        self._watch = None
        self._advance(round_, size - 1, store)

    def _report_progress(self, store: CoordinationStore, deadline: float) -> None:
        """While this node waits: who has joined its round, and what the round waits for."""
        s = self.settings
        state = records.decode_state(self.keys.state(), store.get(self.keys.state()))
        round_ = max(state, self._last_joined or 0)
        if round_ > state and store.get(self.keys.of_round(round_, "open")) is None:
            logger.info(
                "rendezvous round %d: the job runs with %d nodes (MAX); this node waits for "
                "room, %.0f s left before join_timeout",
                round_,
                s.max_nodes,
                max(0.0, deadline - time.monotonic()),
            )
            return
        joined = store.add(self.keys.of_round(round_, "joined"), 0)
        logger.info(
            "%s", progress_line(round_, joined, s, deadline - time.monotonic(), self._last_call)
        )


def progress_line(
    round_: int,
    joined: int,
    settings: Settings,
    left: float,
    last_call: tuple[int, float] | None = None,
) -> str:
    """What a waiting node prints every PROGRESS_INTERVAL: never a count above MAX (the
    nodes beyond it wait for a next round), and once MIN are in, what closes the round
    rather than a join_timeout it no longer waits for."""
    low, high = settings.min_nodes, settings.max_nodes
    counted = min(joined, high)
    line = f"rendezvous round {round_}: {counted} of {low}:{high} nodes joined"
    if joined > high:
        line += f" ({joined - high} more wait for a later round)"
    if counted < low:
        need = low - counted
        return f"{line}; waiting for {need} more, {max(0.0, left):.0f} s left before join_timeout"
    if counted >= high:
        return f"{line}; closing it"
    if last_call is not None and last_call[0] == round_:
        closes = max(0.0, last_call[1] - time.monotonic())
        return f"{line}, MIN reached; it closes in {closes:.0f} s unless {high - counted} more join"
    return (
        f"{line}, MIN reached; it closes when {high} are in, or when the last call ends "
        f"(last_call_timeout={settings.last_call_timeout:g} s)"
    )


# --- a run id used again -----------------------------------------------------------------


def current_generation(store: CoordinationStore, keys: Keys) -> Keys:
    """The run's keys in its current generation."""
    raw = store.get(keys.generation_key)
    return keys.at(records.decode_int(keys.generation_key, raw) if raw else 0)


def settle_generation(
    store: CoordinationStore,
    keys: Keys,
    alive: Callable[[CoordinationStore, str], bool],
    nnodes: str = "",
) -> Keys:
    """The keys a node joining the run for the first time uses.

    A scheduler that restarts a job (a Kubernetes Job, a Slurm requeue, a user running the
    command again) starts new agents under the same run id. If no agent of the run's
    current generation is alive (no live lease, key or heartbeat), its records are of a
    run that failed or was killed: counting them would make the new agents wait for dead
    nodes. The run id then starts afresh in the next generation (one compare-and-set, so
    that every new agent lands in the same one), and the dead generation's keys are
    deleted. A run with a live agent is joined as before, unless its agents were started
    with another ``--nnodes`` (``nnodes``, "MIN:MAX"): that is a job started by mistake
    under a live run's id, refused in one sentence.
    """
    while True:
        raw = store.get(keys.generation_key)
        current = keys.at(records.decode_int(keys.generation_key, raw) if raw else 0)
        gone, theirs = inspect_run(store, current, alive)
        if gone is None:
            if store.get(keys.generation_key) != raw:
                continue  # another node started the next generation while this one read it
            if nnodes and theirs and theirs != nnodes:
                raise UsageError(
                    f"--rdzv-id {keys.run_id!r} is the id of a running job of --nnodes "
                    f"{theirs}, and this agent has --nnodes {nnodes}: give this job its own "
                    "--rdzv-id, or stop that one first."
                )
            return current
        following = _int(current.generation + 1)
        if store.compare_set(keys.generation_key, raw, following) == following:
            logger.info(
                "run %s: no agent of its last attempt is alive (%s): starting it afresh",
                keys.run_id,
                gone,
            )
            delete = getattr(store, "delete_prefix", None)
            if delete is not None:
                delete(current.root)


#: How many of a dead run's join records a new node reads to be sure none of them lives.
_MOST_CHECKED = 100_000


def inspect_run(
    store: CoordinationStore, keys: Keys, alive: Callable[[CoordinationStore, str], bool]
) -> tuple[str | None, str]:
    """Whether the run at ``keys`` was abandoned: how it was left when none of its agents
    (its last round's members, the joiners of the round it is in) is alive, else None
    (no records, or an agent of it lives); and its ``--nnodes`` where a record says.
    ``alive(store, key)``: whether a heartbeat key is kept. A live run answers in a few
    reads: its first joiner is usually alive."""
    state = store.get(keys.state())
    round_ = records.decode_state(keys.state(), state)
    first = keys.of_round(round_, "node", 1)
    leader = _node_or_none(first, store.get(first))
    nnodes = leader.nnodes if leader else ""
    if leader is None and round_ == 0:
        return None, nnodes  # a new run, or one whose first joiner is writing its record
    if leader is not None and alive(store, keys.heartbeat(leader.node_id)):
        return None, nnodes
    candidates = [leader.node_id] if leader else []
    for closed in (round_, round_ - 1):
        raw = store.get(keys.of_round(closed, "closed")) if closed >= 0 else None
        if raw:
            with contextlib.suppress(StoreError):
                candidates += records.decode_round(keys.of_round(closed, "closed"), raw).node_ids
            break
    joined = min(store.add(keys.of_round(round_, "joined"), 0), _MOST_CHECKED)
    others = [keys.of_round(round_, "node", i) for i in range(2, joined + 1)]
    for key, raw in zip(others, store.get_many(others) if others else [], strict=True):
        node = _node_or_none(key, raw)
        if node is not None:
            candidates.append(node.node_id)
            nnodes = nnodes or node.nnodes
    for node_id in dict.fromkeys(candidates):
        if alive(store, keys.heartbeat(node_id)):
            return None, nnodes
    return f"round {round_}, {len(set(candidates))} nodes, none with a heartbeat", nnodes


def _node_or_none(key: str, raw: bytes | None) -> records.NodeRecord | None:
    """A joiner's record, or None for an absent, void (empty) or unreadable one."""
    if not raw:
        return None
    try:
        return records.decode_node(key, raw)
    except StoreError:
        return None


def _int(value: int) -> bytes:
    return records.encode_int(value)


def _usable_joiners(
    round_: int, keys: Sequence[str], values: Sequence[bytes | None]
) -> list[records.NodeRecord]:
    """The joiners' records that can be used. One that cannot be read (not JSON, another
    version, a field missing, another job's), or that repeats a node id already in, was
    not written by a node of this job, or not by one that can take part: the round
    closes without it, saying so, rather than failing every node."""
    nodes: list[records.NodeRecord] = []
    seen: set[str] = set()
    for key, value in zip(keys, values, strict=True):
        if not value:
            continue
        try:
            node = records.decode_node(key, value)
        except StoreError as error:
            logger.warning("rendezvous round %d: %s; closing the round without it", round_, error)
            continue
        if node.node_id in seen:
            logger.warning(
                "rendezvous round %d: record %r repeats node %r; closing the round without it",
                round_,
                key,
                node.node_id[:80],
            )
            continue
        seen.add(node.node_id)
        nodes.append(node)
    return nodes

"""The rendezvous protocol, written once over a ``CoordinationStore``.

Keys live under ``/rallypoint/<run id>/``, so two jobs never meet. For round ``r``:

* ``state`` - the round the job is in (a counter record); moving it from ``r`` to ``r+1``
  (compare-and-set) ends round ``r`` for everybody: a node died, a worker failed, or a
  late node wants in.
* ``r/joined`` - an atomic counter; each joiner's value is its join index ``i``.
* ``r/node/<i>`` - the joiner's ``NodeRecord``; its existence also marks "``i`` joined",
  which is what the leader waits on, so waiting is event-driven (``wait`` on a key).
* ``r/expected`` - how many nodes a re-formed round expects (survivors plus newcomers), so
  it closes as soon as they are in, instead of waiting for the last call.
* ``r/closed`` - the ``RoundRecord`` the leader (join index 1) writes: members ordered by
  group rank and the master address. One record, read once by each node.
* ``r/done/<i>`` - the exit barrier.
* ``hb/<node id>`` - a counter each member bumps every ``heartbeat_timeout / 3``; each
  member watches the next one in rank order (a ring), so liveness costs O(N) in all.

Every node does a constant number of operations per round, and the leader reads the N
records once: the store sees O(N) operations per round, not O(N^2).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rallypoint.errors import RallypointError
from rallypoint.events import RoundInfo
from rallypoint.extensions import NodeSpec, RankAssigner
from rallypoint.rendezvous import records
from rallypoint.rendezvous.handler import Assignment
from rallypoint.rendezvous.ports import PortReservation
from rallypoint.rendezvous.store import CoordinationStore, StoreError

logger = logging.getLogger("rallypoint.rendezvous")


#: Seconds between "who has joined" lines while a node waits in a rendezvous.
PROGRESS_INTERVAL = 5.0


class RendezvousTimeout(RallypointError):
    """Not enough nodes joined in time."""


@dataclass(frozen=True)
class Settings:
    """The protocol's ``--rdzv-conf`` values and the job's size."""

    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    heartbeat_timeout: float = 15.0

    @classmethod
    def from_conf(cls, min_nodes: int, max_nodes: int, conf: Mapping[str, Any]) -> Settings:
        names = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout")
        return cls(min_nodes, max_nodes, **{n: float(conf[n]) for n in names if n in conf})


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
    ) -> None:
        self.store = store
        self.prefix = f"/rallypoint/{run_id}/"
        self.node = node
        self.nproc = nproc_per_node
        self.assigner = assigner
        self.settings = settings
        self.round: int | None = None
        self.rank: int | None = None
        self.members: list[records.NodeRecord] = []
        self._port: PortReservation | None = None
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._heartbeat_error: StoreError | None = None
        self._watch: tuple[int, records.NodeRecord, int] | None = None
        # (join deadline, when the last progress line was printed) while next_round waits.
        self._joining: tuple[float, float] | None = None
        # The heartbeat thread's own connection, opened now rather than inside next_round:
        # torch's TCPStore client does a reverse DNS lookup on every connect, and a slow or
        # dropped lookup (5 s resolver timeout) must not land in the timed join path.
        self._beat_store = store.clone()
        # Heartbeat counters seen, by node: (value, monotonic time it last changed).
        self._beats: dict[str, tuple[int, float]] = {}

    # --- keys -----------------------------------------------------------------------------

    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def _state(self) -> int:
        key = self._key("state")
        raw = self.store.get(key)
        if raw is None:
            raw = self.store.compare_set(key, None, records.encode_int(0))
        return records.decode_int(key, raw)

    def _advance(
        self, from_round: int, expected: int, store: CoordinationStore | None = None
    ) -> None:
        """End round ``from_round`` for every node (unless another node already did).

        ``expected`` is how many nodes the next round should wait for before closing; it is
        written before the round changes, so the next leader always finds it.
        """
        store = store or self.store
        store.compare_set(self._key(from_round + 1, "expected"), None, records.encode_int(expected))
        store.compare_set(
            self._key("state"), records.encode_int(from_round), records.encode_int(from_round + 1)
        )
        # Only an opened round may close: a node that came to a full job waits for this.
        store.set(self._key(from_round + 1, "open"), b"1")

    # --- RendezvousHandler ----------------------------------------------------------------

    def next_round(self) -> Assignment:
        self._watch = None  # the previous round's ring no longer applies
        self._start_heartbeats()
        deadline = time.monotonic() + self.settings.join_timeout
        round_ = max(self._state(), (self.round + 1) if self.round is not None else 0)
        self._joining = (deadline, time.monotonic())
        try:
            while True:
                record = self._join(round_, deadline)
                if record is not None:
                    return self._assignment(record)
                # Too late for this round: ask for a new one if there is room, else wait.
                running = len(self._closed(round_).members)
                if running < self.settings.max_nodes:
                    self._advance(round_, running + 1)
                round_ += 1
        finally:
            self._joining = None

    def _report_progress(self, store: CoordinationStore, deadline: float) -> None:
        """While this node waits: who has joined, and the time left."""
        s = self.settings
        round_ = records.decode_int(self._key("state"), store.get(self._key("state")) or b"")
        joined = store.add(self._key(round_, "joined"), 0)
        logger.info(
            "rendezvous round %d: %d of %d:%d nodes joined; %.0f s left before join_timeout",
            round_,
            joined,
            s.min_nodes,
            s.max_nodes,
            max(0.0, deadline - time.monotonic()),
        )

    def nodes_waiting(self) -> int:
        """1 when the job has moved past this node's round (a member left or a node came)."""
        if self._heartbeat_error is not None:
            raise self._heartbeat_error
        if self.round is None:
            return 0
        return 1 if self._state() > self.round else 0

    def request_new_round(self) -> None:
        """After a local failure: end the round so that every node restarts its workers."""
        if self.round is not None:
            self._advance(self.round, len(self.members))

    def exit_barrier(self, timeout: float) -> None:
        if self.round is None:
            return
        done = self.store.add(self._key(self.round, "done"), 1)
        self.store.set(self._key(self.round, "done", done), b"1")
        self._watch = None  # finished nodes stop beating at different times
        if not self.store.wait([self._key(self.round, "done", len(self.members))], timeout):
            logger.warning("exit barrier: not every node finished within %.0f s", timeout)

    def close(self) -> None:
        self._stop_heartbeats()
        if self._port is not None:
            self._port.release()
            self._port = None
        self._beat_store.close()
        self.store.close()

    # --- joining --------------------------------------------------------------------------

    def _join(self, round_: int, deadline: float) -> records.RoundRecord | None:
        """Join ``round_``; return its record if this node is a member, None if too late."""
        previous_port, self._port = self._port, PortReservation()
        if previous_port is not None:
            previous_port.release()  # after taking the new one: attempts never share a port
        index = self.store.add(self._key(round_, "joined"), 1)
        mine = records.NodeRecord(
            node_id=self.node.node_id,
            host=self.node.host,
            nproc=self.nproc,
            port=self._port.port,
            labels=dict(self.node.labels),
            previous_rank=self.rank,
        )
        self.store.set(self._key(round_, "node", index), records.encode(mine))
        if index == 1:
            self._lead(round_, deadline)
        closed_key = self._key(round_, "closed")
        if not self.store.wait([closed_key], max(0.0, deadline - time.monotonic())):
            raise RendezvousTimeout(
                f"rendezvous round {round_}: fewer than {self.settings.min_nodes} nodes joined "
                f"within join_timeout={self.settings.join_timeout:g} s"
            )
        record = self._closed(round_)
        if any(member.node_id == self.node.node_id for member in record.members):
            return record
        return None

    def _closed(self, round_: int) -> records.RoundRecord:
        key = self._key(round_, "closed")
        raw = self.store.get(key)
        if raw is None:
            raise StoreError(f"rendezvous record {key!r} vanished from the store")
        return records.decode_round(key, raw)

    def _lead(self, round_: int, deadline: float) -> None:
        """As the first joiner: wait for enough nodes, then close the round."""
        s = self.settings
        if round_ > 0 and not self.store.wait(
            [self._key(round_, "open")], max(0.0, deadline - time.monotonic())
        ):
            raise RendezvousTimeout(
                f"rendezvous round {round_}: the job kept running with its {s.max_nodes} nodes "
                f"(the maximum) for join_timeout={s.join_timeout:g} s; this node was not needed"
            )
        need = self._key(round_, "node", s.min_nodes)
        if not self.store.wait([need], max(0.0, deadline - time.monotonic())):
            raise RendezvousTimeout(
                f"rendezvous round {round_}: fewer than {s.min_nodes} nodes joined within "
                f"join_timeout={s.join_timeout:g} s"
            )
        previous = self._closed(round_ - 1) if round_ > 0 else None
        if previous is None:
            # A new job: last call for more nodes, closing at once when MAX are in.
            self.store.wait([self._key(round_, "node", s.max_nodes)], s.last_call_timeout)
        else:
            self._wait_for_survivors(round_, previous)
        count = min(self.store.add(self._key(round_, "joined"), 0), s.max_nodes)
        nodes = self._joined(round_, count)
        specs = [
            NodeSpec(n.node_id, host=n.host, labels=n.labels, previous_rank=n.previous_rank)
            for n in nodes
        ]
        ranks = list(self.assigner.assign(specs))
        ordered = [node for _, node in sorted(zip(ranks, nodes, strict=True), key=lambda p: p[0])]
        record = records.RoundRecord(
            round=round_,
            members=ordered,
            master_addr=ordered[0].host,
            master_port=ordered[0].port,
        )
        self.store.set(self._key(round_, "closed"), records.encode(record))

    def _joined(self, round_: int, count: int, start: int = 1) -> list[records.NodeRecord]:
        keys = [self._key(round_, "node", i) for i in range(start, count + 1)]
        if not self.store.wait(keys, self.settings.close_timeout):
            raise RendezvousTimeout(f"rendezvous round {round_}: joiners did not finish joining")
        return [records.decode_node(key, self.store.get(key) or b"") for key in keys]

    def _wait_for_survivors(self, round_: int, previous: records.RoundRecord) -> None:
        """A re-formed round closes once every live member of the last one is back (and the
        newcomers it expects), without waiting out the last call for nodes that died.

        A member is dead when its heartbeat counter has not moved for heartbeat_timeout.
        Joins are awaited on the store (event-driven); between them the leader looks at the
        heartbeats every heartbeat_timeout / 3.
        """
        s = self.settings
        raw = self.store.get(self._key(round_, "expected"))
        expected = records.decode_int(self._key(round_, "expected"), raw) if raw else 0
        newcomers = max(0, expected - len(previous.members))
        # Start from what the ring watcher already saw: a neighbour that died during the
        # last round is known dead sooner.
        beats = dict(self._beats)
        joined: set[str] = set()
        end = time.monotonic() + s.last_call_timeout
        while time.monotonic() < end:
            count = self.store.add(self._key(round_, "joined"), 0)
            if count >= s.max_nodes:
                return
            # Each record is read once, whatever the number of passes.
            joined |= {n.node_id for n in self._joined(round_, count, start=len(joined) + 1)}
            now = time.monotonic()
            missing = []
            for member in previous.members:
                if member.node_id in joined:
                    continue
                value = self.store.add(self._key("hb", member.node_id), 0)
                last = beats.get(member.node_id)
                if last is None or last[0] != value:
                    beats[member.node_id] = (value, now)
                    missing.append(member)
                elif now - last[1] < s.heartbeat_timeout:
                    missing.append(member)
            back = sum(1 for member in previous.members if member.node_id in joined)
            if not missing and count >= max(s.min_nodes, min(s.max_nodes, back + newcomers)):
                return
            slice_ = min(s.heartbeat_timeout / 3, max(0.0, end - time.monotonic()))
            self.store.wait([self._key(round_, "node", count + 1)], slice_)

    def _assignment(self, record: records.RoundRecord) -> Assignment:
        self.round = record.round
        self.members = record.members
        self.rank = next(i for i, m in enumerate(record.members) if m.node_id == self.node.node_id)
        if self.rank != 0 and self._port is not None:
            self._port.release()  # only group rank 0's port is used
            self._port = None
        info = RoundInfo(
            round=record.round,
            group_rank=self.rank,
            group_world_size=len(record.members),
            world_size=sum(m.nproc for m in record.members),
            master_addr=record.master_addr,
            master_port=record.master_port,
            members=tuple(m.node_id for m in record.members),
        )
        if len(record.members) > 1:
            self._watch = (
                record.round,
                record.members[(self.rank + 1) % len(record.members)],
                len(record.members),
            )
        return Assignment(info, tuple(m.nproc for m in record.members))

    # --- liveness -------------------------------------------------------------------------

    def _start_heartbeats(self) -> None:
        """Bump this node's heartbeat from its first join until ``close``."""
        if self._heartbeat is not None:
            return
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, args=(self._beat_store, self._stop_heartbeat), daemon=True
        )
        self._heartbeat.start()

    def _stop_heartbeats(self) -> None:
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join(5)
            self._heartbeat = None

    def _beat(self, store: CoordinationStore, stop: threading.Event) -> None:
        """Bump this node's heartbeat; in a round, watch the next member's (a ring) and end
        the round if it stopped."""
        interval = min(self.settings.heartbeat_timeout / 3, PROGRESS_INTERVAL)
        seen: tuple[str, int, float] | None = None  # (watched node, its counter, when it moved)
        try:
            while not stop.is_set():
                store.add(self._key("hb", self.node.node_id), 1)
                joining = self._joining
                if joining is not None and time.monotonic() - joining[1] >= PROGRESS_INTERVAL:
                    self._joining = (joining[0], time.monotonic())
                    self._report_progress(store, joining[0])
                watch = self._watch
                if watch is not None:
                    round_, member, size = watch
                    value = store.add(self._key("hb", member.node_id), 0)
                    now = time.monotonic()
                    if seen is None or seen[0] != member.node_id or seen[1] != value:
                        seen = (member.node_id, value, now)
                        self._beats[member.node_id] = (value, now)
                    elif now - seen[2] > self.settings.heartbeat_timeout:
                        logger.warning(
                            "node %s (host %s) sent no heartbeat for %.0f s: starting a new round",
                            member.node_id,
                            member.host,
                            now - seen[2],
                        )
                        self._watch = None
                        self._advance(round_, size - 1, store)
                stop.wait(interval)
        except StoreError as error:
            self._heartbeat_error = error

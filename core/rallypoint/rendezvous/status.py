"""What ``rallypoint rendezvous status`` shows: the state of a job's rendezvous, read-only.

It reads the store directly, beside the protocol's steps it reuses (``calls.drive``): it is
no node of the job, writes nothing (``add(key, 0)`` reads a count) and waits for nothing
but a liveness sample, so it needs neither the node's retries nor its world."""

from __future__ import annotations

import time
from typing import Any

from rallypoint.interfaces import CoordinationStore
from rallypoint.rendezvous import calls, readiness, records
from rallypoint.rendezvous.generations import (
    MOST_CHECKED,
    current_generation,
    has_records,
    inspect_run,
    job_round,
)
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.liveness import CounterLiveness


def read_status(
    store: CoordinationStore, keys: Keys, run_id: str, heartbeat_timeout: float
) -> dict[str, Any]:
    """The current round, its members by group rank, nodes waiting for the next round,
    nodes getting ready beside it, whether each member is alive, and the run's condition:
    ``forming``, ``running``, ``failed`` (the round's leader could not form it) or
    ``abandoned`` (no agent of it is alive: it failed or was killed; its next start begins
    afresh); ``None`` when the store holds nothing of the run (it never started, or
    finished cleanly and left nothing).

    A store that keeps liveness with counters (TCPStore) can only tell by watching them
    move, so this takes ``heartbeat_timeout / 3`` and a little more on such a store; a
    store with leases or expiring keys (etcd, Redis) answers at once.
    """
    keys = current_generation(store, keys)
    round_ = calls.drive(job_round(keys), store)  # 0 where it has no state
    if round_ == 0 and not has_records(store, keys):
        return {"run_id": run_id, "round": None, "members": [], "waiting": 0, "condition": None}
    closed_key = keys.of_round(round_, "closed")
    raw_closed = store.get(closed_key)
    if raw_closed is None and round_ > 0:
        # The round is forming: show the last one that completed.
        closed_key = keys.of_round(round_ - 1, "closed")
        raw_closed = store.get(closed_key)
    record = records.decode_round(closed_key, raw_closed) if raw_closed else None
    members = record.node_ids if record else ()
    sample = heartbeat_timeout / 3 + 0.5
    ready = dict(calls.drive(readiness.getting_ready(keys), store))
    alive = _alive(store, keys, tuple(dict.fromkeys((*members, *ready))), sample)
    getting_ready = [{"node_id": n, "doing": doing} for n, doing in ready.items() if alive[n]]
    # A count anyone who reaches the store can add to: shown capped.
    joined_now = min(store.add(keys.of_round(round_, "joined"), 0), MOST_CHECKED)
    forming = raw_closed is None or (record is not None and record.round != round_)
    gone, _ = inspect_run(store, keys, sample)
    failed = store.get(keys.failed()) is not None or bool(
        record is not None and record.error and record.round == round_
    )
    abandoned = gone is not None
    condition = (
        "failed" if failed else "abandoned" if abandoned else "forming" if forming else "running"
    )
    return {
        "run_id": run_id,
        "generation": keys.generation,
        "condition": condition,
        "abandoned": gone,
        "round": round_,
        "forming": forming,
        "completed_round": record.round if record else None,
        "master": f"{record.master_addr}:{record.master_port}" if record else None,
        "error": record.error if record else "",
        "members": _members(record, alive),
        "joined_current_round": joined_now,
        "getting_ready": getting_ready,  # beside the running round, before they join
        "waiting": joined_now
        if record is None or record.round != round_
        else max(0, joined_now - len(members)),
    }


def _alive(
    store: CoordinationStore, keys: Keys, members: tuple[str, ...], sample: float
) -> dict[str, bool]:
    """Whether each member is alive; a counter's liveness is known by watching it move."""
    if members and isinstance(store, CounterLiveness):
        for node_id in members:
            store.alive(keys.heartbeat(node_id), sample)
        time.sleep(sample)
    return {node_id: store.alive(keys.heartbeat(node_id), sample) for node_id in members}


def _members(record: records.RoundRecord | None, alive: dict[str, bool]) -> list[dict[str, Any]]:
    if record is None:
        return []
    return [
        {
            "group_rank": rank,
            "node_id": node_id,
            "host": record.hosts[rank],
            "nproc": record.nprocs[rank],
            "alive": alive[node_id],
        }
        for rank, node_id in enumerate(record.node_ids)
    ]

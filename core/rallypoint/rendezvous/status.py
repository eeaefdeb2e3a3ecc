"""What ``rallypoint rendezvous status`` shows: the state of a job's rendezvous, read-only."""

from __future__ import annotations

import time
from typing import Any

from rallypoint.rendezvous import records
from rallypoint.rendezvous.store import CoordinationStore


def read_status(store: CoordinationStore, run_id: str, sample_seconds: float) -> dict[str, Any]:
    """The current round, its members by group rank, nodes waiting for the next round, and
    whether each member's heartbeat moved during ``sample_seconds``."""
    prefix = f"/rallypoint/{run_id}/"
    raw_state = store.get(prefix + "state")
    if raw_state is None:
        return {"run_id": run_id, "round": None, "members": [], "waiting": 0}
    round_ = records.decode_int(prefix + "state", raw_state)
    closed_key = f"{prefix}{round_}/closed"
    raw_closed = store.get(closed_key)
    if raw_closed is None and round_ > 0:
        # The round is forming: show the last one that completed.
        closed_key = f"{prefix}{round_ - 1}/closed"
        raw_closed = store.get(closed_key)
    record = records.decode_round(closed_key, raw_closed) if raw_closed else None
    members = record.members if record else []
    before = {m.node_id: store.add(f"{prefix}hb/{m.node_id}", 0) for m in members}
    if members:
        time.sleep(sample_seconds)
    after = {m.node_id: store.add(f"{prefix}hb/{m.node_id}", 0) for m in members}
    joined_now = store.add(f"{prefix}{round_}/joined", 0)
    return {
        "run_id": run_id,
        "round": round_,
        "forming": raw_closed is None or (record is not None and record.round != round_),
        "completed_round": record.round if record else None,
        "master": f"{record.master_addr}:{record.master_port}" if record else None,
        "members": [
            {
                "group_rank": rank,
                "node_id": m.node_id,
                "host": m.host,
                "nproc": m.nproc,
                "heartbeats": after[m.node_id],
                "alive": after[m.node_id] != before[m.node_id],
            }
            for rank, m in enumerate(members)
        ],
        "joined_current_round": joined_now,
        "waiting": joined_now
        if record is None or record.round != round_
        else max(0, joined_now - len(members)),
    }

"""What the rendezvous keeps in the store: JSON records, checked when read.

Nothing read from a store is unpickled. Every record carries ``kind`` and ``version``; a
record that is not valid JSON, has another kind or version, or lacks a field is reported
as one clear error naming the key, never executed or half-used. Node and round records
also carry their job's run id, checked against the key they are read from: a record of
another job (copied, or written by a program that mixed up its keys) is an error too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from rallypoint.rendezvous.store import StoreError

#: 2: node and round records carry ``run_id``.
VERSION = 2


@dataclass(frozen=True)
class NodeRecord:
    """One node's entry in a round."""

    node_id: str
    host: str
    nproc: int
    port: int  # a master port this node holds, used if it becomes group rank 0
    labels: dict[str, str] = field(default_factory=dict)
    previous_rank: int | None = None
    run_id: str = ""  # the job's; a record read under another job's keys is refused


@dataclass(frozen=True)
class RoundRecord:
    """A closed round: its members in group-rank order, and where rank 0 listens.

    Parallel tuples rather than one object per member: every node reads this record, so
    at a thousand nodes its size and decoding time matter. ``error`` is set instead when
    the round could not be formed (the rank assigner failed, say), so that every node
    stops with the leader's reason rather than waiting for a round that never comes.
    """

    round: int
    node_ids: tuple[str, ...]
    hosts: tuple[str, ...]
    nprocs: tuple[int, ...]
    master_addr: str
    master_port: int
    error: str = ""
    run_id: str = ""  # the job's; a record read under another job's keys is refused


def encode(record: NodeRecord | RoundRecord) -> bytes:
    kind = "node" if isinstance(record, NodeRecord) else "round"
    # The fields as they are (json writes tuples as lists): ``asdict`` would deep-copy
    # every member list first, which costs more than writing the JSON.
    fields_ = {name: getattr(record, name) for name in _FIELDS[kind]}
    return json.dumps({"kind": kind, "version": VERSION, **fields_}, separators=(",", ":")).encode()


_FIELDS = {
    "node": tuple(f.name for f in fields(NodeRecord)),
    "round": tuple(f.name for f in fields(RoundRecord)),
}


def _load(key: str, raw: bytes, kind: str) -> dict[str, Any]:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise StoreError(
            f"rendezvous record {key!r} is not JSON; another program wrote it"
        ) from None
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise StoreError(f"rendezvous record {key!r} is not a rallypoint {kind} record")
    if data.get("version") != VERSION:
        raise StoreError(
            f"rendezvous record {key!r} has version {data.get('version')!r}; this rallypoint "
            f"reads version {VERSION} (are all nodes on the same rallypoint release?)"
        )
    return data


def _node(key: str, data: Any) -> NodeRecord:
    try:
        record = NodeRecord(
            node_id=str(data["node_id"]),
            host=str(data["host"]),
            nproc=int(data["nproc"]),
            port=int(data["port"]),
            labels={str(k): str(v) for k, v in dict(data.get("labels") or {}).items()},
            previous_rank=None if data.get("previous_rank") is None else int(data["previous_rank"]),
            run_id=str(data["run_id"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise StoreError(f"rendezvous record {key!r} is malformed: {error!r}") from None
    if record.nproc < 1 or not 0 <= record.port <= 65535:
        raise StoreError(f"rendezvous record {key!r} is malformed: bad nproc or port")
    return record


def _check_owner(key: str, run_id: str, tail: str) -> None:
    """A record under ``<prefix>/<run id>/<tail>`` must name that run id: one that names
    another was written for another job, and using it would mix the two jobs up."""
    if not key.endswith(f"/{run_id}/{tail}"):
        raise StoreError(
            f"rendezvous record {key!r} belongs to run {run_id[:80]!r}, not to the run "
            "whose key it is under; another program wrote it there (remove it, or give "
            "this job its own --rdzv-id or prefix)"
        )


def decode_node(key: str, raw: bytes) -> NodeRecord:
    record = _node(key, _load(key, raw, "node"))
    _check_owner(key, record.run_id, "/".join(key.rsplit("/", 3)[1:]))
    return record


def decode_round(key: str, raw: bytes) -> RoundRecord:
    data = _load(key, raw, "round")
    try:
        node_ids = tuple(data["node_ids"])
        hosts = tuple(data["hosts"])
        nprocs = tuple(data["nprocs"])
        record = RoundRecord(
            round=int(data["round"]),
            node_ids=node_ids,
            hosts=hosts,
            nprocs=nprocs,
            master_addr=str(data["master_addr"]),
            master_port=int(data["master_port"]),
            error=str(data.get("error") or ""),
            run_id=str(data["run_id"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise StoreError(f"rendezvous record {key!r} is malformed: {error!r}") from None
    # Every node decodes this record, of N members: the checks run over whole tuples in C
    # (set of types, min), not element by element in Python, a third of the cost at 1024.
    well_formed = (
        len(node_ids) == len(hosts) == len(nprocs)
        and (record.error or node_ids)
        and set(map(type, node_ids)) <= {str}
        and set(map(type, hosts)) <= {str}
        and set(map(type, nprocs)) <= {int}
        and (not nprocs or min(nprocs) > 0)
        and 0 <= record.master_port <= 65535
    )
    if not well_formed:
        raise StoreError(f"rendezvous record {key!r} is malformed: inconsistent member lists")
    if len(set(node_ids)) != len(node_ids):
        raise StoreError(
            f"rendezvous record {key!r} is malformed: a node is listed twice, which would "
            "give two nodes the same ranks"
        )
    if not key.endswith(f"/{record.round}/closed"):
        raise StoreError(
            f"rendezvous record {key!r} is round {record.round}'s record, copied to the wrong "
            "key; another program wrote it"
        )
    _check_owner(key, record.run_id, f"{record.round}/closed")
    return record


def encode_int(value: int) -> bytes:
    return json.dumps({"kind": "counter", "version": VERSION, "value": value}).encode()


def decode_int(key: str, raw: bytes) -> int:
    data = _load(key, raw, "counter")
    try:
        return int(data["value"])
    except (KeyError, TypeError, ValueError) as error:
        raise StoreError(f"rendezvous record {key!r} is malformed: {error!r}") from None

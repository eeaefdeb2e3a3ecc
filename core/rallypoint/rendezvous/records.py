"""What the rendezvous keeps in the store: JSON records, checked when read.

Nothing read from a store is unpickled. Every record carries ``kind`` and ``version``; a
record that is not valid JSON, has another kind or version, or lacks a field is reported
as one clear error naming the key, never executed or half-used. Node and round records
also carry their job's run id, checked against the key they are read from: a record of
another job (copied, or written by a program that mixed up its keys) is an error too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from typing import Any

from rallypoint.interfaces import StoreError

#: 2: node and round records carry ``run_id``. 3: a round record lists its members
#: compactly (node ids and hosts as space-separated text, nprocs as runs). 4: node records
#: may carry an ``offer``, and round records every member's (``offers``).
VERSION = 4

_WHITESPACE = re.compile(r"\s")
#: What a record sealed with a job token starts with (``rendezvous.signing.MARK``).
SEALED = b"rp1."


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
    nnodes: str = ""  # the agent's --nnodes MIN:MAX: a job of another shape is refused
    #: What the node's agent tells the others through the round (its memory checkpoints:
    #: where it serves them, which steps it holds); text to text, empty for most jobs.
    offer: dict[str, str] = field(default_factory=dict)
    #: Its workers' CPU seconds per step in its last round (``NodeSpec.pace``), or None.
    pace: float | None = None


@dataclass(frozen=True)
class RoundRecord:
    """A closed round: its members in group-rank order, and where rank 0 listens.

    Parallel tuples rather than one object per member: every node reads this record, so
    at a thousand nodes its size and decoding time matter. In the store ``node_ids`` and
    ``hosts`` are text, separated by spaces (neither holds whitespace: a node record
    that does is refused), and ``nprocs`` is a list of ``[count, nproc]`` runs
    (``[[1024, 8]]``): reading them is two splits rather than a JSON value per member,
    half the decoding time of lists at 1024 nodes. ``error`` is set instead when
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
    #: Each member's ``offer``, in group-rank order; empty when no member made one (so a
    #: job without memory checkpoints pays nothing for them at a thousand nodes).
    offers: tuple[dict[str, str], ...] = ()


def encode(record: NodeRecord | RoundRecord) -> bytes:
    kind = "node" if isinstance(record, NodeRecord) else "round"
    # The fields as they are (json writes tuples as lists): ``asdict`` would deep-copy
    # every member list first, which costs more than writing the JSON.
    fields_ = {name: getattr(record, name) for name in _FIELDS[kind]}
    if isinstance(record, RoundRecord):
        if not all(map(usable_id, record.node_ids)) or not all(map(usable_host, record.hosts)):
            raise ValueError("node ids must be non-empty, and ids and hosts without spaces")
        fields_["node_ids"] = " ".join(record.node_ids)
        fields_["hosts"] = " ".join(record.hosts)
        fields_["nprocs"] = _runs(record.nprocs)
        if not record.offers:
            del fields_["offers"]
    else:
        if not record.offer:
            del fields_["offer"]
        if record.pace is None:
            del fields_["pace"]
    return json.dumps({"kind": kind, "version": VERSION, **fields_}, separators=(",", ":")).encode()


def usable_id(node_id: str) -> bool:
    """Whether ``node_id`` can be in a round record: not empty, and without whitespace
    (which separates the members there)."""
    return bool(node_id) and _WHITESPACE.search(node_id) is None


def usable_host(host: str) -> bool:
    """Whether ``host`` can be in a round record: without whitespace."""
    return _WHITESPACE.search(host) is None


def _runs(values: tuple[int, ...]) -> list[list[int]]:
    """``(8, 8, 8, 4)`` as ``[[3, 8], [1, 4]]``."""
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][1] == value:
            runs[-1][0] += 1
        else:
            runs.append([1, value])
    return runs


def _expand(runs: Any, size: int) -> tuple[int, ...]:
    """``[[3, 8], [1, 4]]`` as ``(8, 8, 8, 4)`` for ``size`` members; anything else (runs
    that are not pairs of positive integers, or count other than ``size``) is an error."""
    if not isinstance(runs, list):
        raise TypeError("nprocs must be a list of [count, nproc] runs")
    for run in runs:
        if not isinstance(run, list) or len(run) != 2 or set(map(type, run)) != {int}:
            raise ValueError(f"nprocs run {run!r} is not a [count, nproc] pair of integers")
        if min(run) < 1:
            raise ValueError(f"nprocs run {run!r} is not of positive integers")
    if sum(run[0] for run in runs) != size:
        raise ValueError(f"the nprocs runs do not count the {size} members")
    nprocs: list[int] = []
    for count, nproc in runs:
        nprocs += [nproc] * count
    return tuple(nprocs)


_FIELDS = {
    "node": tuple(f.name for f in fields(NodeRecord)),
    "round": tuple(f.name for f in fields(RoundRecord)),
}


def _load(key: str, raw: bytes, kind: str) -> dict[str, Any]:
    if raw.startswith(SEALED):
        raise StoreError(
            f"rendezvous record {key!r} is sealed with a job token, and this node has none: "
            "give it the job's --rdzv-conf token_file or RALLYPOINT_JOB_TOKEN"
        )
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
            nnodes=str(data.get("nnodes") or ""),
            offer=_offer(data.get("offer")),
            pace=None if data.get("pace") is None else float(data["pace"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise StoreError(f"rendezvous record {key!r} is malformed: {error!r}") from None
    if record.nproc < 1 or not 0 <= record.port <= 65535:
        raise StoreError(f"rendezvous record {key!r} is malformed: bad nproc or port")
    if not usable_id(record.node_id) or not usable_host(record.host):
        raise StoreError(
            f"rendezvous record {key!r} is malformed: an empty node id, or whitespace in "
            "its node id or host"
        )
    return record


def _offer(data: Any) -> dict[str, str]:
    """An offer: text keys to text values."""
    return {str(k): str(v) for k, v in dict(data or {}).items()}


def _check_owner(key: str, run_id: str, tail: str) -> None:
    """A record under ``<prefix>/<run id>/<tail>`` (or ``<run id>~<generation>/``) must
    name that run id: one that names another was written for another job, and using it
    would mix the two jobs up."""
    owner = key[: -len(tail) - 1] if key.endswith(f"/{tail}") else ""
    run, _, generation = owner.rsplit("/", 1)[-1].partition("~")
    if run != run_id or (generation and not generation.isdigit()):
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
        ids_text, hosts_text = data["node_ids"], data["hosts"]
        if not isinstance(ids_text, str) or not isinstance(hosts_text, str):
            raise TypeError("node_ids and hosts must be text")
        node_ids = tuple(ids_text.split(" ")) if ids_text else ()
        # An empty host is allowed (one member's is ""): as many hosts as node ids.
        hosts = tuple(hosts_text.split(" ")) if node_ids or hosts_text else ()
        nprocs = _expand(data["nprocs"], len(node_ids))
        record = RoundRecord(
            round=int(data["round"]),
            node_ids=node_ids,
            hosts=hosts,
            nprocs=nprocs,
            master_addr=str(data["master_addr"]),
            master_port=int(data["master_port"]),
            error=str(data.get("error") or ""),
            run_id=str(data["run_id"]),
            offers=tuple(_offer(offer) for offer in data.get("offers") or ()),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise StoreError(f"rendezvous record {key!r} is malformed: {error!r}") from None
    # Every node decodes this record, of N members: the checks run over whole tuples in C
    # (split, set, "in"), not element by element in Python.
    well_formed = (
        len(node_ids) == len(hosts)
        and len(record.offers) in (0, len(node_ids))
        and (record.error or node_ids)
        and "" not in node_ids
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


def decode_state(key: str, raw: bytes | None) -> int:
    """The round a job's state record says; 0 where there is none (a job in its first
    round has written no state)."""
    return decode_int(key, raw) if raw is not None else 0

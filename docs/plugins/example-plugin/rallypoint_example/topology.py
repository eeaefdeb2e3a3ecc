"""The ``topology-file`` rank assigner.

Group ranks that are neighbours talk the most (ring all-reduce, pipeline stages). This
assigner gives neighbouring ranks to nodes that are neighbours in the network, as a
topology file describes it. The file is named by the environment variable
``RALLYPOINT_EXAMPLE_TOPOLOGY`` on the node that forms the round; each line holds a host
and where it sits, outermost level first (blank lines and ``#`` comments are skipped)::

    # host     spine    leaf switch
    gpu-01     spine-a  leaf-1
    gpu-02     spine-a  leaf-1
    gpu-03     spine-a  leaf-2
    gpu-17     spine-b  leaf-9

Nodes sharing every level get contiguous ranks; groups come in the order the file first
mentions them, hosts within a group in file order, several agents on one host by node
id. A host is matched by its address as the node reports it, or by its short name (the
part before the first dot). Hosts the file does not list come last, by host and node id,
as with ``ordered``; without a file every host is such a host. An unreadable file is
reported once per round as a warning, and the round goes on in that fallback order rather
than failing the job.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rallypoint.sdk import NodeSpec, RankAssigner

ENV = "RALLYPOINT_EXAMPLE_TOPOLOGY"

logger = logging.getLogger("rallypoint_example")


@dataclass(frozen=True)
class Place:
    """Where a host sits: its line in the file and the order of its groups."""

    line: int
    groups: tuple[int, ...]


def parse_topology(text: str) -> dict[str, Place]:
    """The places of the hosts a topology file lists.

    Raises:
        ValueError: a line without a level, or a host listed twice; the message names the
            line.
    """
    places: dict[str, Place] = {}
    first_seen: dict[tuple[str, ...], int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        host, levels = fields[0], tuple(fields[1:])
        if not levels:
            raise ValueError(f"line {number}: {host!r} has no level (expected: HOST LEVEL...)")
        if host in places:
            raise ValueError(f"line {number}: host {host!r} is listed twice")
        groups = []
        for depth in range(1, len(levels) + 1):
            groups.append(first_seen.setdefault(levels[:depth], len(first_seen)))
        places[host] = Place(number, tuple(groups))
    return places


def load_topology(environ: Mapping[str, str] | None = None) -> dict[str, Place]:
    """The topology named by ``RALLYPOINT_EXAMPLE_TOPOLOGY``; empty without one."""
    env = os.environ if environ is None else environ
    path = env.get(ENV, "").strip()
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            return parse_topology(handle.read())
    except (OSError, ValueError) as error:
        logger.warning("topology-file: cannot use %s (%s); ranking by host instead", path, error)
        return {}


def _natural(text: str) -> tuple[tuple[int, Any], ...]:
    """node9 before node10."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", text) if p)


def _place(node: NodeSpec, places: Mapping[str, Place]) -> Place | None:
    return places.get(node.host) or places.get(node.host.split(".", 1)[0])


def ranks_by_topology(nodes: Sequence[NodeSpec], places: Mapping[str, Place]) -> list[int]:
    """Group ranks for ``nodes`` (in join order) under the topology ``places``."""

    def key(index: int) -> tuple[Any, ...]:
        node = nodes[index]
        place = _place(node, places)
        if place is None:
            return (1, (), 0, _natural(node.host), _natural(node.node_id))
        return (0, place.groups, place.line, (), _natural(node.node_id))

    ranks = [0] * len(nodes)
    for rank, index in enumerate(sorted(range(len(nodes)), key=key)):
        ranks[index] = rank
    return ranks


def assign(nodes: Sequence[NodeSpec]) -> list[int]:
    """The rank assigner: read the topology file, rank the nodes by it."""
    places = load_topology()
    ranks = ranks_by_topology(nodes, places)
    known = sum(1 for node in nodes if _place(node, places) is not None)
    logger.info(
        "topology-file: %d of %d nodes placed by %s",
        known,
        len(nodes),
        os.environ.get(ENV) or "(no topology file)",
    )
    return ranks


ASSIGNER = RankAssigner(
    name="topology-file",
    description=f"neighbours in the topology file named by ${ENV} get neighbouring ranks",
    assign=assign,
)

"""Built-in rank assigners: ``ordered``, ``sticky`` and ``topology``.

Each returns, for the nodes of a round in join order, their group ranks in that order.
All three are deterministic functions of the node list, so every agent computes the same.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from rallypoint import hookimpl
from rallypoint.extensions import NodeSpec, RankAssigner


def _ranks_in_order(nodes: Sequence[NodeSpec], key: Callable[[NodeSpec], Any]) -> list[int]:
    """Give rank 0, 1, ... to the nodes sorted by ``key``."""
    order = sorted(range(len(nodes)), key=lambda i: key(nodes[i]))
    ranks = [0] * len(nodes)
    for rank, index in enumerate(order):
        ranks[index] = rank
    return ranks


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders numbers inside text by value: node7 < node66, 10.0.0.2 < 10.0.0.10."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text) if part
    )


def _host_and_id(node: NodeSpec) -> tuple[Any, ...]:
    return (natural_key(node.host), natural_key(node.node_id))


def ordered(nodes: Sequence[NodeSpec]) -> list[int]:
    """Ranks by host address, then node id, numbers compared by value (torchrun sorts by
    address too, as text)."""
    return _ranks_in_order(nodes, _host_and_id)


def sticky(nodes: Sequence[NodeSpec]) -> list[int]:
    """Nodes keep their previous rank when it still fits; new nodes fill the free ranks.

    Keeping ranks stable across a restart lets a node reuse local state (data shards,
    caches) that belongs to its rank. Two nodes claiming one rank are settled in ``ordered``
    order.
    """
    count = len(nodes)
    ranks: list[int | None] = [None] * count
    taken: set[int] = set()
    by_order = sorted(range(count), key=lambda i: _host_and_id(nodes[i]))
    for index in by_order:
        previous = nodes[index].previous_rank
        if previous is not None and 0 <= previous < count and previous not in taken:
            ranks[index] = previous
            taken.add(previous)
    free = iter(sorted(set(range(count)) - taken))
    for index in by_order:
        if ranks[index] is None:
            ranks[index] = next(free)
    return [rank for rank in ranks if rank is not None]


def topology(nodes: Sequence[NodeSpec]) -> list[int]:
    """Nodes with the same ``--node-label`` values get contiguous ranks.

    Labels are compared in key order (``rack=a,zone=1`` sorts like ``(("rack","a"),
    ("zone","1"))``), so nodes sharing every label are neighbours, and within that those
    sharing the first keys. Unlabelled nodes come first.
    """

    def key(node: NodeSpec) -> tuple[Any, ...]:
        labels = tuple((name, natural_key(value)) for name, value in sorted(node.labels.items()))
        return (labels, *_host_and_id(node))

    return _ranks_in_order(nodes, key)


@hookimpl
def register_rank_assigners() -> list[RankAssigner]:
    return [
        RankAssigner("ordered", "ranks by host and node id, like torchrun", ordered),
        RankAssigner("sticky", "surviving nodes keep their group rank", sticky),
        RankAssigner(
            "topology", "nodes with equal --node-label values get contiguous ranks", topology
        ),
    ]

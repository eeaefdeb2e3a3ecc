"""The ``example-rank-assigner`` rank assigner: group ranks in order of host, then node id."""

from __future__ import annotations

from collections.abc import Sequence

from rallypoint.sdk import NodeSpec, RankAssigner


def assign(nodes: Sequence[NodeSpec]) -> list[int]:
    """The group rank of each node, in the order given: each of 0..N-1 once.

    Every agent may compute it: use only the nodes (host, node id, labels, previous rank),
    never the clock, randomness or the order of a set.
    """
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i].host, nodes[i].node_id))
    ranks = [0] * len(nodes)
    for rank, index in enumerate(order):
        ranks[index] = rank
    return ranks


ASSIGNER = RankAssigner(
    name="example-rank-assigner",
    description="group ranks in order of host, then node id",
    assign=assign,
)

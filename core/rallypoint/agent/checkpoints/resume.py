"""Which step a round resumes from, and which memory copies this node must fetch first:
a decision made from the round record alone, so that every agent makes the same one
(``rallypoint.agent.checkpoints.node_memory`` acts on it).

Each agent offers the round what its node's memory holds (``offer``): the whole states
(``save``: the steps), and the ranks' shares of sharded states (``save_sharded``: for each
step, the ranks it holds a share of and the world size that saved them). A whole state
is usable wherever one member holds it; a sharded step only if every rank of the round's
world size holds a share of it somewhere, saved at that world size (at another one the
workers reshard from ``--checkpoint-dir``). The round resumes from the newest usable step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: A node's shares: by step, each rank's world size when it saved.
Shares = dict[int, dict[int, int]]


def encode(steps: set[int], shares: Shares) -> dict[str, str]:
    """An offer's fields: ``steps`` ("3 5"), and ``shares`` ("5@4:0,1 4@4:0,1")."""
    offer = {"steps": " ".join(map(str, sorted(steps)))}
    parts = []
    for step in sorted(shares):
        by_world: dict[int, list[int]] = {}
        for rank, world in shares[step].items():
            by_world.setdefault(world, []).append(rank)
        for world, ranks in sorted(by_world.items()):
            parts.append(f"{step}@{world}:{','.join(map(str, sorted(ranks)))}")
    if parts:
        offer["shares"] = " ".join(parts)
    return offer


def decode(offer: Mapping[str, str]) -> tuple[set[int], Shares]:
    """``encode``'s fields back; what does not parse is left out (an offer is a hint)."""
    steps = {int(s) for s in offer.get("steps", "").split() if s.isdigit()}
    shares: Shares = {}
    for part in offer.get("shares", "").split():
        head, _, ranks = part.partition(":")
        step, _, world = head.partition("@")
        if not (step.isdigit() and world.isdigit()):
            continue
        for rank in ranks.split(","):
            if rank.isdigit():
                shares.setdefault(int(step), {})[int(rank)] = int(world)
    return steps, shares


@dataclass(frozen=True)
class Decision:
    """The round's step (None: nothing in memory; the workers load from durable storage),
    and what this node must fetch before its workers start: from which member (group
    rank), each copy named by ``(rank, sharded)``."""

    step: int | None
    fetch: dict[tuple[int, bool], list[int]] = field(default_factory=dict)


def decide(
    offers: Sequence[tuple[set[int], Shares]], me: int, world_size: int, my_ranks: range
) -> Decision:
    """The round's decision, seen from member ``me`` (whose workers take ``my_ranks``) of
    a round of ``world_size`` workers; ``offers`` by group rank."""
    whole = [steps for steps, _ in offers]
    best_whole = max((s for steps in whole for s in steps), default=None)
    covered: dict[int, set[int]] = {}
    for _, shares in offers:
        for step, ranks in shares.items():
            covered.setdefault(step, set()).update(
                rank for rank, world in ranks.items() if world == world_size
            )
    usable = [step for step, ranks in covered.items() if ranks >= set(range(world_size))]
    best_shares = max(usable, default=None)
    candidates = [s for s in (best_whole, best_shares) if s is not None]
    if not candidates:
        return Decision(None)
    step = max(candidates)
    fetch: dict[tuple[int, bool], list[int]] = {}
    if step == best_whole and step not in whole[me]:
        fetch[(0, False)] = [g for g, steps in enumerate(whole) if step in steps]
    if step == best_shares:
        for rank in my_ranks:
            if offers[me][1].get(step, {}).get(rank) == world_size:
                continue
            fetch[(rank, True)] = [
                g
                for g, (_, shares) in enumerate(offers)
                if shares.get(step, {}).get(rank) == world_size
            ]
    return Decision(step, fetch)

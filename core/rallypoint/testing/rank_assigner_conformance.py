"""The conformance suite every rank assigner must pass.

A rank assigner's tests subclass ``RankAssignerConformance`` and provide one fixture,
``assigner``: the ``RankAssigner`` registration, as the plugin's ``register_rank_assigners``
returns it. The suite hands its ``assign`` rounds of 1 to 64 nodes (hosts named like
``node7`` and like IP addresses, several nodes per host, labels or none, ranks from a
previous round or none) and checks what the rendezvous relies on:

* the answer has one rank per node, in the nodes' order, and the ranks are ``0..N-1``, each
  exactly once;
* it is deterministic: the same nodes give the same ranks when asked again, as copies, and
  in another process with another hash seed, since each agent may compute it;
* it leaves the nodes alone (they are frozen, their labels handed over read-only);
* where the assigner promises stability (the ``keeps_previous_ranks`` fixture returns
  ``True``), a node keeps its previous rank whenever that rank is free and below ``N``.

Optional fixtures: ``keeps_previous_ranks`` (default ``False``), ``extra_rounds``: more
rounds to check, as lists of ``NodeSpec`` (say, nodes with the labels or hosts your
assigner looks at), and ``options``: the ``--rank-conf`` values it is called with, as the
agent calls an assigner that declares ``options`` (``assign(nodes, options=...)``, every
declared key present; default: each key's default).

    import pytest
    from rallypoint_myranks import ASSIGNER
    from rallypoint.testing.rank_assigner_conformance import RankAssignerConformance

    class TestMyAssigner(RankAssignerConformance):
        @pytest.fixture
        def assigner(self):
            return ASSIGNER
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from types import MappingProxyType
from typing import Any

import pytest

from rallypoint.extensions import NodeSpec, RankAssigner

Round = list[NodeSpec]

#: Bound on the subprocess that recomputes the ranks.
SUBPROCESS_TIMEOUT = 60


def sample_rounds() -> list[Round]:
    """Rounds of different sizes and shapes, the same on every call."""
    rng = random.Random(20240229)
    rounds: list[Round] = []
    for size in (1, 2, 3, 4, 7, 8, 16, 33, 64):
        for shape in ("names", "addresses", "shared-hosts", "labels", "previous"):
            nodes = []
            for index in range(size):
                if shape == "addresses":
                    host = f"10.0.{index // 250}.{index % 250 + 1}"
                elif shape == "shared-hosts":
                    host = f"node{index // 2}"  # two agents on one host
                else:
                    host = f"node{rng.randrange(1000)}"
                labels: dict[str, str] = {}
                if shape == "labels" and index % 5:
                    labels = {"rack": f"r{rng.randrange(3)}", "zone": rng.choice("ab")}
                previous = None
                if shape == "previous" and index % 3:
                    previous = rng.randrange(size + 2)  # some out of range, some repeated
                nodes.append(
                    NodeSpec(
                        node_id=f"{host}_{rng.randrange(1 << 30):x}",
                        host=host,
                        labels=labels,
                        previous_rank=previous,
                    )
                )
            rng.shuffle(nodes)  # join order is arbitrary
            rounds.append(nodes)
    return rounds


def _read_only(nodes: Sequence[NodeSpec]) -> tuple[NodeSpec, ...]:
    return tuple(replace(node, labels=MappingProxyType(dict(node.labels))) for node in nodes)


_CHILD = textwrap.dedent(
    """
    import importlib, json, sys
    from rallypoint.extensions import NodeSpec

    module_name, qualname = sys.argv[1], sys.argv[2]
    assign = importlib.import_module(module_name)
    for part in qualname.split("."):
        assign = getattr(assign, part)
    given = json.load(sys.stdin)
    rounds = [[NodeSpec(**node) for node in nodes] for nodes in given["rounds"]]
    options = given["options"]
    call = assign if options is None else (lambda nodes: assign(nodes, options=options))
    json.dump([list(call(nodes)) for nodes in rounds], sys.stdout)
    """
)


def _assign(
    assigner: RankAssigner, nodes: Sequence[NodeSpec], options: Mapping[str, Any] | None
) -> list[int]:
    """The ranks, asked as the agent asks: with ``options`` where the assigner declares any."""
    if options is None:
        return list(assigner.assign(_read_only(nodes)))
    return list(assigner.assign(_read_only(nodes), options=MappingProxyType(dict(options))))


class RankAssignerConformance:
    """Subclass with an ``assigner`` fixture returning the ``RankAssigner`` to check."""

    @pytest.fixture
    def options(self, assigner: RankAssigner) -> Mapping[str, Any] | None:
        """The ``--rank-conf`` values; None for an assigner that declares no options."""
        if not assigner.options:
            return None
        return {option.name: option.default for option in assigner.options}

    @pytest.fixture
    def keeps_previous_ranks(self) -> bool:
        return False

    @pytest.fixture
    def extra_rounds(self) -> list[Round]:
        return []

    @pytest.fixture
    def rounds(self, extra_rounds: list[Round]) -> list[Round]:
        return sample_rounds() + [list(nodes) for nodes in extra_rounds]

    # --- the registration ---------------------------------------------------------------

    def test_registration_is_well_formed(self, assigner: RankAssigner) -> None:
        assert isinstance(assigner, RankAssigner)
        assert assigner.name == assigner.name.strip().lower()
        assert assigner.description.strip(), "describe the assigner in one line for --help"
        assert callable(assigner.assign)

    # --- the ranks ----------------------------------------------------------------------

    def test_every_rank_exactly_once(
        self, assigner: RankAssigner, rounds: list[Round], options: Mapping[str, Any] | None
    ) -> None:
        for nodes in rounds:
            ranks = _assign(assigner, nodes, options)
            assert len(ranks) == len(nodes), f"{len(nodes)} nodes, {len(ranks)} ranks: {ranks}"
            assert all(type(rank) is int for rank in ranks), f"ranks must be ints: {ranks}"
            assert sorted(ranks) == list(range(len(nodes))), (
                f"ranks of {len(nodes)} nodes must be 0..{len(nodes) - 1}, each once: {ranks}"
            )

    def test_same_nodes_same_ranks(
        self, assigner: RankAssigner, rounds: list[Round], options: Mapping[str, Any] | None
    ) -> None:
        first = [_assign(assigner, nodes, options) for nodes in rounds]
        # Copies, asked in the other order: nothing may depend on identity or call history.
        copies = [[replace(node) for node in nodes] for nodes in reversed(rounds)]
        again = [_assign(assigner, nodes, options) for nodes in copies][::-1]
        assert first == again

    def test_same_ranks_in_another_process(
        self, assigner: RankAssigner, rounds: list[Round], options: Mapping[str, Any] | None
    ) -> None:
        """Every agent may compute the ranks: another interpreter, with another hash seed
        (so another order of sets and dicts of strings), must get the same answer."""
        function = assigner.assign
        module = getattr(function, "__module__", None)
        qualname = getattr(function, "__qualname__", "")
        if not module or "<" in qualname:
            pytest.skip("assign is not a module-level function: cannot import it elsewhere")
        here = [_assign(assigner, nodes, options) for nodes in rounds]
        rounds_given = [[asdict(node) for node in nodes] for nodes in rounds]
        payload = json.dumps({"rounds": rounds_given, "options": options})
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for seed in ("1", "2"):
            child = subprocess.run(
                [sys.executable, "-c", _CHILD, module, qualname],
                input=payload,
                capture_output=True,
                text=True,
                timeout=SUBPROCESS_TIMEOUT,
                env={**environment, "PYTHONHASHSEED": seed},
            )
            assert child.returncode == 0, child.stderr
            assert json.loads(child.stdout) == here, f"other ranks with PYTHONHASHSEED={seed}"

    def test_previous_ranks_are_kept(
        self,
        assigner: RankAssigner,
        rounds: list[Round],
        keeps_previous_ranks: bool,
        options: Mapping[str, Any] | None,
    ) -> None:
        if not keeps_previous_ranks:
            pytest.skip("this assigner does not promise to keep previous ranks")
        for nodes in rounds:
            ranks = _assign(assigner, nodes, options)
            claims: dict[int, int] = {}
            for node in nodes:
                if node.previous_rank is not None:
                    claims[node.previous_rank] = claims.get(node.previous_rank, 0) + 1
            for node, rank in zip(nodes, ranks, strict=True):
                previous = node.previous_rank
                if previous is not None and previous < len(nodes) and claims[previous] == 1:
                    assert rank == previous, f"{node.node_id} had rank {previous}, got {rank}"

    def test_survivors_keep_their_ranks(
        self,
        assigner: RankAssigner,
        keeps_previous_ranks: bool,
        options: Mapping[str, Any] | None,
    ) -> None:
        """A round, then the next round without one node and with a newcomer."""
        if not keeps_previous_ranks:
            pytest.skip("this assigner does not promise to keep previous ranks")
        nodes = [NodeSpec(f"n{i}", host=f"host{(i * 7) % 5}") for i in range(6)]
        ranks = _assign(assigner, nodes, options)
        survivors = [
            replace(node, previous_rank=rank)
            for node, rank in zip(nodes, ranks, strict=True)
            if rank != 2
        ]
        next_round = [*survivors, NodeSpec("newcomer", host="host0")]
        new_ranks = _assign(assigner, next_round, options)
        for node, rank in zip(next_round, new_ranks, strict=True):
            if node.previous_rank is not None:
                assert rank == node.previous_rank, f"{node.node_id}: {node.previous_rank} -> {rank}"
        assert new_ranks[-1] == 2, "the newcomer takes the free rank"

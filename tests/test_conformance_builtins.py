"""The built-in restart policies, rank assigners, file checkpoint backend and metrics sinks
against the conformance suites of ``rallypoint.testing`` (the rendezvous stores run theirs
in test_store_conformance.py).

Each registration is taken from a plugin manager, as a third party's test would."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from rallypoint.checkpoint.storage import FileStorage
from rallypoint.extensions import ConfigOption, MetricsSink, NodeSpec, RankAssigner, RestartPolicy
from rallypoint.plugins import build_plugin_manager
from rallypoint.registry import METRICS_SINKS, RANK_ASSIGNERS, RESTART_POLICIES, Kind
from rallypoint.testing.checkpoint_storage_conformance import (
    CheckpointStorageConformance,
    OpenStorage,
)
from rallypoint.testing.metrics_sink_conformance import MetricsSinkConformance, event_names
from rallypoint.testing.rank_assigner_conformance import RankAssignerConformance
from rallypoint.testing.restart_policy_conformance import RestartPolicyConformance

T = TypeVar("T")


def builtin(kind: Kind[T], name: str) -> T:
    """A built-in registration, from a plugin manager of the built-ins only."""
    return build_plugin_manager({"RALLYPOINT_LOAD_PLUGINS": ""}).registry.get(kind, name)


# --- restart policies ---------------------------------------------------------------------


class TestMaxRestarts(RestartPolicyConformance):
    @pytest.fixture
    def policy(self) -> RestartPolicy:
        return builtin(RESTART_POLICIES, "max-restarts")


class TestBackoff(RestartPolicyConformance):
    """With its default jitter the delays are random: only the decisions must agree."""

    @pytest.fixture
    def policy(self) -> RestartPolicy:
        return builtin(RESTART_POLICIES, "backoff")

    @pytest.fixture
    def deterministic_delay(self) -> bool:
        return False


class TestBackoffWithoutJitter(RestartPolicyConformance):
    @pytest.fixture
    def policy(self) -> RestartPolicy:
        return builtin(RESTART_POLICIES, "backoff")

    @pytest.fixture
    def options(self, policy: RestartPolicy) -> Mapping[str, Any]:
        defaults = {option.name: option.default for option in policy.options}
        return {**defaults, "jitter": 0.0, "max_delay": 5.0}


class TestNever(RestartPolicyConformance):
    @pytest.fixture
    def policy(self) -> RestartPolicy:
        return builtin(RESTART_POLICIES, "never")


# --- rank assigners -----------------------------------------------------------------------


class TestOrdered(RankAssignerConformance):
    @pytest.fixture
    def assigner(self) -> RankAssigner:
        return builtin(RANK_ASSIGNERS, "ordered")


class TestSticky(RankAssignerConformance):
    @pytest.fixture
    def assigner(self) -> RankAssigner:
        return builtin(RANK_ASSIGNERS, "sticky")

    @pytest.fixture
    def keeps_previous_ranks(self) -> bool:
        return True


class TestTopology(RankAssignerConformance):
    @pytest.fixture
    def assigner(self) -> RankAssigner:
        return builtin(RANK_ASSIGNERS, "topology")

    @pytest.fixture
    def extra_rounds(self) -> list[list[NodeSpec]]:
        racks = [
            NodeSpec(f"n{i}", host=f"10.1.0.{i}", labels={"rack": f"r{i % 3}", "row": str(i % 2)})
            for i in range(12)
        ]
        return [racks, racks[::-1]]


def rack_first(nodes: Sequence[NodeSpec], options: Mapping[str, Any]) -> list[int]:
    """An assigner written as writing.md says one with options is: nodes sorted by the
    label ``options["key"]`` names, then by node id."""
    key = options["key"]
    order = sorted(
        range(len(nodes)), key=lambda i: (nodes[i].labels.get(key, ""), nodes[i].node_id)
    )
    ranks = [0] * len(nodes)
    for rank, index in enumerate(order):
        ranks[index] = rank
    return ranks


class TestAnAssignerWithOptions(RankAssignerConformance):
    """Issue 49: the suite calls ``assign(nodes, options=...)`` as the agent does."""

    @pytest.fixture
    def assigner(self) -> RankAssigner:
        key = ConfigOption("key", str, "rack", "the label that orders the nodes")
        return RankAssigner("rack-first", "by a label", rack_first, options=(key,))


# --- checkpoint storage -------------------------------------------------------------------


class TestFileStorage(CheckpointStorageConformance):
    @pytest.fixture
    def open_storage(self, tmp_path: Path) -> OpenStorage:
        return lambda: FileStorage(str(tmp_path / "checkpoints"))


class TestFileStorageByURL(CheckpointStorageConformance):
    """Through the registration, with a ``file://`` URL, as ``--checkpoint-dir`` gives it."""

    @pytest.fixture
    def open_storage(self, tmp_path: Path) -> OpenStorage:
        store = build_plugin_manager({"RALLYPOINT_LOAD_PLUGINS": ""}).registry
        url = f"file://{tmp_path}/by-url"
        opener = store.checkpoint_backend_for(url).open
        assert opener is not None
        return lambda: opener(url)


# --- metrics sinks ------------------------------------------------------------------------


class TestLogSink(MetricsSinkConformance):
    @pytest.fixture
    def sink(self) -> MetricsSink:
        return builtin(METRICS_SINKS, "log")


class TestJsonLinesSink(MetricsSinkConformance):
    @pytest.fixture
    def sink(self) -> MetricsSink:
        return builtin(METRICS_SINKS, "jsonl")

    @pytest.fixture
    def options(self, tmp_path: Path) -> Mapping[str, Any]:
        return {"path": str(tmp_path / "deep" / "metrics.jsonl")}

    @pytest.fixture
    def check_sink(self) -> Callable[[Mapping[str, Any]], None]:
        def check(options: Mapping[str, Any]) -> None:
            lines = Path(options["path"]).read_text().splitlines()
            names = {json.loads(line)["event"] for line in lines}
            assert names <= set(event_names()) and "agent_stopping" in names

        return check

    @pytest.fixture
    def idempotent_close(self) -> bool:
        return True

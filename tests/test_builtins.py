"""The built-in restart policies, rank assigners and metrics sinks."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import pytest

from rallypoint.builtins.rank_assigners import ordered, sticky, topology
from rallypoint.builtins.restart_policies import backoff, max_restarts, never
from rallypoint.events import Event, RunInfo, WorkerFailure
from rallypoint.extensions import NodeSpec, RestartRequest, SinkContext
from rallypoint.plugins import get_plugin_manager
from rallypoint.registry import METRICS_SINKS

RUN = RunInfo(run_id="job-1", node_id="node-a", hostname="host-a")
FAILURE = WorkerFailure(local_rank=0, rank=3, pid=123, exit_code=1)


# --- restart policies -----------------------------------------------------------------------


def test_max_restarts_counts_like_torchrun() -> None:
    decisions = [max_restarts(RestartRequest(done, 3, FAILURE)) for done in range(5)]
    assert [d.restart for d in decisions] == [True, True, True, False, False]
    assert all(d.delay == 0 for d in decisions)
    assert "3 restarts" in decisions[3].reason
    assert not max_restarts(RestartRequest(0, 0, FAILURE)).restart


BACKOFF = {"initial_delay": 1.0, "factor": 2.0, "max_delay": 5.0, "jitter": 0.0, "reset_after": 60}


def backoff_delay(uptimes: list[float], **options: float) -> float:
    request = RestartRequest(len(uptimes) - 1, 100, FAILURE, {**BACKOFF, **options}, tuple(uptimes))
    decision = backoff(request)
    assert decision.restart
    return decision.delay


def test_backoff_grows_and_is_capped() -> None:
    quick = [1.0] * 5
    assert [backoff_delay(quick[: n + 1]) for n in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert not backoff(RestartRequest(10, 10, FAILURE, BACKOFF, (1.0,) * 11)).restart


def test_backoff_resets_after_a_healthy_period() -> None:
    # Two quick failures, then an attempt that ran 90 s (healthy), then a quick one.
    assert backoff_delay([1.0, 1.0]) == 2.0
    assert backoff_delay([1.0, 1.0, 90.0]) == 1.0
    assert backoff_delay([1.0, 1.0, 90.0, 1.0]) == 2.0


def test_backoff_jitter_spreads_delays_within_bounds() -> None:
    delays = {backoff_delay([1.0, 1.0], jitter=0.5) for _ in range(50)}
    assert len(delays) > 1
    assert all(1.0 <= delay <= 3.0 for delay in delays)
    # Jitter never exceeds the cap.
    assert all(backoff_delay([1.0] * 8, jitter=0.5) <= 5.0 for _ in range(50))


def test_never_ignores_max_restarts() -> None:
    assert not never(RestartRequest(0, 100, FAILURE)).restart


# --- rank assigners -------------------------------------------------------------------------


def nodes(count: int, **previous: int) -> list[NodeSpec]:
    return [
        NodeSpec(f"n{i}", host=f"10.0.0.{i}", previous_rank=previous.get(f"n{i}"))
        for i in range(count)
    ]


@pytest.mark.parametrize("assign", [ordered, sticky, topology])
@pytest.mark.parametrize("count", [1, 2, 5, 16])
def test_every_assigner_gives_each_rank_once_deterministically(assign, count) -> None:  # type: ignore[no-untyped-def]
    members = nodes(count)
    for permutation in itertools.islice(itertools.permutations(members), 24):
        ranks = assign(list(permutation))
        assert sorted(ranks) == list(range(count))
        # The same node gets the same rank whatever the join order.
        by_node = {node.node_id: rank for node, rank in zip(permutation, ranks, strict=True)}
        assert by_node == dict(zip([n.node_id for n in members], assign(members), strict=True))


def test_ordered_sorts_by_host_then_node_id() -> None:
    members = [NodeSpec("b", host="h2"), NodeSpec("a", host="h2"), NodeSpec("z", host="h1")]
    assert ordered(members) == [2, 1, 0]


def test_sticky_keeps_survivors_ranks_and_fills_gaps() -> None:
    # n0 (rank 0) died; n2 and n3 survive with ranks 2 and 1; n9 is new.
    members = [
        NodeSpec("n2", host="h", previous_rank=2),
        NodeSpec("n9", host="h"),
        NodeSpec("n3", host="h", previous_rank=1),
    ]
    assert sticky(members) == [2, 0, 1]
    # A previous rank beyond the new world size is given up.
    shrunk = [NodeSpec("a", previous_rank=5), NodeSpec("b", previous_rank=0)]
    assert sticky(shrunk) == [1, 0]
    # Two claims on one rank: the first in ordered order keeps it.
    clash = [NodeSpec("y", previous_rank=0), NodeSpec("x", previous_rank=0)]
    assert sticky(clash) == [1, 0]


def test_topology_gives_equal_labels_contiguous_ranks() -> None:
    members = [
        NodeSpec("a", labels={"rack": "r2"}),
        NodeSpec("b", labels={"rack": "r1"}),
        NodeSpec("c", labels={"rack": "r2"}),
        NodeSpec("d", labels={"rack": "r1"}),
    ]
    ranks = topology(members)
    by_rack: dict[str, list[int]] = {}
    for node, rank in zip(members, ranks, strict=True):
        by_rack.setdefault(node.labels["rack"], []).append(rank)
    for group in by_rack.values():
        assert max(group) - min(group) == len(group) - 1


# --- metrics sinks --------------------------------------------------------------------------


def sink(name: str, **options: object):  # type: ignore[no-untyped-def]
    registration = get_plugin_manager().registry.get(METRICS_SINKS, name)
    values = {option.name: option.default for option in registration.options}
    values.update(options)
    return registration.create(SinkContext(RUN, values))


def test_log_sink(caplog: pytest.LogCaptureFixture) -> None:
    log = sink("log")
    with caplog.at_level(logging.INFO, logger="rallypoint.metrics"):
        log.emit(Event("rendezvous_completed", RUN, {"round": 2, "world_size": 8}))
    log.close()
    assert caplog.messages == ["rendezvous_completed round=2 world_size=8"]


def test_jsonl_sink_appends_one_object_per_event(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "metrics.jsonl"
    for round_number in (0, 1):
        jsonl = sink("jsonl", path=str(path))
        jsonl.emit(Event("rendezvous_completed", RUN, {"round": round_number}))
        jsonl.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1]
    assert records[0]["event"] == "rendezvous_completed"
    assert records[0]["run_id"] == "job-1"
    assert records[0]["monotonic"] > 0 and records[0]["wall_time"] > 1e9


def test_hosts_sort_naturally() -> None:
    members = [
        NodeSpec("x", host="node66"),
        NodeSpec("y", host="node7"),
        NodeSpec("z", host="node8"),
    ]
    assert ordered(members) == [2, 0, 1]
    addresses = [NodeSpec("a", host="10.0.0.10"), NodeSpec("b", host="10.0.0.2")]
    assert ordered(addresses) == [1, 0]


def test_log_sink_level_is_checked() -> None:
    from rallypoint.config import parse_options
    from rallypoint.errors import UsageError

    options = get_plugin_manager().registry.get(METRICS_SINKS, "log").options
    assert (
        parse_options("log_level=DEBUG", options, "--metrics-conf", "log")["log_level"] == "DEBUG"
    )
    with pytest.raises(UsageError, match="expected one of DEBUG, INFO, WARNING, ERROR"):
        parse_options("log_level=LOUD", options, "--metrics-conf", "log")

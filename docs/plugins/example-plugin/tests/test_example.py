"""rallypoint-example's own tests: its two registrations against rallypoint's conformance
suites, then what each promises beyond them.

Run with ``pytest`` after ``pip install -e .``: the suites come with rallypoint
(``rallypoint.testing``), and the plugin must be installed for the registration test."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from rallypoint.sdk import NodeSpec, RankAssigner, RestartPolicy, RestartRequest
from rallypoint.testing.helpers import PluginManager, registered
from rallypoint.testing.rank_assigner_conformance import RankAssignerConformance
from rallypoint.testing.restart_policy_conformance import RestartPolicyConformance
from rallypoint_example.policy import POLICY, failures_in_window
from rallypoint_example.topology import ASSIGNER, ENV, parse_topology

TOPOLOGY = """\
# host   spine    leaf
gpu-01   spine-a  leaf-1
gpu-03   spine-a  leaf-2
gpu-02   spine-a  leaf-1   # listed after gpu-03, still next to gpu-01
gpu-17   spine-b  leaf-9
"""


class TestFailureWindowConformance(RestartPolicyConformance):
    @pytest.fixture
    def policy(self) -> RestartPolicy:
        return POLICY


class TestTopologyFileConformance(RankAssignerConformance):
    @pytest.fixture(autouse=True)
    def topology(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        path = tmp_path / "topology"
        path.write_text(TOPOLOGY)
        monkeypatch.setenv(ENV, str(path))

    @pytest.fixture
    def assigner(self) -> RankAssigner:
        return ASSIGNER

    @pytest.fixture
    def extra_rounds(self) -> list[list[NodeSpec]]:
        hosts = ["gpu-17", "gpu-02.cluster", "unlisted", "gpu-01", "gpu-03", "gpu-01"]
        return [[NodeSpec(f"agent{i}", host=host) for i, host in enumerate(hosts)]]


# --- the restart policy -------------------------------------------------------------------

DEFAULTS: Mapping[str, float] = {"max_failures": 3, "window": 600.0, "delay": 0.0}


def request(uptimes: tuple[float, ...], restarts_done: int = 0) -> RestartRequest:
    return RestartRequest(restarts_done, 100, None, DEFAULTS, uptimes)


def test_failures_are_counted_in_the_window() -> None:
    assert failures_in_window((), 600) == 1
    assert failures_in_window((5.0,), 600) == 1
    assert failures_in_window((5.0, 5.0, 5.0), 600) == 3
    # The first failure was 700 s of running before the last: out of the window.
    assert failures_in_window((1.0, 400.0, 300.0), 600) == 2


def test_gives_up_after_max_failures_in_the_window() -> None:
    assert POLICY.decide(request((1.0,))).restart
    assert POLICY.decide(request((1.0, 2.0))).restart
    decision = POLICY.decide(request((1.0, 2.0, 3.0)))
    assert not decision.restart
    assert "3 failures within 600 s" in decision.reason


def test_failures_spread_out_keep_restarting() -> None:
    assert POLICY.decide(request((1.0, 3600.0, 3600.0, 3600.0), restarts_done=3)).restart


# --- the rank assigner --------------------------------------------------------------------


def test_neighbours_get_neighbouring_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "topology"
    path.write_text(TOPOLOGY)
    monkeypatch.setenv(ENV, str(path))
    nodes = [NodeSpec(f"n-{host}", host=host) for host in ("gpu-17", "new", "gpu-02", "gpu-01")]
    assert ASSIGNER.assign(nodes) == [2, 3, 1, 0]


def test_without_a_file_hosts_are_in_name_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    nodes = [NodeSpec("b", host="node10"), NodeSpec("a", host="node9")]
    assert ASSIGNER.assign(nodes) == [1, 0]


def test_a_malformed_file_falls_back_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "topology"
    path.write_text("gpu-01\n")
    monkeypatch.setenv(ENV, str(path))
    assert ASSIGNER.assign([NodeSpec("x", host="gpu-01")]) == [0]
    assert "line 1: 'gpu-01' has no level" in caplog.text
    with pytest.raises(ValueError, match="listed twice"):
        parse_topology("a x\na y\n")


# --- the plugin, as rallypoint loads it ---------------------------------------------------


def test_the_plugin_is_installed_and_registers_both(rallypoint_pm: PluginManager) -> None:
    info = rallypoint_pm.infos["example"]
    assert info.status == "active", info.error
    assert info.registered == {
        "restart policy": ["failure-window"],
        "rank assigner": ["topology-file"],
    }
    assert registered(RestartPolicy, "failure-window", rallypoint_pm) is POLICY
    assert registered(RankAssigner, "topology-file", rallypoint_pm) is ASSIGNER

"""rallypoint's pytest plugin and helpers (`rallypoint.testing`), used as a plugin author
uses them: the fixtures come from the `pytest11` entry point, not from a conftest."""

from __future__ import annotations

import pytest

from rallypoint import hookimpl
from rallypoint.extensions import RankAssigner
from rallypoint.plugins import PluginManager, build_plugin_manager, get_plugin_manager
from rallypoint.registry import RANK_ASSIGNERS
from rallypoint.testing.helpers import CliRunner, plugin_registered
from rallypoint.testing.pytest_plugin import RegisterPlugin


class Reversed:
    """A plugin object: the last node to join gets rank 0."""

    @hookimpl
    def register_rank_assigners(self) -> list[RankAssigner]:
        return [
            RankAssigner("reversed", "last to join first", lambda nodes: [*range(len(nodes))][::-1])
        ]


class Misspelt:
    @hookimpl
    def register_rank_asigners(self) -> list[RankAssigner]:
        return []


def test_the_plugin_is_loaded_by_its_entry_point(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.has_plugin("rallypoint")


def test_rallypoint_pm_is_the_process_wide_manager(rallypoint_pm: PluginManager) -> None:
    assert get_plugin_manager() is rallypoint_pm
    assert rallypoint_pm.infos["rallypoint.builtins.rank_assigners"].status == "active"


def test_register_a_plugin_object(
    rallypoint_register: RegisterPlugin, rallypoint_runner: CliRunner
) -> None:
    pm = rallypoint_register(Reversed(), name="reversed-plugin")
    assert pm.registry.get(RANK_ASSIGNERS, "reversed").assign([1, 2, 3]) == [2, 1, 0]  # type: ignore[arg-type]
    assert pm.infos["reversed-plugin"].registered == {"rank assigner": ["reversed"]}
    result = rallypoint_runner.invoke("plugins")
    assert result.exit_code == 0, result.output
    assert "--rank-assigner choices: ordered, reversed, sticky, topology\n" in result.stdout


def test_registration_ends_with_the_block() -> None:
    pm = build_plugin_manager({"RALLYPOINT_LOAD_PLUGINS": ""})
    with plugin_registered(Reversed(), "reversed-plugin", pm=pm):
        assert "reversed" in pm.registry.names(RANK_ASSIGNERS)
    assert "reversed" not in pm.registry.names(RANK_ASSIGNERS)
    assert "reversed-plugin" not in pm.infos
    assert pm.infos["rallypoint.builtins.rank_assigners"].registered == {
        "rank assigner": ["ordered", "sticky", "topology"]
    }


def test_a_broken_plugin_object_is_refused_with_the_reason() -> None:
    pm = build_plugin_manager({"RALLYPOINT_LOAD_PLUGINS": ""})
    with (
        pytest.raises(ValueError, match="unknown hook 'register_rank_asigners'"),
        plugin_registered(Misspelt(), "misspelt", pm=pm),
    ):
        pass
    assert "misspelt" not in pm.infos


def test_runner_in_process_with_a_switch_and_as_a_subprocess(rallypoint_runner: CliRunner) -> None:
    disabled = rallypoint_runner.invoke(
        "plugins", env={"RALLYPOINT_DISABLE_PLUGINS": "rallypoint.builtins.rank_assigners"}
    )
    assert "--rank-assigner choices: (none)" in disabled.stdout
    usage = rallypoint_runner.invoke("run", "--nnodes", "3:2", "train.py")
    assert usage.exit_code == 2 and "MIN must not exceed MAX" in usage.stderr
    version = rallypoint_runner.run("--version")
    assert version.exit_code == 0 and version.stdout.startswith("rallypoint ")

"""The plugin manager and registry: loading, switches, broken plugins, conflicts, lookups."""

from __future__ import annotations

import pytest

from launch import InstallPlugin
from rallypoint.errors import PluginConflictError, UnknownNameError
from rallypoint.plugins import (
    ACTIVE,
    BROKEN,
    BUILTIN_PLUGINS,
    DISABLED,
    build_plugin_manager,
    get_plugin_manager,
)
from rallypoint.registry import (
    CHECKPOINT_BACKENDS,
    METRICS_SINKS,
    RANK_ASSIGNERS,
    RENDEZVOUS_BACKENDS,
    RESTART_POLICIES,
)

GOOD_POLICY = """
from rallypoint import hookimpl
from rallypoint.extensions import RestartDecision, RestartPolicy

@hookimpl
def register_restart_policies():
    return [RestartPolicy("Always", "always restart", lambda request: RestartDecision(True))]
"""


def test_builtins_register_every_documented_name() -> None:
    registry = get_plugin_manager().registry
    assert {"static", "c10d"} <= set(registry.names(RENDEZVOUS_BACKENDS))
    assert {"backoff", "max-restarts", "never"} <= set(registry.names(RESTART_POLICIES))
    assert {"ordered", "sticky", "topology"} <= set(registry.names(RANK_ASSIGNERS))
    assert "file" in registry.names(CHECKPOINT_BACKENDS)
    assert {"log", "jsonl"} <= set(registry.names(METRICS_SINKS))


def test_installed_plugins_are_found_through_entry_points() -> None:
    pm = get_plugin_manager()
    for name, dist in [
        ("etcd", "rallypoint-etcd"),
        ("redis", "rallypoint-redis"),
        ("prometheus", "rallypoint-prometheus"),
    ]:
        assert pm.infos[name].status == ACTIVE
        assert pm.infos[name].distribution == dist
    assert {"etcd", "redis"} <= set(pm.registry.names(RENDEZVOUS_BACKENDS))
    assert "prometheus" in pm.registry.names(METRICS_SINKS)


def test_plugin_manager_is_cached() -> None:
    assert get_plugin_manager() is get_plugin_manager()


def test_a_new_plugin_adds_its_name_normalised(install_plugin: InstallPlugin) -> None:
    install_plugin("always", GOOD_POLICY, distribution="acme-always", version="2.1")
    pm = build_plugin_manager()
    info = pm.infos["always"]
    assert (info.status, info.distribution, info.version) == (ACTIVE, "acme-always", "2.1")
    assert info.hooks == ("register_restart_policies",)
    assert info.registered == {"restart policy": ["always"]}
    assert pm.registry.get(RESTART_POLICIES, " ALWAYS ").name == "always"


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("raise ImportError('no module named acme_sdk')", "failed to load: ImportError"),
        (
            "from rallypoint import hookimpl\n@hookimpl\ndef register_restart_polices():\n    return []\n",
            "register_restart_polices",
        ),
        (
            "from rallypoint import hookimpl\n@hookimpl\ndef register_rank_assigners():\n"
            "    raise RuntimeError('boom')\n",
            "register_rank_assigners failed: RuntimeError: boom",
        ),
        (
            "from rallypoint import hookimpl\n@hookimpl\ndef register_metrics_sinks():\n"
            "    return ['not a sink']\n",
            "expected MetricsSink, got str",
        ),
        (
            "from rallypoint import hookimpl\nfrom rallypoint.extensions import RankAssigner\n"
            "@hookimpl\ndef register_rank_assigners():\n"
            "    return [RankAssigner('no spaces allowed', '', lambda nodes: [])]\n",
            "invalid name 'no spaces allowed'",
        ),
        (
            "from rallypoint import hookimpl\n@hookimpl\ndef on_agent_started(run, extra):\n    pass\n",
            "extra",
        ),
    ],
    ids=["import-error", "misspelt-hook", "hook-raises", "wrong-type", "bad-name", "bad-signature"],
)
def test_a_broken_plugin_is_listed_and_skipped(
    install_plugin: InstallPlugin, source: str, error: str
) -> None:
    install_plugin("broken", source)
    install_plugin("always", GOOD_POLICY)
    pm = build_plugin_manager()
    assert pm.infos["broken"].status == BROKEN
    assert error in pm.infos["broken"].error
    assert "\n" not in pm.infos["broken"].error
    assert pm.get_plugin("broken") is None
    # Everything else still works.
    assert pm.infos["always"].status == ACTIVE
    assert "always" in pm.registry.names(RESTART_POLICIES)
    assert "ordered" in pm.registry.names(RANK_ASSIGNERS)


def test_a_plugin_broken_in_a_later_hook_loses_its_earlier_registrations(
    install_plugin: InstallPlugin,
) -> None:
    install_plugin(
        "half",
        """
        from rallypoint import hookimpl
        from rallypoint.extensions import RestartDecision, RestartPolicy

        @hookimpl
        def register_restart_policies():
            return [RestartPolicy("half", "", lambda request: RestartDecision(True))]

        @hookimpl
        def register_metrics_sinks():
            raise RuntimeError("sink setup failed")
        """,
    )
    pm = build_plugin_manager()
    assert pm.infos["half"].status == BROKEN
    assert "half" not in pm.registry.names(RESTART_POLICIES)


def test_disable_plugins_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RALLYPOINT_DISABLE_PLUGINS", "redis, rallypoint.builtins.rank_assigners")
    pm = build_plugin_manager()
    assert pm.infos["redis"].status == DISABLED
    assert pm.infos["rallypoint.builtins.rank_assigners"].status == DISABLED
    assert "redis" not in pm.registry.names(RENDEZVOUS_BACKENDS)
    assert pm.registry.names(RANK_ASSIGNERS) == []
    assert "etcd" in pm.registry.names(RENDEZVOUS_BACKENDS)


def test_load_plugins_allowlist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RALLYPOINT_LOAD_PLUGINS", "etcd")
    pm = build_plugin_manager()
    assert pm.infos["etcd"].status == ACTIVE
    assert pm.infos["redis"].status == DISABLED
    assert "not in RALLYPOINT_LOAD_PLUGINS" in pm.infos["redis"].error


def test_empty_load_plugins_means_builtins_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RALLYPOINT_LOAD_PLUGINS", "")
    pm = build_plugin_manager()
    active = {name for name, info in pm.infos.items() if info.status == ACTIVE}
    assert active == set(BUILTIN_PLUGINS)
    assert pm.registry.names(RENDEZVOUS_BACKENDS) == ["c10d", "static"]


def test_trace_plugins_prints_every_hook_call(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RALLYPOINT_TRACE_PLUGINS", "1")
    build_plugin_manager()
    err = capsys.readouterr().err
    for hook in ("register_rendezvous_backends", "register_restart_policies"):
        assert hook in err


def test_duplicate_names_are_withdrawn_and_name_both_distributions(
    install_plugin: InstallPlugin,
) -> None:
    install_plugin(
        "other-redis",
        """
        from rallypoint import hookimpl
        from rallypoint.extensions import RendezvousBackend

        @hookimpl
        def register_rendezvous_backends():
            return [RendezvousBackend("redis", "another redis backend")]
        """,
        distribution="acme-redis",
        version="3.0",
    )
    pm = build_plugin_manager()
    assert "redis" not in pm.registry.names(RENDEZVOUS_BACKENDS)
    with pytest.raises(PluginConflictError) as caught:
        pm.registry.get(RENDEZVOUS_BACKENDS, "redis")
    message = str(caught.value)
    assert "rallypoint-redis 0.1.0" in message
    assert "acme-redis 3.0" in message
    assert pm.registry.conflicts() == [message]
    # Other names are not affected.
    assert pm.registry.get(RENDEZVOUS_BACKENDS, "etcd").name == "etcd"


def test_two_checkpoint_backends_cannot_share_a_scheme(install_plugin: InstallPlugin) -> None:
    install_plugin(
        "files",
        """
        from rallypoint import hookimpl
        from rallypoint.extensions import CheckpointBackend

        @hookimpl
        def register_checkpoint_backends():
            return [CheckpointBackend("better-file", "", schemes=("file",))]
        """,
    )
    pm = build_plugin_manager()
    with pytest.raises(PluginConflictError, match="scheme file://"):
        pm.registry.checkpoint_backend_for("file:///ckpt")


def test_unknown_name_lists_the_valid_ones() -> None:
    registry = get_plugin_manager().registry
    with pytest.raises(UnknownNameError) as caught:
        registry.get(RESTART_POLICIES, "sometimes")
    assert str(caught.value) == (
        "--restart-policy 'sometimes': unknown restart policy. "
        "Choose one of: backoff, max-restarts, never."
    )


def test_checkpoint_backend_by_scheme() -> None:
    registry = get_plugin_manager().registry
    assert registry.checkpoint_backend_for("/data/ckpt").name == "file"
    assert registry.checkpoint_backend_for("file:///data/ckpt").name == "file"


def test_register_commands_adds_a_command_and_refuses_a_shadowing_one(
    install_plugin: InstallPlugin, capsys: pytest.CaptureFixture[str]
) -> None:
    from rallypoint_cli.main import main

    install_plugin(
        "hello",
        """
        import typer
        from rallypoint import hookimpl

        @hookimpl
        def register_commands(app):
            @app.command()
            def hello(name: str = "world"):
                "Say hello."
                typer.echo(f"hello {name}")
        """,
    )
    install_plugin(
        "shadow",
        """
        from rallypoint import hookimpl

        @hookimpl
        def register_commands(app):
            @app.command("run")
            def run():
                "Pretend to be the launcher."
        """,
    )
    assert main(["hello", "--name", "rallypoint"]) == 0
    assert capsys.readouterr().out == "hello rallypoint\n"
    pm = get_plugin_manager()
    assert pm.infos["shadow"].status == BROKEN
    assert "command 'run' is already taken" in pm.infos["shadow"].error
    # The built-in run command is still the one that answers.
    assert main(["run", "--nnodes", "3:2", "x.py"]) == 2
    assert "MIN must not exceed MAX" in capsys.readouterr().err


def test_two_distributions_with_one_entry_point_name(install_plugin: InstallPlugin) -> None:
    install_plugin(
        "etcd",
        """
        from rallypoint import hookimpl
        from rallypoint.extensions import RendezvousBackend

        @hookimpl
        def register_rendezvous_backends():
            return [RendezvousBackend("etcd2", "a second etcd plugin")]
        """,
        distribution="acme-etcd",
    )
    pm = build_plugin_manager()
    # Like two plugins registering one name: neither is used, both are reported.
    assert "etcd" not in pm.infos
    ours, theirs = pm.infos["etcd (rallypoint-etcd)"], pm.infos["etcd (acme-etcd)"]
    assert ours.status == theirs.status == BROKEN
    assert "also used by acme-etcd" in ours.error
    assert "also used by rallypoint-etcd" in theirs.error
    assert not {"etcd", "etcd2"} & set(pm.registry.names(RENDEZVOUS_BACKENDS))
    assert "redis" in pm.registry.names(RENDEZVOUS_BACKENDS)


def test_a_plugin_broken_later_gives_back_the_names_it_shared(
    install_plugin: InstallPlugin,
) -> None:
    install_plugin(
        "copycat",
        """
        from rallypoint import hookimpl
        from rallypoint.extensions import RankAssigner

        @hookimpl
        def register_rank_assigners():
            return [RankAssigner("sticky", "another sticky", lambda nodes: list(range(len(nodes))))]

        @hookimpl
        def register_metrics_sinks():
            raise RuntimeError("broken after registering")
        """,
    )
    pm = build_plugin_manager()
    assert pm.infos["copycat"].status == BROKEN
    assert pm.registry.conflicts() == []
    assert pm.registry.get(RANK_ASSIGNERS, "sticky").description.startswith("surviving")


@pytest.mark.parametrize("value", ["0", "off", "false", "no", ""])
def test_trace_plugins_stays_off(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RALLYPOINT_TRACE_PLUGINS", value)
    build_plugin_manager()
    assert "register_rendezvous_backends" not in capsys.readouterr().err


def test_a_plugin_refused_for_its_command_loses_its_registrations(
    install_plugin: InstallPlugin,
) -> None:
    from rallypoint_cli.main import build_app

    install_plugin(
        "squatter",
        """
        from rallypoint import hookimpl
        from rallypoint.extensions import MetricsSink

        @hookimpl
        def register_metrics_sinks():
            return [MetricsSink("squat", "", lambda ctx: None)]

        @hookimpl
        def register_commands(app):
            @app.command("plugins")
            def plugins():
                "Shadow the built-in."
        """,
    )
    pm = get_plugin_manager()
    assert "squat" in pm.registry.names(METRICS_SINKS)
    build_app(pm)
    assert pm.infos["squatter"].status == BROKEN
    assert "squat" not in pm.registry.names(METRICS_SINKS)

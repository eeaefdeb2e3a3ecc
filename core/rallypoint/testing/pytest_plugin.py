"""The pytest plugin of rallypoint, for testing plugins: loaded by pytest on its own.

Installing rallypoint registers it (entry point ``pytest11``, name ``rallypoint``; turn it
off with ``-p no:rallypoint``). It adds four fixtures:

``rallypoint_pm``
    A plugin manager built fresh for the test from the environment, with the installed
    plugins; it is also what ``rallypoint.plugins.get_plugin_manager()`` returns during
    the test, so the command line run in-process and ``rallypoint.checkpoint`` use it.
``rallypoint_register``
    ``rallypoint_register(plugin, name=None)`` registers a plugin object (a module,
    a class, an instance with ``@hookimpl`` functions) with that manager until the test
    ends, and returns the manager.
``rallypoint_runner``
    A ``rallypoint.testing.helpers.CliRunner`` working in the test's ``tmp_path``:
    ``invoke(*args)`` runs a command in-process, ``run(*args)`` as a subprocess; both
    return a ``CliResult`` with ``exit_code``, ``stdout`` and ``stderr``.
``rallypoint_agent_tmpdir``
    ``TMPDIR`` for the agents and workers a test starts: what they leave behind (the run
    directory of an agent that failed or was killed) lands in the test's ``tmp_path``,
    in the directory this returns, not in the machine's ``/tmp``. Use it with
    ``pytestmark = pytest.mark.usefixtures("rallypoint_agent_tmpdir")``.

The conformance suites live beside it (``rallypoint.testing.*_conformance``): subclass one
in a test module and give it the fixture it asks for.

Nothing here needs more than pytest and rallypoint itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

# The suites are imported by the tests that use them, after this: rewrite their asserts
# so that a failing check shows the values compared.
pytest.register_assert_rewrite(
    "rallypoint.testing.store_conformance",
    "rallypoint.testing.restart_policy_conformance",
    "rallypoint.testing.rank_assigner_conformance",
    "rallypoint.testing.checkpoint_storage_conformance",
    "rallypoint.testing.metrics_sink_conformance",
)

from rallypoint.plugins import PluginManager, get_plugin_manager  # noqa: E402
from rallypoint.testing.helpers import (  # noqa: E402
    CliRunner,
    fresh_plugin_manager,
    plugin_registered,
)

RegisterPlugin = Callable[..., PluginManager]


@pytest.fixture
def rallypoint_pm() -> Iterator[PluginManager]:
    """A fresh plugin manager, also the process-wide one for the test's duration."""
    pm = fresh_plugin_manager()
    yield pm
    get_plugin_manager.cache_clear()


@pytest.fixture
def rallypoint_register(rallypoint_pm: PluginManager) -> Iterator[RegisterPlugin]:
    """``rallypoint_register(plugin, name=None)``: register ``plugin`` until the test ends."""
    with ExitStack() as stack:

        def register(plugin: object, name: str | None = None) -> PluginManager:
            return stack.enter_context(plugin_registered(plugin, name, pm=rallypoint_pm))

        yield register


@pytest.fixture
def rallypoint_runner(tmp_path: Path, rallypoint_pm: PluginManager) -> CliRunner:
    """Runs ``rallypoint`` commands in ``tmp_path``, in-process or as a subprocess."""
    return CliRunner(cwd=tmp_path)


@pytest.fixture
def rallypoint_agent_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``TMPDIR`` of the agents the test starts: ``tmp_path / "agent-tmp"``."""
    agent_tmp = tmp_path / "agent-tmp"
    agent_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(agent_tmp))
    return agent_tmp

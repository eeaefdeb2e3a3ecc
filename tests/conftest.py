"""Shared fixtures: real servers (tests/servers.py), plugins installed for one test, and a
fresh plugin manager around every test."""

from __future__ import annotations

import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch import InstallPlugin
from rallypoint.config import LaunchConfig
from rallypoint.plugins import PluginManager, build_plugin_manager, get_plugin_manager
from servers import (  # noqa: F401 - pytest finds fixtures by name
    etcd_server,
    etcd_server_session,
    prometheus_server,
    prometheus_server_session,
    redis_server,
    redis_server_session,
)


@pytest.fixture(autouse=True)
def _fresh_plugin_manager() -> Iterator[None]:
    """No test sees plugins another test installed, disabled or broke."""
    get_plugin_manager.cache_clear()
    yield
    get_plugin_manager.cache_clear()


@pytest.fixture
def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InstallPlugin]:
    """Install a plugin distribution for this test: a module plus its ``.dist-info``.

    The distribution is put on ``sys.path`` and found through ``importlib.metadata`` like
    any pip-installed plugin; the returned directory can also go on ``PYTHONPATH`` for a
    ``rallypoint`` subprocess.
    """
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    modules: list[str] = []

    def install(
        name: str, source: str, *, distribution: str | None = None, version: str = "1.0.0"
    ) -> Path:
        module = f"rallypoint_test_{name.replace('-', '_')}"
        dist = distribution or f"rallypoint-test-{name}"
        modules.append(module)
        sys.modules.pop(module, None)
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[rallypoint]\n{name} = {module}\n")
        return site

    yield install
    for module in modules:
        sys.modules.pop(module, None)


@pytest.fixture
def pm() -> PluginManager:
    """A plugin manager built for this test from the current environment."""
    return build_plugin_manager()


@pytest.fixture
def agent_tmpdir(rallypoint_agent_tmpdir: Path) -> Path:
    """Run directories of failed or killed agents land in this test's temporary directory
    (the testing kit's fixture, under the name the core's tests use)."""
    return rallypoint_agent_tmpdir


@pytest.fixture
def handed_configs(monkeypatch: pytest.MonkeyPatch) -> list[LaunchConfig]:
    """The configurations ``rallypoint run`` hands its agent during the test, in order; the
    agent itself is replaced and runs nothing (its job "succeeds" at once)."""
    import rallypoint.agent.statemachine.elastic

    seen: list[LaunchConfig] = []

    class Recorder:
        def __init__(self, config: LaunchConfig, pm: object) -> None:
            seen.append(config)

        def run_job(self) -> int:
            return 0

    monkeypatch.setattr(rallypoint.agent.statemachine.elastic, "Agent", Recorder)
    return seen


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Holds every asynchronous copy (``rallypoint.checkpoint.copying``) before it copies
    anything, until the test sets it."""
    from rallypoint.checkpoint import copying

    opened = threading.Event()
    finish = copying.Copier._finish
    monkeypatch.setattr(
        copying.Copier,
        "_finish",
        lambda self, copy: (copy.asynchronous and opened.wait(30), finish(self, copy)),
    )
    return opened

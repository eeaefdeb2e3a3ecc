"""Helpers for testing plugins, with or without pytest: a fresh plugin manager, a plugin
registered for a while, and a runner for the ``rallypoint`` command line.

The pytest plugin (``rallypoint.testing.pytest_plugin``) wraps each in a fixture; these
functions are for tests that want them elsewhere (a ``unittest`` case, a script).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rallypoint.plugins import PluginInfo, PluginManager, get_plugin_manager
from rallypoint.registry import Registry

#: Launcher settings a test's environment must not pass on to ``rallypoint``: a test run
#: under ``rallypoint run`` (or in a Kubeflow pod) would otherwise leak its own.
_LAUNCHER_PREFIXES = ("RALLYPOINT_", "PET_", "TORCHELASTIC_")
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def fresh_plugin_manager() -> PluginManager:
    """Forget the process-wide plugin manager and build a new one from ``os.environ``.

    The new one is what ``rallypoint.plugins.get_plugin_manager()`` returns from now on,
    so the command line (run in-process), ``rallypoint.checkpoint`` and the agent all see
    the plugins installed, disabled or registered since.
    """
    get_plugin_manager.cache_clear()
    return get_plugin_manager()


def recollect(pm: PluginManager) -> None:
    """Collect ``pm``'s registrations again, after a plugin was added or removed."""
    for info in pm.infos.values():
        info.registered = {}
    pm.registry = Registry.collect(pm)


@contextlib.contextmanager
def plugin_registered(
    plugin: object,
    name: str | None = None,
    *,
    pm: PluginManager | None = None,
    distribution: str = "test",
    version: str = "0",
) -> Iterator[PluginManager]:
    """Register ``plugin`` (a module, class or object with ``@hookimpl`` functions) with
    ``pm`` (default: the process-wide plugin manager) while the block runs.

    Its registrations are collected at once, so ``pm.registry`` and the command line
    know its names. A plugin rallypoint refuses (a misspelt hook, a registration of the
    wrong type) raises ``ValueError`` with the reason ``rallypoint plugins`` would show.
    Afterwards the plugin is unregistered and its names are gone again.
    """
    pm = get_plugin_manager() if pm is None else pm
    name = name or getattr(plugin, "__name__", None) or f"test-plugin-{id(plugin):x}"
    if name in pm.infos:
        raise ValueError(f"a plugin named {name!r} is already registered; pass another name")
    info = PluginInfo(name, distribution, version)
    try:
        if not pm.add_plugin(plugin, info):
            raise ValueError(f"plugin {name!r} is broken: {info.error}")
        recollect(pm)
        if info.status != "active":
            raise ValueError(f"plugin {name!r} is broken: {info.error}")
        yield pm
    finally:
        if pm.get_plugin(name) is not None:
            pm.unregister(name=name)
        pm.infos.pop(name, None)
        recollect(pm)


@dataclass(frozen=True)
class CliResult:
    """What a ``rallypoint`` command did: its exit code and everything it printed."""

    exit_code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """stdout and stderr together, for messages in assertions."""
        return self.stdout + self.stderr


class CliRunner:
    """Runs ``rallypoint`` commands for a test, in this process or as a subprocess.

    In-process (``invoke``) is fast and sees plugins registered with
    ``plugin_registered``; a subprocess (``run``) is what a user gets: a new interpreter
    that finds plugins only through their entry points, and the only way to run a job.
    """

    def __init__(self, cwd: str | Path | None = None, timeout: float = 120.0) -> None:
        self.cwd = None if cwd is None else Path(cwd)
        self.timeout = timeout

    def invoke(self, *args: str, env: Mapping[str, str] | None = None) -> CliResult:
        """Run ``rallypoint ARGS`` in this process.

        ``env`` adds environment variables for the call; since the plugin switches are
        read when the plugin manager is built, the plugin manager is then rebuilt before
        and after the call (and plugins registered with ``plugin_registered`` are not seen).
        """
        from rallypoint_cli.main import main

        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.ExitStack() as stack:
            if env:
                stack.enter_context(_environment(env))
                stack.callback(get_plugin_manager.cache_clear)
                get_plugin_manager.cache_clear()
            if self.cwd is not None:
                stack.enter_context(_working_directory(self.cwd))
            stack.enter_context(contextlib.redirect_stdout(stdout))
            stack.enter_context(contextlib.redirect_stderr(stderr))
            try:
                code = main(list(args))
            except SystemExit as done:  # a command that exits itself
                code = done.code if isinstance(done.code, int) else 1
        return CliResult(code, stdout.getvalue(), stderr.getvalue())

    def run(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        pythonpath: Sequence[str | Path] = (),
    ) -> CliResult:
        """Run the ``rallypoint`` console script of this interpreter as a subprocess.

        The subprocess gets this process's environment without launcher settings
        (``RALLYPOINT_*``, ``PET_*``, ``TORCHELASTIC_*``, ``RANK``...), plus ``env``;
        ``pythonpath`` entries go first on its ``PYTHONPATH`` (a directory a plugin was
        installed into with ``pip install --target``). A run that outlives ``timeout``
        seconds is killed and raises ``subprocess.TimeoutExpired``.
        """
        environment = clean_environment(env)
        if pythonpath:
            paths = [str(path) for path in pythonpath]
            if environment.get("PYTHONPATH"):
                paths.append(environment["PYTHONPATH"])
            environment["PYTHONPATH"] = os.pathsep.join(paths)
        completed = subprocess.run(
            [rallypoint_executable(), *args],
            env=environment,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=self.timeout if timeout is None else timeout,
        )
        return CliResult(completed.returncode, completed.stdout, completed.stderr)


def rallypoint_executable() -> str:
    """The ``rallypoint`` console script installed beside this interpreter."""
    script = Path(sys.executable).parent / "rallypoint"
    if not script.exists():
        raise FileNotFoundError(
            f"no rallypoint console script at {script}: install rallypoint in this environment"
        )
    return str(script)


def clean_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher settings, plus ``extra``."""
    base = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(_LAUNCHER_PREFIXES) and key not in _LAUNCHER_VARIABLES
    }
    return {**base, **(extra or {})}


@contextlib.contextmanager
def _environment(changes: Mapping[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _working_directory(path: Path) -> Iterator[None]:
    # contextlib.chdir is new in Python 3.11; rallypoint supports 3.10.
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)

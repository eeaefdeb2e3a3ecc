"""Helpers for testing plugins, with or without pytest: a fresh plugin manager, a plugin
registered for a while, and a runner for the ``rallypoint`` command line.

The pytest plugin (``rallypoint.testing.pytest_plugin``) wraps each in a fixture; these
functions are for tests that want them elsewhere (a ``unittest`` case, a script).

A plugin's tests import ``rallypoint.sdk`` and this kit (and where a test plays a training
script, what scripts import: ``rallypoint.checkpoint``, ``rallypoint.metrics``); what they
need of the plugin manager and of the core is here too:

* ``PluginManager``: the type of the ``rallypoint_pm`` fixture, for annotations; its
  ``infos[name]`` says a plugin's ``status``, ``error`` and what it ``registered``.
* ``build_plugin_manager(environ=None)``: a new plugin manager, not the process-wide one,
  built from ``environ`` (default ``os.environ``); ``{}`` ignores the plugin switches
  (``RALLYPOINT_DISABLE_PLUGINS``...) of the environment the tests run in.
* ``registered(kind, name)`` and ``checkpoint_backend_for(url)``: a registration looked up
  as the command line and the workers look it up.
* ``RetryingStore(store, retry_timeout)``: a coordination store wrapped as the rendezvous
  protocol wraps it, retrying ``StoreUnavailable`` for ``retry_timeout`` seconds.
* ``checkpoint_directory(step)``, ``checkpoint_step(name)`` and ``CHECKPOINT_MANIFEST``:
  where ``rallypoint.checkpoint`` puts a checkpoint's files in a checkpoint storage.
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
from typing import TYPE_CHECKING, TypeVar

from rallypoint.checkpoint import manifest as _manifest
from rallypoint.plugins import PluginInfo, get_plugin_manager
from rallypoint.plugins import PluginManager as PluginManager
from rallypoint.plugins import build_plugin_manager as build_plugin_manager
from rallypoint.registry import KINDS
from rallypoint.rendezvous.retrying import RetryingStore as RetryingStore

if TYPE_CHECKING:
    from rallypoint.sdk import CheckpointBackend

T = TypeVar("T")

#: The file of a checkpoint written last, once its payload files are complete.
CHECKPOINT_MANIFEST = _manifest.MANIFEST

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
    pm.collect()


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


def registered(kind: type[T], name: str, pm: PluginManager | None = None) -> T:
    """The registration called ``name`` of the extension point whose dataclass is ``kind``
    (``rallypoint.sdk.RestartPolicy``, ``MetricsSink``...), looked up in ``pm`` (default:
    the process-wide plugin manager) as ``rallypoint run`` looks up its flags' values.

    A name no active plugin registers raises the ``UsageError`` a user would see, which
    lists the names there are; a name two plugins register, the error that names both.
    """
    pm = get_plugin_manager() if pm is None else pm
    for point in KINDS:
        if point.type is kind:
            found: T = pm.registry.get(point, name)
            return found
    names = ", ".join(point.type.__name__ for point in KINDS)
    raise TypeError(f"{kind.__name__} is no extension point's registration; one of: {names}")


def checkpoint_backend_for(url: str, pm: PluginManager | None = None) -> CheckpointBackend:
    """The checkpoint backend that opens ``url`` (a ``--checkpoint-dir``), chosen by its
    scheme in ``pm`` (default: the process-wide plugin manager) as the workers choose it."""
    pm = get_plugin_manager() if pm is None else pm
    return pm.registry.checkpoint_backend_for(url)


def checkpoint_directory(step: int) -> str:
    """The prefix of the checkpoint of ``step`` in a checkpoint storage: its files are
    ``<prefix>/<file>``, ``CHECKPOINT_MANIFEST`` among them."""
    return _manifest.directory(step)


def checkpoint_step(name: str) -> int | None:
    """The step of the checkpoint prefix ``name`` (as ``checkpoint_directory`` makes it), or
    ``None`` for a name that is not one."""
    return _manifest.step_of(name)


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

"""Finding, loading and describing plugins.

Built-in plugins are modules of this package registered exactly like installed ones; then
every entry point of the ``rallypoint`` group is loaded on its own, so a plugin that fails
to import, has a misspelt hook or registers something malformed is listed as broken and
skipped, and the command line keeps working.

Environment switches (read when the plugin manager is first built):

* ``RALLYPOINT_DISABLE_PLUGINS=a,b`` - do not load these plugins (entry-point names, or the
  module names of built-ins).
* ``RALLYPOINT_LOAD_PLUGINS=a,b`` - load only these installed plugins; set but empty means
  built-ins only.
* ``RALLYPOINT_TRACE_PLUGINS=1`` - print every hook call and its result to stderr.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from rallypoint import __version__, hookspecs
from rallypoint.errors import one_line
from rallypoint.registry import Registry

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rallypoint"

BUILTIN_PLUGINS: tuple[str, ...] = (
    "rallypoint.builtins.rendezvous_backends",
    "rallypoint.builtins.restart_policies",
    "rallypoint.builtins.rank_assigners",
    "rallypoint.builtins.checkpoint_backends",
    "rallypoint.builtins.metrics_sinks",
)

ACTIVE = "active"
BROKEN = "broken"
DISABLED = "disabled"


@dataclass
class PluginInfo:
    """What ``rallypoint plugins`` shows about one plugin.

    Attributes:
        name: the entry-point name, or the module name of a built-in.
        distribution: the distribution that installed it (``rallypoint`` for built-ins).
        version: that distribution's version.
        status: ``active``, ``broken`` or ``disabled``.
        error: why it is broken or disabled, one line.
        hooks: the hooks it implements.
        registered: the names it registers, by extension point.
    """

    name: str
    distribution: str
    version: str
    status: str = ACTIVE
    error: str = ""
    hooks: tuple[str, ...] = ()
    registered: dict[str, list[str]] = field(default_factory=dict)

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN_PLUGINS

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "builtin": self.builtin,
            "status": self.status,
            "error": self.error,
            "hooks": list(self.hooks),
            "registered": self.registered,
        }


class PluginManager(pluggy.PluginManager):
    """pluggy's manager plus what rallypoint knows about each plugin."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.registry = Registry()

    def add_plugin(self, plugin: object, info: PluginInfo) -> bool:
        """Register ``plugin``; on any validation error keep it out and mark it broken."""
        self.infos[info.name] = info
        try:
            wrong = self._wrong_hooks(plugin)
            if wrong is None:
                self.register(plugin, name=info.name)
        except Exception as error:  # a plugin may fail in any way; it must not stop us
            wrong = one_line(error)
        if wrong is not None:
            self.mark_broken(info.name, wrong)
            return False
        callers = self.get_hookcallers(plugin) or []
        info.hooks = tuple(sorted(caller.name for caller in callers))
        return True

    def _wrong_hooks(self, plugin: object) -> str | None:
        """Why ``plugin`` is refused, before pluggy sees it, else None: every hook it
        implements that rallypoint does not have (with the closest names), and every
        argument it asks for that its hook does not pass. One sentence for all of them,
        rather than pluggy's ``PluginValidationError`` for the first.

        An implementation marked ``optionalhook`` may name a hook this rallypoint lacks.
        """
        specs = {
            name: caller.spec.argnames
            for name, caller in vars(self.hook).items()
            if not name.startswith("_") and caller.has_spec() and caller.spec is not None
        }
        problems = []
        for attribute in sorted(dir(plugin)):
            options = self.parse_hookimpl_opts(plugin, attribute)
            if options is None:
                continue
            hook = options.get("specname") or attribute
            if hook not in specs:
                if not options.get("optionalhook"):
                    problems.append(_unknown_hook(hook, sorted(specs)))
                continue
            asked = _required_arguments(getattr(plugin, attribute))
            extra = [name for name in asked if name not in specs[hook]]
            if extra:
                given = ", ".join(specs[hook]) or "no argument"
                problems.append(
                    f"{hook}({', '.join(asked)}) asks for {', '.join(map(repr, extra))}, "
                    f"which rallypoint does not pass (it passes {given})"
                )
        return "; ".join(problems) or None

    def mark_broken(self, name: str, error: BaseException | str) -> None:
        """Unregister plugin ``name``, forget what it registered and record why."""
        info = self.infos[name]
        info.status = BROKEN
        info.error = one_line(error)
        plugin = self.get_plugin(name)
        if plugin is not None:
            self.unregister(plugin)
        self.registry.forget(name)
        self.registry.broken[name] = info.error

    def collect(self) -> None:
        """Collect every plugin's registrations into ``registry`` afresh, and mark broken
        the plugins whose registrations are unusable."""
        found = Registry.collect(self.implementations, self.infos)
        self.registry = found.registry
        self.registry.broken = {n: i.error for n, i in self.infos.items() if i.status == BROKEN}
        for name, info in self.infos.items():
            info.registered = found.registered.get(name, {})
        for name, why in found.broken.items():
            self.mark_broken(name, why)

    def implementations(
        self, hook_name: str, **kwargs: Any
    ) -> list[tuple[str, Callable[[], list[Any]]]]:
        """Each plugin implementing ``hook_name``, with a call of its implementation alone
        (through pluggy, and so through tracing) that returns its results."""
        caller = getattr(self.hook, hook_name)
        found: list[tuple[str, Callable[[], list[Any]]]] = []
        for impl in list(caller.get_hookimpls()):
            name = self.get_name(impl.plugin)
            if name is None:
                continue
            others = [p for p in self.get_plugins() if p is not impl.plugin]
            single = self.subset_hook_caller(hook_name, remove_plugins=others)
            found.append((name, functools.partial(_results, single, kwargs)))
        return found

    def call_each(
        self, hook_name: str, *, break_on_error: bool = True, **kwargs: Any
    ) -> Iterator[tuple[str, list[Any] | None]]:
        """Call one hook plugin by plugin, yielding ``(plugin name, results)``.

        A plugin whose implementation raises yields ``None`` for its results, so one bad
        plugin cannot keep the others from being called, and callers can undo what it did
        before failing. With ``break_on_error`` (registration hooks) it is also marked
        broken; otherwise (lifecycle hooks) the error is logged and it stays loaded.
        """
        for name, call in self.implementations(hook_name, **kwargs):
            try:
                results = call()
            except Exception as error:
                if break_on_error:
                    self.mark_broken(name, f"{hook_name} failed: {one_line(error)}")
                else:
                    logger.warning("plugin %r: %s failed: %s", name, hook_name, one_line(error))
                yield name, None
                continue
            yield name, results


def _results(caller: Callable[..., Any], kwargs: Mapping[str, Any]) -> list[Any]:
    return list(caller(**kwargs))


def _names(value: str) -> set[str]:
    return {part.strip() for part in value.split(",") if part.strip()}


def _dist_name(entry_point: importlib.metadata.EntryPoint) -> str:
    return entry_point.dist.name if entry_point.dist else "?"


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)


def build_plugin_manager(environ: Mapping[str, str] | None = None) -> PluginManager:
    """Build a new plugin manager from the built-ins and the installed entry points.

    ``environ`` defaults to ``os.environ``; tests pass their own mapping.
    """
    env = os.environ if environ is None else environ
    disabled = _names(env.get("RALLYPOINT_DISABLE_PLUGINS", ""))
    allowlist = _names(env["RALLYPOINT_LOAD_PLUGINS"]) if "RALLYPOINT_LOAD_PLUGINS" in env else None

    pm = PluginManager()
    if env.get("RALLYPOINT_TRACE_PLUGINS", "").strip().lower() in ("1", "true", "yes", "on"):
        pm.trace.root.setwriter(sys.stderr.write)
        pm.enable_tracing()

    for module_name in BUILTIN_PLUGINS:
        info = PluginInfo(module_name, "rallypoint", __version__)
        if module_name in disabled:
            info.status, info.error = DISABLED, "disabled by RALLYPOINT_DISABLE_PLUGINS"
            pm.infos[module_name] = info
            continue
        pm.add_plugin(importlib.import_module(module_name), info)

    entry_points = _entry_points()
    claimed: dict[str, set[str]] = {}
    for entry_point in entry_points:
        claimed.setdefault(entry_point.name, set()).add(_dist_name(entry_point))
    for entry_point in entry_points:
        dist = entry_point.dist
        info = PluginInfo(entry_point.name, _dist_name(entry_point), dist.version if dist else "?")
        rivals = sorted({d for d in claimed[entry_point.name] if d != info.distribution})
        if rivals:
            # Two distributions claim one entry-point name: neither is loaded, as with names.
            info.name = f"{entry_point.name} ({info.distribution})"
            info.status = BROKEN
            info.error = (
                f"entry point name {entry_point.name!r} is also used by {', '.join(rivals)}; "
                "uninstall one of them"
            )
            pm.infos[info.name] = info
            continue
        if entry_point.name in disabled:
            info.status, info.error = DISABLED, "disabled by RALLYPOINT_DISABLE_PLUGINS"
            pm.infos[info.name] = info
            continue
        if allowlist is not None and entry_point.name not in allowlist:
            info.status, info.error = DISABLED, "not in RALLYPOINT_LOAD_PLUGINS"
            pm.infos[info.name] = info
            continue
        try:
            plugin = entry_point.load()
        except Exception as error:  # an import error of any kind makes the plugin broken
            info.status, info.error = BROKEN, f"failed to load: {one_line(error)}"
            pm.infos[info.name] = info
            continue
        pm.add_plugin(plugin, info)

    pm.collect()
    return pm


@functools.cache
def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, built on first use from ``os.environ``.

    Call ``get_plugin_manager.cache_clear()`` to rebuild it (tests do, after installing or
    disabling a plugin).
    """
    return build_plugin_manager()


def _unknown_hook(hook: str, hooks: list[str]) -> str:
    # Hook names share their "register_" or "on_": at the default cutoff (0.6) unrelated
    # hooks come close.
    close = difflib.get_close_matches(hook, hooks, cutoff=0.7)
    if not close:
        return f"unknown hook {hook!r}: rallypoint has no hook like it"
    return f"unknown hook {hook!r}: did you mean {' or '.join(map(repr, close))}?"


def _required_arguments(function: Callable[..., Any]) -> list[str]:
    """The arguments pluggy passes to an implementation: those without a default."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds and p.default is p.empty]

"""All named implementations, collected in one place and looked up by name.

``Registry.collect`` calls every ``register_*`` hook plugin by plugin, checks what comes
back, and files each registration under its extension point. A name registered by two
plugins is withdrawn: looking it up raises an error naming both distributions, while every
other name keeps working.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rallypoint.errors import PluginConflictError, UnknownNameError, UsageError
from rallypoint.extensions import (
    CheckpointBackend,
    MetricsSink,
    RankAssigner,
    RendezvousBackend,
    RestartPolicy,
)

if TYPE_CHECKING:
    from rallypoint.plugins import PluginManager

T = TypeVar("T")


@dataclass(frozen=True)
class Kind(Generic[T]):
    """One extension point: the hook that fills it, what users call it, and its type."""

    hook: str
    label: str
    flag: str
    type: type[T]


RENDEZVOUS_BACKENDS = Kind(
    "register_rendezvous_backends", "rendezvous backend", "--rdzv-backend", RendezvousBackend
)
RESTART_POLICIES = Kind(
    "register_restart_policies", "restart policy", "--restart-policy", RestartPolicy
)
RANK_ASSIGNERS = Kind("register_rank_assigners", "rank assigner", "--rank-assigner", RankAssigner)
CHECKPOINT_BACKENDS = Kind(
    "register_checkpoint_backends", "checkpoint backend", "--checkpoint-dir", CheckpointBackend
)
METRICS_SINKS = Kind("register_metrics_sinks", "metrics sink", "--metrics", MetricsSink)

KINDS: tuple[Kind[Any], ...] = (
    RENDEZVOUS_BACKENDS,
    RESTART_POLICIES,
    RANK_ASSIGNERS,
    CHECKPOINT_BACKENDS,
    METRICS_SINKS,
)


@dataclass(frozen=True)
class Registered(Generic[T]):
    """A registration and the plugin it came from."""

    item: T
    plugin: str
    distribution: str
    version: str

    @property
    def provider(self) -> str:
        return f"{self.distribution} {self.version} (plugin {self.plugin!r})"


class Registry:
    """Registrations by extension point and name."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Registered[Any]]] = {k.hook: {} for k in KINDS}
        self._conflicts: dict[str, dict[str, list[Registered[Any]]]] = {k.hook: {} for k in KINDS}

    @classmethod
    def collect(cls, pm: PluginManager) -> Registry:
        """Call every ``register_*`` hook of ``pm`` and file what it returns."""
        registry = cls()
        for kind in KINDS:
            for plugin_name, results in pm.call_each(kind.hook):
                if results is None:
                    continue
                info = pm.infos[plugin_name]
                try:
                    items = [item for result in results for item in _check_items(kind, result)]
                except TypeError as error:
                    pm.mark_broken(plugin_name, f"{kind.hook}: {error}")
                    continue
                for item in items:
                    registered = Registered(item, plugin_name, info.distribution, info.version)
                    registry._add(kind, item.name, registered)
                    info.registered.setdefault(kind.label, []).append(item.name)
        registry._check_schemes()
        for name, info in pm.infos.items():
            if info.status != "active":
                registry.forget(name)
        return registry

    def _add(self, kind: Kind[Any], key: str, registered: Registered[Any]) -> None:
        conflicts = self._conflicts[kind.hook]
        entries = self._entries[kind.hook]
        if key in conflicts:
            conflicts[key].append(registered)
        elif key in entries:
            conflicts[key] = [entries.pop(key), registered]
        else:
            entries[key] = registered

    def _check_schemes(self) -> None:
        """Two checkpoint backends may not serve one URL scheme: both are withdrawn."""
        table = self._entries[CHECKPOINT_BACKENDS.hook]
        by_scheme: dict[str, list[Registered[Any]]] = {}
        for registered in table.values():
            for scheme in registered.item.schemes:
                by_scheme.setdefault(scheme, []).append(registered)
        for scheme, providers in by_scheme.items():
            if len(providers) > 1:
                self._conflicts[CHECKPOINT_BACKENDS.hook][f"scheme {scheme}://"] = providers
                for registered in providers:
                    table.pop(registered.item.name, None)

    def forget(self, plugin_name: str) -> None:
        """Drop every registration of a plugin found broken after it registered.

        A name it shared with another plugin is no longer in conflict: the other keeps it.
        """
        for hook, table in self._entries.items():
            for key in [k for k, r in table.items() if r.plugin == plugin_name]:
                del table[key]
            conflicts = self._conflicts[hook]
            for key, providers in list(conflicts.items()):
                remaining = [r for r in providers if r.plugin != plugin_name]
                if len(remaining) == len(providers):
                    continue
                del conflicts[key]
                if len(remaining) == 1:
                    table[remaining[0].item.name] = remaining[0]
                elif remaining:
                    conflicts[key] = remaining

    # --- lookups ----------------------------------------------------------------------

    def names(self, kind: Kind[Any]) -> list[str]:
        """The usable names of ``kind``, sorted."""
        return sorted(self._entries[kind.hook])

    def entries(self, kind: Kind[T]) -> list[Registered[T]]:
        """The usable registrations of ``kind``, sorted by name."""
        table = self._entries[kind.hook]
        return [table[name] for name in sorted(table)]

    def conflicts(self) -> list[str]:
        """One sentence per name that two or more plugins registered."""
        return [
            _conflict_message(kind, key, providers)
            for kind in KINDS
            for key, providers in sorted(self._conflicts[kind.hook].items())
        ]

    def get(self, kind: Kind[T], name: str) -> T:
        """The registration of ``kind`` called ``name``.

        Raises:
            UnknownNameError: no plugin registers ``name``; the message lists valid names.
            PluginConflictError: two plugins register ``name``; the message names both.
        """
        key = name.strip().lower()
        providers = self._conflicts[kind.hook].get(key)
        if providers:
            raise PluginConflictError(_conflict_message(kind, key, providers))
        try:
            return self._entries[kind.hook][key].item  # type: ignore[no-any-return]
        except KeyError:
            raise UnknownNameError(kind.label, name, self.names(kind), flag=kind.flag) from None

    def checkpoint_backend_for(self, url: str) -> CheckpointBackend:
        """The checkpoint backend serving ``url``'s scheme (a plain path has scheme ``""``)."""
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        key = f"scheme {scheme}://"
        providers = self._conflicts[CHECKPOINT_BACKENDS.hook].get(key)
        if providers:
            raise PluginConflictError(_conflict_message(CHECKPOINT_BACKENDS, key, providers))
        stores = self.entries(CHECKPOINT_BACKENDS)
        for registered in stores:
            if scheme in registered.item.schemes:
                return registered.item
        served = sorted(f"{s}://" if s else "a plain path" for r in stores for s in r.item.schemes)
        raise UsageError(
            f"--checkpoint-dir {url!r}: no checkpoint backend serves {scheme}:// URLs. "
            f"Choose one of: {', '.join(served) or '(none installed)'}."
        )


def _check_items(kind: Kind[Any], result: object) -> list[Any]:
    if result is None:
        return []
    if isinstance(result, kind.type):
        return [result]
    if not isinstance(result, Iterable) or isinstance(result, (str, bytes)):
        raise TypeError(f"expected a list of {kind.type.__name__}, got {type(result).__name__}")
    items = list(result)
    for item in items:
        if not isinstance(item, kind.type):
            raise TypeError(f"expected {kind.type.__name__}, got {type(item).__name__}")
    return items


def _conflict_message(kind: Kind[Any], key: str, providers: list[Registered[Any]]) -> str:
    who = " and by ".join(p.provider for p in providers)
    what = key if key.startswith("scheme ") else repr(key)
    return (
        f"Conflicting plugins: {kind.label} {what} is registered by {who}; "
        "uninstall one or disable it with RALLYPOINT_DISABLE_PLUGINS."
    )

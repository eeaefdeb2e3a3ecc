"""All named implementations, collected in one place and looked up by name.

``Registry.collect`` calls every ``register_*`` hook plugin by plugin, checks what comes
back, files each registration under its extension point, and returns that with what it
found wrong: the plugin manager marks those plugins broken. A name registered by two
plugins is withdrawn: looking it up raises an error naming both distributions, while every
other name keeps working.

Each registration is also marked with who registered it (as pluggy marks a hook
implementation), so that code handed only the registration, such as the rendezvous protocol
calling its rank assigner, can still name the plugin and its distribution when the
plugin's code fails at run time (``plugin_failure``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from rallypoint.errors import (
    PluginConflictError,
    UnknownNameError,
    UsageError,
    broken_hint,
    one_line,
)
from rallypoint.extensions import (
    CheckpointBackend,
    MetricsSink,
    RankAssigner,
    RendezvousBackend,
    RestartPolicy,
)

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
    label: str = ""  # the extension point's, as ``Kind.label``

    @property
    def provider(self) -> str:
        return f"{self.distribution} {self.version} (plugin {self.plugin!r})"

    def describe(self) -> str:
        """``the 'NAME' KIND of plugin 'PLUGIN' (distribution DIST VERSION)``."""
        return (
            f"the {getattr(self.item, 'name', '?')!r} {self.label} of plugin {self.plugin!r} "
            f"(distribution {self.distribution} {self.version})"
        )


class Provider(Protocol):
    """What a registration records of the plugin it came from (``PluginInfo`` is one)."""

    @property
    def distribution(self) -> str: ...

    @property
    def version(self) -> str: ...


#: A hook's implementations, one per plugin: its name and a call of that plugin's alone.
Implementations = Callable[[str], Iterable[tuple[str, Callable[[], list[Any]]]]]


@dataclass
class Collected:
    """What ``Registry.collect`` found.

    Attributes:
        registry: the usable registrations.
        registered: the names each plugin registers, by plugin, then by ``Kind.label``.
        broken: why each plugin found broken is (one line); none of its registrations is
            in ``registry``.
    """

    registry: Registry
    registered: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)


class Registry:
    """Registrations by extension point and name."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Registered[Any]]] = {k.hook: {} for k in KINDS}
        self._conflicts: dict[str, dict[str, list[Registered[Any]]]] = {k.hook: {} for k in KINDS}
        #: The installed plugins found broken (name -> why): a name none registers may be
        #: one of theirs, and a lookup says so.
        self.broken: dict[str, str] = {}

    @classmethod
    def collect(
        cls, implementations: Implementations, providers: Mapping[str, Provider]
    ) -> Collected:
        """Call every ``register_*`` hook, plugin by plugin, and file what each returns.

        ``implementations(hook)`` gives each plugin implementing ``hook`` with a call of its
        implementation; ``providers`` describes each plugin by name. A plugin whose hook
        raises or returns something else than registrations is broken: its other hooks
        are not called, and nothing it registered is kept.
        """
        found = Collected(cls())
        registry = found.registry
        for kind in KINDS:
            for plugin_name, call in implementations(kind.hook):
                if plugin_name in found.broken:
                    continue
                try:
                    results = call()
                except Exception as error:  # a plugin may fail in any way; it must not stop us
                    found.broken[plugin_name] = f"{kind.hook} failed: {one_line(error)}"
                    continue
                try:
                    items = [item for result in results for item in _check_items(kind, result)]
                except TypeError as error:
                    found.broken[plugin_name] = f"{kind.hook}: {error}"
                    continue
                provider = providers[plugin_name]
                names = found.registered.setdefault(plugin_name, {})
                for item in items:
                    registered = Registered(
                        item, plugin_name, provider.distribution, provider.version, kind.label
                    )
                    registry._add(kind, item.name, registered)
                    _mark(item, registered)
                    names.setdefault(kind.label, []).append(item.name)
        registry._check_schemes()
        for plugin_name in found.broken:
            registry.forget(plugin_name)
        return found

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
            raise UnknownNameError(
                kind.label, name, self.names(kind), flag=kind.flag, broken=self.broken
            ) from None

    def check_checkpoint_dir(self, url: str) -> CheckpointBackend:
        """The backend serving ``--checkpoint-dir url``, once it accepted ``url``
        (``CheckpointBackend.check``); a ``UsageError`` naming the flag otherwise."""
        backend = self.checkpoint_backend_for(url)
        if backend.check is None:
            return backend
        try:
            backend.check(url)
        except ValueError as error:
            raise UsageError(f"--checkpoint-dir {url!r}: {error}") from None
        except Exception as error:  # a plugin's bug: one sentence naming it, no traceback
            who = describe(CHECKPOINT_BACKENDS, backend)
            raise UsageError(
                plugin_failure(who, "check", error, "the job does not start")
            ) from None
        return backend

    def checkpoint_backend_for(self, url: str) -> CheckpointBackend:
        """The checkpoint backend serving ``url``'s scheme (a plain path has scheme ``""``,
        see ``url_scheme``)."""
        scheme = url_scheme(url)
        key = f"scheme {scheme}://"
        providers = self._conflicts[CHECKPOINT_BACKENDS.hook].get(key)
        if providers:
            raise PluginConflictError(_conflict_message(CHECKPOINT_BACKENDS, key, providers))
        stores = self.entries(CHECKPOINT_BACKENDS)
        for registered in stores:
            if scheme in registered.item.schemes:
                return registered.item
        served = sorted(f"{s}://" if s else "a plain path" for r in stores for s in r.item.schemes)
        plain = "" if "://" in url else f" (a relative path that has a colon: ./{url})"
        raise UsageError(
            f"--checkpoint-dir {url!r}: no checkpoint backend serves {scheme}:// URLs. "
            f"Choose one of: {', '.join(served) or '(none installed)'}{plain}."
            f"{broken_hint(self.broken)}"
        )


#: A URL's scheme, as RFC 3986 spells one: a letter, then letters, digits, ``+``, ``-``, ``.``.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def url_scheme(url: str) -> str:
    """The scheme of a ``--checkpoint-dir`` value, lower-cased; ``""`` for a plain path.

    ``s3://bucket/x`` and ``acme:/data/x`` (a URL with one slash, or none, after its
    scheme) both have one: a value that starts as a scheme does is a URL, never a relative
    path that happens to hold a colon (``./acme:x`` is one)."""
    found = _SCHEME.match(url)
    return found.group(1).lower() if found else ""


#: The attribute of a registration that holds its ``Registered``.
_MARK = "_rallypoint_registered"


def _mark(item: object, registered: Registered[Any]) -> None:
    # A registration type of a plugin's own may refuse attributes (__slots__): it is
    # then described by its name alone.
    with contextlib.suppress(AttributeError, TypeError):
        object.__setattr__(item, _MARK, registered)


def registration_of(item: object) -> Registered[Any] | None:
    """Who registered ``item``, as the last registry that collected it recorded; None for
    a registration no registry collected (one made in place, as the static backend's)."""
    registered = getattr(item, _MARK, None)
    return registered if isinstance(registered, Registered) else None


def replace_registration(item: T, **changes: Any) -> T:
    """``dataclasses.replace(item, **changes)`` that keeps who registered ``item``."""
    replaced = dataclasses.replace(item, **changes)  # type: ignore[type-var]
    registered = registration_of(item)
    if registered is not None:
        _mark(replaced, registered)
    return replaced


def describe(kind: Kind[Any], item: object) -> str:
    """``the 'NAME' KIND of plugin 'PLUGIN' (distribution DIST VERSION)``, or without the
    plugin when no registry collected ``item``."""
    registered = registration_of(item)
    if registered is not None:
        return registered.describe()
    return f"the {getattr(item, 'name', '?')!r} {kind.label}"


def plugin_failure(who: str, hook: str, error: BaseException, outcome: str) -> str:
    """One sentence for a plugin's code that raised at run time: ``who`` (``describe``)
    raised what in ``hook``, then ``outcome``: what becomes of it and of the job."""
    return f"{who} raised in {hook}: {one_line(error)}; {outcome}"


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

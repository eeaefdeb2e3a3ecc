"""``rallypoint plugins``: what is installed, what each plugin registers, what is broken;
``rallypoint plugins new``: a new plugin from the templates of ``rallypoint.scaffold``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from rallypoint import scaffold
from rallypoint.plugins import BROKEN, PluginManager
from rallypoint.registry import CHECKPOINT_BACKENDS, KINDS, Registry

#: The flag whose ``key=value`` list sets the options of each kind of registration.
OPTION_FLAGS = {
    "rendezvous backend": "--rdzv-conf",
    "restart policy": "--restart-conf",
    "rank assigner": "--rank-conf",
    "metrics sink": "--metrics-conf",
}


def _choices(registry: Registry) -> dict[str, list[str]]:
    """Usable names by extension point; for checkpoint backends, the URL schemes they serve."""
    choices = {kind.label: registry.names(kind) for kind in KINDS}
    choices[CHECKPOINT_BACKENDS.label] = sorted(
        f"{scheme}://" if scheme else "a plain path"
        for entry in registry.entries(CHECKPOINT_BACKENDS)
        for scheme in entry.item.schemes
    )
    return choices


def _options(registry: Registry) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Declared ``key=value`` options, by extension point and name."""
    return {
        kind.label: {
            entry.item.name: [option.to_dict() for option in entry.item.options]
            for entry in registry.entries(kind)
            if getattr(entry.item, "options", ())
        }
        for kind in KINDS
        if kind.label in OPTION_FLAGS
    }


def register(app: typer.Typer, pm: PluginManager) -> None:
    group = typer.Typer(
        name="plugins",
        help="List installed plugins, or start a new one (`rallypoint plugins new`).",
        invoke_without_command=True,
        no_args_is_help=False,
    )

    @group.callback(invoke_without_command=True)
    def plugins(
        ctx: typer.Context,
        as_json: bool = typer.Option(False, "--json", help="Print JSON for tools."),
        check: bool = typer.Option(
            False,
            "--check",
            help="Exit 1 when an installed plugin is broken (for CI), after the listing.",
        ),
    ) -> None:
        """List installed plugins: name, version, status, hooks and registered names."""
        if ctx.invoked_subcommand is None:
            _list(pm, as_json)
            broken = sorted(name for name, info in pm.infos.items() if info.status == BROKEN)
            if check and broken:
                typer.echo(
                    f"error: broken plugin{'s' if len(broken) > 1 else ''}: "
                    f"{', '.join(broken)} (see the error line under each)",
                    err=True,
                )
                raise typer.Exit(1)

    @group.command("new")
    def new(
        name: str = typer.Argument(
            ...,
            help="The plugin's name: distribution rallypoint-NAME, module rallypoint_NAME.",
            metavar="NAME",
            show_default=False,
        ),
        kind: str = typer.Option(
            ...,
            "--kind",
            help=(
                f"What it registers: {', '.join(scaffold.KINDS)} "
                "(checkpoint-store, the former name of checkpoint-backend, also works)."
            ),
            metavar="KIND",
        ),
        directory: Path = typer.Option(
            Path("."), "--dir", help="Where to create the rallypoint-NAME folder."
        ),
    ) -> None:
        """Write a new plugin distribution whose tests (rallypoint's conformance suite) pass."""
        kind = scaffold.check_kind(kind)
        target = scaffold.write_plugin(name, kind, directory)
        typer.echo(f"created {target}: a {scaffold.KINDS[kind]} plugin")
        typer.echo(f"next: pip install -e '{target}[test]' && pytest {target}")

    app.add_typer(group, name="plugins")


def _list(pm: PluginManager, as_json: bool) -> None:
    infos = [pm.infos[name] for name in sorted(pm.infos)]
    conflicts = pm.registry.conflicts()
    if as_json:
        payload = {
            "plugins": [info.to_dict() for info in infos],
            "available": _choices(pm.registry),
            "options": _options(pm.registry),
            "conflicts": conflicts,
        }
        typer.echo(json.dumps(payload, indent=2, sort_keys=True))
        return
    for info in infos:
        origin = "built-in" if info.builtin else f"{info.distribution} {info.version}"
        typer.echo(f"{info.name}  [{info.status}]  {origin}")
        if info.error:
            typer.echo(f"    {'error' if info.status == BROKEN else 'note'}: {info.error}")
        for label, names in sorted(info.registered.items()):
            typer.echo(f"    {label}: {', '.join(names)}")
        if info.hooks:
            typer.echo(f"    hooks: {', '.join(info.hooks)}")
    typer.echo("")
    choices = _choices(pm.registry)
    for kind in KINDS:
        typer.echo(f"{kind.flag} choices: {', '.join(choices[kind.label]) or '(none)'}")
    for label, by_name in _options(pm.registry).items():
        for name, options in sorted(by_name.items()):
            keys = ", ".join(option["name"] for option in options)
            typer.echo(f"{OPTION_FLAGS[label]} keys of {label} {name}: {keys}")
    for conflict in conflicts:
        typer.echo(f"warning: {conflict}", err=True)

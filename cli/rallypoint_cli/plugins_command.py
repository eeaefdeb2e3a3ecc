"""``rallypoint plugins``: what is installed, what each plugin registers, what is broken."""

from __future__ import annotations

import json

import typer

from rallypoint.plugins import BROKEN, PluginManager
from rallypoint.registry import KINDS


def register(app: typer.Typer, pm: PluginManager) -> None:
    @app.command("plugins")
    def plugins(
        as_json: bool = typer.Option(False, "--json", help="Print JSON for tools."),
    ) -> None:
        """List installed plugins: name, version, status, hooks and registered names."""
        infos = [pm.infos[name] for name in sorted(pm.infos)]
        conflicts = pm.registry.conflicts()
        if as_json:
            payload = {
                "plugins": [info.to_dict() for info in infos],
                "available": {kind.label: pm.registry.names(kind) for kind in KINDS},
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
        for kind in KINDS:
            typer.echo(f"{kind.flag} choices: {', '.join(pm.registry.names(kind)) or '(none)'}")
        for conflict in conflicts:
            typer.echo(f"warning: {conflict}", err=True)

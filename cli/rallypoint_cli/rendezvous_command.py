"""``rallypoint rendezvous status``: a job's rendezvous as its store holds it."""

from __future__ import annotations

import json

import typer

from rallypoint.config import parse_options
from rallypoint.extensions import RendezvousRequest
from rallypoint.plugins import PluginManager
from rallypoint.registry import RENDEZVOUS_BACKENDS
from rallypoint.rendezvous.handlers import connect
from rallypoint.rendezvous.protocol import Keys, Settings
from rallypoint.rendezvous.status import read_status


def register(app: typer.Typer, pm: PluginManager) -> None:
    group = typer.Typer(help="Inspect rendezvous state.", no_args_is_help=True)

    @group.command("status")
    def status(
        rdzv_backend: str = typer.Option("c10d", "--rdzv-backend", "--rdzv_backend"),
        rdzv_endpoint: str = typer.Option(..., "--rdzv-endpoint", "--rdzv_endpoint"),
        rdzv_id: str = typer.Option(..., "--rdzv-id", "--rdzv_id"),
        rdzv_conf: str = typer.Option("", "--rdzv-conf", "--rdzv_conf"),
        as_json: bool = typer.Option(False, "--json", help="Print JSON for tools."),
    ) -> None:
        """Current round, members with their ranks, waiting nodes and heartbeats."""
        backend = pm.registry.get(RENDEZVOUS_BACKENDS, rdzv_backend)
        conf = parse_options(
            rdzv_conf, backend.options, "--rdzv-conf", f"the {backend.name} backend"
        )
        request = RendezvousRequest(rdzv_id, rdzv_endpoint, conf, viewer=True)
        settings = Settings.from_conf(1, 1, conf)
        store = connect(backend, request)
        try:
            keys = Keys(settings.prefix, rdzv_id)
            report = read_status(store, keys, rdzv_id, settings.heartbeat_timeout)
        finally:
            store.close()
        if as_json:
            typer.echo(json.dumps(report, indent=2))
            return
        if report["round"] is None:
            typer.echo(f"run {rdzv_id}: no rendezvous in this store")
            return
        state = "forming" if report["forming"] else "running"
        typer.echo(f"run {rdzv_id}: round {report['round']} ({state}), master {report['master']}")
        for member in report["members"]:
            health = "alive" if member["alive"] else "NO HEARTBEAT"
            typer.echo(
                f"  rank {member['group_rank']}: {member['node_id']} on {member['host']}, "
                f"{member['nproc']} workers, {health}"
            )
        if report["error"]:
            typer.echo(f"  the round failed: {report['error']}")
        typer.echo(f"  waiting to join: {report['waiting']}")

    app.add_typer(group, name="rendezvous")

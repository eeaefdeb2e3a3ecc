"""``rallypoint rendezvous status`` and ``clear``: a job's rendezvous as its store holds it,
and removing it from the store.

They name the job with the rendezvous flags of ``rallypoint run``
(``rallypoint.flags.RENDEZVOUS_FLAGS``): the same options, defaults and variables
(``RALLYPOINT_*``, ``PET_*``), so that where ``run`` finds a job's store, they do too."""

from __future__ import annotations

import json
from typing import Any

import typer

from rallypoint.config import RendezvousTarget
from rallypoint.errors import UsageError
from rallypoint.extensions import RendezvousRequest
from rallypoint.flags import RENDEZVOUS_FLAGS
from rallypoint.interfaces import CoordinationStore
from rallypoint.plugins import PluginManager
from rallypoint.registry import RENDEZVOUS_BACKENDS
from rallypoint.rendezvous.generations import current_generation, has_records, inspect_run
from rallypoint.rendezvous.keys import Keys
from rallypoint.rendezvous.settings import Settings
from rallypoint.rendezvous.signing import Seal, SignedStore
from rallypoint.rendezvous.status import read_status
from rallypoint.rendezvous.store_handler import connect
from rallypoint_cli.flag_options import with_flags


def _open(target: RendezvousTarget) -> tuple[CoordinationStore, Keys, Settings]:
    """A read-only client of the job's store (reading sealed records with the job's token,
    when given as the job's agents take it), the job's keys and settings."""
    options = target.rendezvous.options
    request = RendezvousRequest(target.rdzv_id, target.rdzv_endpoint, options, viewer=True)
    settings = Settings.from_conf(1, 1, options)
    store = connect(target.rendezvous.item, request)
    keys = Keys(settings.prefix, target.rdzv_id)
    if target.job_token is not None:
        signed = SignedStore(store, Seal(target.job_token))
        signed.view(keys.token_key)  # the attempt's seal, if the run has a claim of this token
        store = signed
    return store, keys, settings


#: What each condition of a run means, after its round line.
_CONDITIONS = {
    "forming": "forming",
    "running": "running",
    "failed": "failed",
    "abandoned": "abandoned: no agent of it is alive (it failed or was killed); starting "
    "the job again begins afresh, or clear it with rallypoint rendezvous clear",
}


def register(app: typer.Typer, pm: PluginManager) -> None:
    group = typer.Typer(help="Inspect rendezvous state.", no_args_is_help=True)

    def status(
        as_json: bool = typer.Option(False, "--json", help="Print JSON for tools."),
        **flags: Any,
    ) -> None:
        """Current round, members with their ranks, waiting nodes and heartbeats."""
        target = RendezvousTarget.from_flags(pm.registry, **flags)
        rdzv_id = target.rdzv_id
        store, keys, settings = _open(target)
        try:
            report = read_status(store, keys, rdzv_id, settings.heartbeat_timeout)
        finally:
            store.close()
        if as_json:
            typer.echo(json.dumps(report, indent=2))
            return
        if report["round"] is None:
            typer.echo(f"run {rdzv_id}: no rendezvous in this store")
            return
        condition = _CONDITIONS[report["condition"]]
        typer.echo(
            f"run {rdzv_id}: round {report['round']} ({condition}), master {report['master']}"
        )
        for member in report["members"]:
            health = "alive" if member["alive"] else "NO HEARTBEAT"
            typer.echo(
                f"  rank {member['group_rank']}: {member['node_id']} on {member['host']}, "
                f"{member['nproc']} workers, {health}"
            )
        if report["error"]:
            typer.echo(f"  the round failed: {report['error']}")
        typer.echo(f"  waiting to join: {report['waiting']}")
        for node in report["getting_ready"]:
            typer.echo(f"  getting ready to join: {node['node_id']} ({node['doing']})")

    def clear(
        force: bool = typer.Option(
            False, "--force", help="Clear it even while agents of the run are alive."
        ),
        **flags: Any,
    ) -> None:
        """Delete a run's records from the store (every attempt of it). Refused while an
        agent of the run is alive, unless --force."""
        # Asked first: the answer for static and c10d, with or without an endpoint.
        backend = pm.registry.get(RENDEZVOUS_BACKENDS, flags["rdzv_backend"])
        if backend.store_in_agent:
            raise UsageError(
                f"--rdzv-backend {backend.name}: its store lives in the agent that hosts it "
                "and ends with it; there is nothing to clear."
            )
        target = RendezvousTarget.from_flags(pm.registry, **flags)
        rdzv_id, rdzv_backend = target.rdzv_id, backend.name
        store, keys, settings = _open(target)
        try:
            delete = getattr(store, "delete_prefix", None)
            if delete is None:
                raise UsageError(
                    f"--rdzv-backend {rdzv_backend}: its store cannot delete keys by prefix; "
                    "there is no way to clear a run from it."
                )
            current = current_generation(store, keys)
            sample = settings.heartbeat_timeout
            gone, _ = inspect_run(store, current, sample)
            if has_records(store, current) and gone is None and not force:
                raise UsageError(
                    f"run {rdzv_id}: agents of it are alive; stop them first, or give --force "
                    "(their rendezvous would break)."
                )
            deleted = sum(delete(prefix) for prefix in keys.prefixes)
        finally:
            store.close()
        typer.echo(f"run {rdzv_id}: cleared ({deleted} keys deleted)")

    for name, command in (("status", status), ("clear", clear)):
        group.command(name)(with_flags(command, RENDEZVOUS_FLAGS, pm.registry))
    app.add_typer(group, name="rendezvous")

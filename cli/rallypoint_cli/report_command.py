"""``rallypoint report EVENT_LOG...``: where a job's time went (its goodput), from the event
logs of its agents (``rallypoint run --event-log``), as text, JSON or an HTML page."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rallypoint import goodput
from rallypoint.errors import UsageError
from rallypoint.plugins import PluginManager
from rallypoint_cli import report_html


def register(app: typer.Typer, pm: PluginManager) -> None:
    @app.command("report")
    def report(
        event_logs: list[str] = typer.Argument(
            ...,
            metavar="EVENT_LOG...",
            show_default=False,
            help="The job's event logs (one per node), or directories of them (*.jsonl).",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print JSON for tools instead."),
        html: Path | None = typer.Option(
            None,
            "--html",
            metavar="FILE",
            help="Also write the report as one self-contained HTML page with a timeline.",
        ),
    ) -> None:
        """Goodput: the time per phase (training, restarts, redone steps...), failures and
        recoveries of a job, from its agents' event logs."""
        account = goodput.load(event_logs)
        if html is not None:
            # Written before anything is printed: a path that cannot be written is the
            # whole command's error, not a line after a summary.
            try:
                html.write_text(report_html.render(account), encoding="utf-8")
            except OSError as error:
                raise UsageError(
                    f"--html {html}: cannot write it ({error.strerror or error})"
                ) from None
        if as_json:
            typer.echo(json.dumps(account.to_json(), indent=2))
            return
        typer.echo(goodput.summary(account))
        if html is not None:
            typer.echo(f"\nHTML report: {html}")

"""``rallypoint run``: torchrun's command line, checked against the installed plugins.

Its options are made from ``rallypoint.flags.FLAGS``, where each flag is declared once, by
``rallypoint_cli.flag_options``: spelled with dashes or underscores, and set from the
environment as ``RALLYPOINT_<FLAG>`` or torchrun's ``PET_<FLAG>``. The command only reads
the values: ``LaunchConfig.from_flags`` parses and decides them, ``preflight`` checks this
machine, and the agent runs the job.
"""

from __future__ import annotations

import inspect
from typing import Any

import typer
import typer.core

from rallypoint.config import LaunchConfig
from rallypoint.flags import FLAGS
from rallypoint.plugins import PluginManager
from rallypoint.preflight import preflight
from rallypoint.registry import Registry
from rallypoint_cli import abbreviations
from rallypoint_cli.flag_options import flag_option


class _RunCommand(typer.core.TyperCommand):
    """``run``, taking abbreviated long options as torchrun's argparse does."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        expanded = abbreviations.expand(self, args, self.get_help_option_names(ctx))
        return list(super().parse_args(ctx, expanded))


def _signature(registry: Registry) -> inspect.Signature:
    """The parameters of ``run``: the script, its arguments, then every flag of ``FLAGS``."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    script = typer.Argument(
        "", metavar="SCRIPT", show_default=False, help="The training script (or module with -m)."
    )
    arguments = typer.Argument(
        None, metavar="[ARGS]...", show_default=False, help="Arguments for the script."
    )
    return inspect.Signature(
        [
            inspect.Parameter("ctx", keyword, annotation=typer.Context),
            inspect.Parameter("training_script", keyword, default=script, annotation=str),
            inspect.Parameter(
                "training_script_args", keyword, default=arguments, annotation=list[str]
            ),
            *(flag_option(flag, registry) for flag in FLAGS),
        ]
    )


def register(app: typer.Typer, pm: PluginManager) -> None:
    """Add ``run`` to ``app``; its help lists the names the plugins of ``pm`` register."""

    def run(ctx: typer.Context, **values: Any) -> None:
        """Launch SCRIPT on this node's workers, like torchrun, and keep it running."""
        config = LaunchConfig.from_flags(pm.registry, **ctx.params)
        preflight(config)
        from rallypoint.agent.statemachine.elastic import Agent

        raise typer.Exit(Agent(config, pm).run_job())

    # typer reads the parameters from the signature: here, made from the table of flags.
    run.__signature__ = _signature(pm.registry)  # type: ignore[attr-defined]
    app.command(
        "run",
        cls=_RunCommand,
        context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    )(run)

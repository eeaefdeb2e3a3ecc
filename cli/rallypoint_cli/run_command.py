"""``rallypoint run``: torchrun's command line, checked against the installed plugins.

Its options are made from ``rallypoint.flags.FLAGS``, where each flag is declared once.
Every flag is also spelled with underscores, and can be set from the environment as
``RALLYPOINT_<FLAG>`` or torchrun's ``PET_<FLAG>`` (Kubeflow's PyTorchJob sets ``PET_*``);
the command line wins over ``RALLYPOINT_*``, which wins over ``PET_*``. The command only
reads the values: ``LaunchConfig.from_flags`` parses and decides them, ``preflight`` checks
this machine, and the agent runs the job.
"""

from __future__ import annotations

import inspect
from typing import Any

import typer
import typer.core

from rallypoint.config import LaunchConfig
from rallypoint.flags import FLAGS, Flag
from rallypoint.plugins import PluginManager
from rallypoint.preflight import preflight
from rallypoint.registry import Kind, Registry
from rallypoint_cli import abbreviations


class _RunCommand(typer.core.TyperCommand):
    """``run``, taking abbreviated long options as torchrun's argparse does."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        expanded = abbreviations.expand(self, args, self.get_help_option_names(ctx))
        return list(super().parse_args(ctx, expanded))


def _choices(registry: Registry, kind: Kind[Any]) -> str:
    return ", ".join(registry.names(kind)) or "(none installed)"


def _as_given(text: Any) -> Any:
    """A switch's value as given: ``rallypoint.flags`` reads the on/off words."""
    return text


def _option(flag: Flag, registry: Registry) -> inspect.Parameter:
    """``flag`` as a typer option spelled ``--a-b`` and ``--a_b``, read from
    ``RALLYPOINT_A_B`` / ``PET_A_B``: a parameter of the command's function."""
    underscored = flag.name.replace("-", "_")
    decls = [flag.option] + ([f"--{underscored}"] if underscored != flag.name else [])
    if flag.short:
        decls.append(flag.short)
    names = _choices(registry, flag.names) if flag.names else ""
    # torch's own variable (Flag.env) is read only where the flag was not given.
    default = None if flag.env else flag.default
    option = typer.Option(
        default,
        *decls,
        envvar=[f"RALLYPOINT_{underscored.upper()}", f"PET_{underscored.upper()}"],
        help=flag.help.format(names=names, default=flag.default),
        show_default=flag.show_default,
        # Switches read from the environment reach the parser as typed, not as click
        # reads them: on/off is spelt one way everywhere.
        parser=_as_given if flag.switch else None,
    )
    annotation: Any = str if default is not None else str | None
    if flag.switch:
        annotation = bool
    elif flag.repeated:
        annotation = list[str]
    return inspect.Parameter(
        flag.dest, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation
    )


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
            *(_option(flag, registry) for flag in FLAGS),
        ]
    )


def register(app: typer.Typer, pm: PluginManager) -> None:
    """Add ``run`` to ``app``; its help lists the names the plugins of ``pm`` register."""

    def run(ctx: typer.Context, **values: Any) -> None:
        """Launch SCRIPT on this node's workers, like torchrun, and keep it running."""
        config = LaunchConfig.from_flags(pm.registry, **ctx.params)
        preflight(config)
        from rallypoint.agent.elastic import Agent

        raise typer.Exit(Agent(config, pm).run_job())

    # typer reads the parameters from the signature: here, made from the table of flags.
    run.__signature__ = _signature(pm.registry)  # type: ignore[attr-defined]
    app.command(
        "run",
        cls=_RunCommand,
        context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    )(run)

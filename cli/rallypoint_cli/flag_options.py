"""The typer options made from ``rallypoint.flags.FLAGS``, for every command that takes
flags of ``rallypoint run`` (``run`` itself, ``rendezvous status`` and ``clear``).

Every flag is also spelled with underscores, and can be set from the environment as
``RALLYPOINT_<FLAG>`` or torchrun's ``PET_<FLAG>`` (Kubeflow's PyTorchJob sets ``PET_*``);
the command line wins over ``RALLYPOINT_*``, which wins over ``PET_*``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import typer

from rallypoint.flags import Flag
from rallypoint.registry import Kind, Registry


def _choices(registry: Registry, kind: Kind[Any]) -> str:
    return ", ".join(registry.names(kind)) or "(none installed)"


def _as_given(text: Any) -> Any:
    """A switch's value as given: ``rallypoint.flags`` reads the on/off words."""
    return text


def flag_option(flag: Flag, registry: Registry) -> inspect.Parameter:
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


def with_flags(
    command: Callable[..., Any], flags: Iterable[Flag], registry: Registry
) -> Callable[..., Any]:
    """``command`` (which takes the flags as ``**values``) with ``flags`` as its first
    options, then its own: typer reads the parameters from the signature."""
    own = [
        parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for parameter in inspect.signature(command).parameters.values()
        if parameter.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    parameters = [*(flag_option(flag, registry) for flag in flags), *own]
    command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    return command

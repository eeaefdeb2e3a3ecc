"""Entry point of the ``rallypoint`` console script.

The application is assembled at start-up: built-in commands first, then the commands that
plugins add through ``register_commands``. Every error a user can cause ends as one line on
stderr and a non-zero exit code (2 for usage errors), never as a traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Sequence

import typer
import typer.main

from rallypoint import __version__
from rallypoint.errors import RallypointError
from rallypoint.plugins import PluginManager, get_plugin_manager
from rallypoint.redact import redact_urls
from rallypoint_cli import plugins_command, rendezvous_command, report_command, run_command


def _parse_errors() -> tuple[type[Exception], ...]:
    """The exception class of click's usage errors: typer >= 0.24 vendors click."""
    base = getattr(typer, "TyperException", None)
    if base is not None:
        return (base,)
    import click  # older typer: click itself

    return (click.ClickException,)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rallypoint {__version__}")
        raise typer.Exit()


def build_app(pm: PluginManager) -> typer.Typer:
    """The typer application for the plugins ``pm`` has loaded."""
    app = typer.Typer(
        name="rallypoint",
        help="Fault-tolerant, elastic launcher for PyTorch distributed training.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
    )

    @app.callback()
    def _root(
        version: bool = typer.Option(
            False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
        ),
    ) -> None:
        """Fault-tolerant, elastic launcher for PyTorch distributed training."""

    run_command.register(app, pm)
    plugins_command.register(app, pm)
    rendezvous_command.register(app, pm)
    report_command.register(app, pm)
    _add_plugin_commands(app, pm)
    return app


def _command_names(app: typer.Typer, commands: int = 0, groups: int = 0) -> list[str]:
    """Names of the commands and groups registered after the first ``commands``/``groups``."""
    names = [
        info.name or typer.main.get_command_name(info.callback.__name__)
        for info in app.registered_commands[commands:]
        if info.callback is not None
    ]
    names += [info.name or "" for info in app.registered_groups[groups:]]
    return names


def _add_plugin_commands(app: typer.Typer, pm: PluginManager) -> None:
    """Let plugins add commands; one that shadows an existing command is refused."""
    taken = set(_command_names(app))
    commands, groups = len(app.registered_commands), len(app.registered_groups)
    for plugin_name, results in pm.call_each("register_commands", app=app):
        added = _command_names(app, commands, groups)
        clashes = sorted(name for name in added if name in taken)
        if results is None or clashes:
            del app.registered_commands[commands:]
            del app.registered_groups[groups:]
            if clashes:
                pm.mark_broken(plugin_name, f"command {clashes[0]!r} is already taken")
            continue
        taken.update(added)
        commands, groups = len(app.registered_commands), len(app.registered_groups)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[rallypoint] %(message)s")
    try:
        command = typer.main.get_command(build_app(get_plugin_manager()))
        result = command.main(
            args=list(sys.argv[1:] if argv is None else argv),
            prog_name="rallypoint",
            standalone_mode=False,
        )
    except typer.Exit as done:
        return int(done.exit_code)
    except typer.Abort:
        print("rallypoint: aborted.", file=sys.stderr)
        return 130
    except _parse_errors() as error:
        message = error.format_message()  # type: ignore[attr-defined]
        if message:  # empty when click has already shown the help instead
            print(f"rallypoint: error: {_one_line(message)}", file=sys.stderr)
        return int(getattr(error, "exit_code", 2))
    except RallypointError as error:
        print(f"rallypoint: error: {_one_line(str(error))}", file=sys.stderr)
        return error.exit_code
    return result if isinstance(result, int) else 0


def _one_line(message: str) -> str:
    """``message`` as one line: a value the user typed may hold a line break or a
    terminal escape; they are shown escaped, as ``repr`` would. A password in a URL is
    masked."""
    text = redact_urls(message.strip())  # a safety net: messages show no URL's password
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def console_main() -> None:
    """The console script: ``sys.exit(main())``, but for the interpreter's finalisation.

    The command has done its work when ``main`` returns; tearing down every module it
    imported only costs time (a tenth of a second after every ``rallypoint run``), and a
    store thread still inside a C++ call then (a TCPStore reconnecting to an agent that
    died with the store) aborts the process (SIGABRT), losing the exit code. So: the
    ``atexit`` handlers (``logging.shutdown`` among them, and any a plugin registered),
    the streams flushed, and exit at once."""
    code = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a reader gone
            stream.flush()
    os._exit(code & 0xFF)

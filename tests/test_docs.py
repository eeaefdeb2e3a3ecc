"""The documentation matches the code: hooks, flags, option keys and code snippets."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer.main

from rallypoint import hookspecs
from rallypoint.plugins import build_plugin_manager
from rallypoint.registry import METRICS_SINKS, RENDEZVOUS_BACKENDS, RESTART_POLICIES, Kind
from rallypoint_cli.main import build_app

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
HOOKS_MD = DOCS / "plugins" / "hooks.md"
USER_GUIDE = DOCS / "user-guide.md"
WRITING = DOCS / "plugins" / "writing.md"

#: torchrun flags the user guide says rallypoint does not accept yet. When one is added to
#: `rallypoint run`, test_unsupported_torchrun_flags_are_absent fails: update the guide.
NOT_YET_SUPPORTED = {
    "--logs-specs",
    "--event-log-handler",
    "--duplicate-stdout-filters",
    "--duplicate-stderr-filters",
    "--numa-binding",
    "--virtual-local-rank",
}

#: The distributions of this repository; third-party plugins installed here are not documented.
BUNDLED = {"rallypoint", "rallypoint-etcd", "rallypoint-redis", "rallypoint-prometheus"}

#: The extension points whose registrations declare `key=value` settings.
KINDS_WITH_OPTIONS: tuple[Kind[Any], ...] = (RENDEZVOUS_BACKENDS, RESTART_POLICIES, METRICS_SINKS)

_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def hookspec_functions() -> list[Callable[..., Any]]:
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return [
        value
        for value in vars(hookspecs).values()
        if inspect.isfunction(value)
        and value.__module__ == hookspecs.__name__
        and hasattr(value, marker)
    ]


def signature_line(function: Callable[..., Any]) -> str:
    # hookspecs.py uses `from __future__ import annotations`: annotations are the source text.
    signature = str(inspect.signature(function)).replace("'", "")
    return f"def {function.__name__}{signature}:"


def _flags(command: Any) -> set[str]:
    """Every option spelling of a click command and of its subcommands, --help included."""
    flags: set[str] = set()
    for param in command.params:
        flags.update(getattr(param, "opts", ()))
        flags.update(getattr(param, "secondary_opts", ()))
    flags.update(command.get_help_option_names(command.context_class(command)))
    for sub in getattr(command, "commands", {}).values():
        flags |= _flags(sub)
    return {flag for flag in flags if flag.startswith("--")}


def _app() -> Any:
    return typer.main.get_command(build_app(build_plugin_manager({})))


def run_command_flags() -> set[str]:
    """Every option spelling `rallypoint run` accepts, --help included."""
    return _flags(_app().commands["run"])


def all_command_flags() -> set[str]:
    """Every option spelling of every `rallypoint` command."""
    return _flags(_app())


def python_blocks(path: Path) -> list[str]:
    return _PYTHON_BLOCK.findall(path.read_text(encoding="utf-8"))


def test_hookspecs_are_found() -> None:
    assert len(hookspec_functions()) >= 13


@pytest.mark.parametrize("function", hookspec_functions(), ids=lambda f: f.__name__)
def test_plugin_hooks_are_documented(function: Callable[..., Any]) -> None:
    text = HOOKS_MD.read_text(encoding="utf-8")
    assert f"\n## {function.__name__}\n" in text, f"no '## {function.__name__}' heading"
    assert signature_line(function) in text, f"signature of {function.__name__} differs"


def test_hook_reference_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(DOCS / "gen_hook_reference.py"), "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_user_guide_flags_exist() -> None:
    accepted = all_command_flags()
    mentioned = set(_FLAG.findall(USER_GUIDE.read_text(encoding="utf-8")))
    unknown = sorted(mentioned - accepted - NOT_YET_SUPPORTED)
    assert not unknown, f"docs/user-guide.md mentions flags no command has: {unknown}"


def test_every_run_flag_is_documented() -> None:
    """The reverse of the above: a flag added to `rallypoint run` needs a line in the guide."""
    mentioned = set(_FLAG.findall(USER_GUIDE.read_text(encoding="utf-8")))
    dashed = {flag for flag in run_command_flags() if "_" not in flag}
    missing = sorted(dashed - mentioned)
    assert not missing, f"flags of `rallypoint run` missing from docs/user-guide.md: {missing}"


def test_unsupported_torchrun_flags_are_absent() -> None:
    """The guide lists them as not accepted yet; that must stay true."""
    text = USER_GUIDE.read_text(encoding="utf-8")
    accepted = run_command_flags()
    for flag in sorted(NOT_YET_SUPPORTED):
        assert flag in text, f"{flag} is no longer listed in docs/user-guide.md"
        assert flag not in accepted, f"{flag} is accepted now: update docs/user-guide.md"


def test_user_guide_documents_every_option_key() -> None:
    """Every --rdzv-conf, --restart-conf and --metrics-conf key installed here is in the guide."""
    registry = build_plugin_manager({}).registry
    text = USER_GUIDE.read_text(encoding="utf-8")
    missing = sorted(
        f"{kind.flag} {entry.item.name}: {option.name}"
        for kind in KINDS_WITH_OPTIONS
        for entry in registry.entries(kind)
        if entry.distribution in BUNDLED
        for option in entry.item.options
        if f"`{option.name}`" not in text
    )
    assert not missing, f"option keys missing from docs/user-guide.md: {missing}"


@pytest.mark.parametrize("path", [WRITING, HOOKS_MD], ids=lambda p: p.name)
def test_python_snippets_compile(path: Path) -> None:
    blocks = python_blocks(path)
    assert blocks, f"no python blocks in {path.name}"
    for number, source in enumerate(blocks, 1):
        if source.rstrip().endswith(":"):  # a hook's signature line: give it a body
            source += "    ...\n"
        compile(source, f"{path.name}, python block {number}", "exec")

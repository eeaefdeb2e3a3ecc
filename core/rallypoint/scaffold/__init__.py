"""A new plugin distribution from templates: ``rallypoint plugins new NAME --kind KIND``.

``write_plugin`` writes ``rallypoint-NAME/`` with a ``pyproject.toml`` (entry point in the
``rallypoint`` group), a README, the package ``rallypoint_NAME`` with one working
implementation of the chosen extension point, and tests that run the matching conformance
suite of ``rallypoint.testing``. As written, it installs and its tests pass; the author
then replaces the placeholder logic, and the tests say whether the result still keeps
rallypoint's contract.

The files are real files under ``templates/``: ``plugin/`` holds what every plugin gets,
``<kind>/`` what a plugin of that kind adds (its ``usage.md`` goes into the README). The
templates under ``templates/F/`` are the plugin ``example-F``, and each spelling of that
name (``rallypoint-example-F``, ``rallypoint_example_F``, ``example_F``, ``ExampleF``,
``example-F``) becomes the same spelling of NAME; so the Python templates are a working
plugin that ruff and mypy check like any other (see pyproject.toml). The other
placeholders: ``KIND_LABEL``, ``KIND_USAGE``, the rallypoint range ``rallypoint>=0.1,<0.2``
and ``examplefs``, the checkpoint backend's URL scheme. ``templates/ruff.toml`` is not a
template: it lints the templates as their plugins' own projects would.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

from rallypoint import __version__
from rallypoint.errors import UsageError

if TYPE_CHECKING:  # importlib.resources.abc is new in Python 3.11
    from importlib.resources.abc import Traversable

#: The kinds ``--kind`` accepts, and what each registers.
KINDS: dict[str, str] = {
    "rendezvous": "rendezvous backend",
    "restart-policy": "restart policy",
    "rank-assigner": "rank assigner",
    "checkpoint-backend": "checkpoint backend",
    "metrics-sink": "metrics sink",
}

#: Other names ``--kind`` accepts, for the kind they name: ``checkpoint-store`` is what the
#: checkpoint backend kind was called at first.
ALIASES: dict[str, str] = {"checkpoint-store": "checkpoint-backend"}

#: The folder of what every plugin gets; its templates are the plugin ``example-plugin``.
SHARED = "plugin"

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
_TEMPLATES = files(__name__) / "templates"


def check_name(name: str) -> str:
    """``name`` lower-cased; ``UsageError`` unless it can name a distribution and a module."""
    normalised = name.strip().lower()
    if not _NAME.match(normalised):
        raise UsageError(
            f"plugin name {name!r}: use lower-case letters and digits, words joined by '-' "
            "or '_', starting with a letter (for example: my-backend)"
        )
    return normalised


def check_kind(kind: str) -> str:
    """The kind ``kind`` names (an alias gives its kind); ``UsageError`` for none."""
    normalised = kind.strip().lower()
    normalised = ALIASES.get(normalised, normalised)
    if normalised not in KINDS:
        raise UsageError(f"--kind {kind!r}: choose one of: {', '.join(KINDS)}.")
    return normalised


def plugin_files(name: str, kind: str) -> dict[str, str]:
    """The files of the new distribution, by path relative to its folder."""
    kind, name = check_kind(kind), check_name(name)
    table = _placeholders(name, kind)
    usage = (_TEMPLATES / kind / "usage.md").read_text(encoding="utf-8")
    table["KIND_USAGE"] = _render(usage, table).rstrip("\n")
    return {
        _render(relative, table): _render(text, table)
        for folder in (SHARED, kind)
        for relative, text in _walk(_TEMPLATES / folder)
        if relative != "usage.md"
    }


def write_plugin(name: str, kind: str, directory: str | Path = ".") -> Path:
    """Write the distribution ``rallypoint-NAME`` of ``kind`` under ``directory``; return
    its folder. An existing, non-empty folder is left alone (``UsageError``)."""
    rendered = plugin_files(name, kind)
    target = Path(directory) / f"rallypoint-{check_name(name)}"
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"{target} already exists: choose another NAME or --dir.")
    for relative, text in rendered.items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return target


def _core_range() -> str:
    """The rallypoint versions a new plugin declares it works with: this minor series."""
    major, minor = (int(part) for part in __version__.split(".")[:2])
    return (
        f"rallypoint>={major}.{minor},<{major}.{minor + 1}"
        if major == 0
        else f"rallypoint>={major}.{minor},<{major + 1}"
    )


def _spellings(name: str) -> tuple[str, ...]:
    """A plugin's name as its distribution, module, class-name prefix, identifier, itself."""
    ident = name.replace("-", "_")
    cls = "".join(part.capitalize() for part in re.split(r"[-_]", name))
    return f"rallypoint-{name}", f"rallypoint_{ident}", cls, ident, name


def _placeholders(name: str, kind: str) -> dict[str, str]:
    """What the templates of the shared folder and of ``kind`` say, and what to write."""
    table = {
        "KIND_LABEL": KINDS[kind],
        "rallypoint>=0.1,<0.2": _core_range(),
        "examplefs": name.replace("_", "-"),  # URL schemes have no '_'
    }
    for folder in (SHARED, kind):
        table.update(zip(_spellings(f"example-{folder}"), _spellings(name), strict=True))
    return table


def _render(text: str, table: Mapping[str, str]) -> str:
    """``text`` with every placeholder of ``table`` replaced, in one pass: the longest
    first where two start at one place (``rallypoint_example_x`` before ``example_x``)."""
    pattern = re.compile("|".join(map(re.escape, sorted(table, key=len, reverse=True))))
    return pattern.sub(lambda found: table[found.group()], text)


def _walk(folder: Traversable, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Every file under ``folder``: its path below it and its text."""
    for entry in sorted(folder.iterdir(), key=lambda entry: entry.name):
        if entry.name == "__pycache__":
            continue
        if entry.is_dir():
            yield from _walk(entry, f"{prefix}{entry.name}/")
        else:
            yield f"{prefix}{entry.name}", entry.read_text(encoding="utf-8")

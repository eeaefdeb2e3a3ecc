"""Generate docs/plugins/api.md from the plugin API, ``rallypoint.sdk.__all__``.

Usage:
    python docs/gen_api_reference.py           write docs/plugins/api.md
    python docs/gen_api_reference.py --check   exit 1 if docs/plugins/api.md is out of date

The page is built only from the code and the pages: the module docstring of
``rallypoint.sdk``, then one row per name of ``__all__`` with its kind, the first paragraph
of its docstring (for a constant, the ``#:`` comment right above its assignment in the
module it comes from, and its value), the hooks whose signature or docstring name it, and
the pages whose code (``inline`` or fenced) names it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any

from gen_hook_reference import hookspec_functions, markdown_text, render_docstring

from rallypoint import sdk

DOCS = Path(__file__).resolve().parent
OUTPUT = DOCS / "plugins" / "api.md"
#: Generated pages: the hook reference is the "hooks" column, and this page is the output.
SKIPPED_PAGES = (OUTPUT, DOCS / "plugins" / "hooks.md")

_CODE = re.compile(r"^```.*?^```|`[^`\n]+`", re.DOTALL | re.MULTILINE)


def first_paragraph(doc: str | None) -> str:
    """The first paragraph of a docstring, on one line, as Markdown."""
    paragraph = inspect.cleandoc(doc or "").split("\n\n", 1)[0]
    return markdown_text(" ".join(line.strip() for line in paragraph.splitlines()))


def sources() -> dict[str, str]:
    """The module each name of ``rallypoint.sdk`` is imported from, read from its source."""
    tree = ast.parse(Path(inspect.getfile(sdk)).read_text(encoding="utf-8"))
    return {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def doc_comment(module_name: str, name: str) -> str:
    """The ``#:`` comment lines right above ``name``'s assignment in ``module_name``."""
    source = inspect.getsource(importlib.import_module(module_name))
    lines = source.splitlines()
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            comment: list[str] = []
            index = node.lineno - 2
            while index >= 0 and lines[index].startswith("#:"):
                comment.insert(0, lines[index].removeprefix("#:").strip())
                index -= 1
            return markdown_text(" ".join(comment))
    raise ValueError(f"{name}: no assignment in {module_name}")


def kind_of(value: Any) -> str:
    if inspect.isclass(value):
        if issubclass(value, BaseException):
            return "exception"
        if getattr(value, "_is_protocol", False):
            return "protocol"
        return "dataclass" if dataclasses.is_dataclass(value) else "class"
    if inspect.isfunction(value):
        return "function"
    if typing.get_origin(value) is not None:
        return "type alias"
    if isinstance(value, (str, int, float, tuple, frozenset)):
        return "constant"
    return "decorator" if callable(value) else type(value).__name__


def summary(name: str, value: Any, module_name: str | None) -> str:
    """What a name is, in one paragraph."""
    if inspect.isclass(value) or inspect.isfunction(value):
        text = first_paragraph(value.__doc__)
    elif kind_of(value) in ("constant", "type alias"):
        if module_name is None:
            raise ValueError(f"rallypoint.sdk defines {name} itself; import it from its module")
        text = doc_comment(module_name, name)
        if isinstance(value, str):
            text = f'`"{value}"`' + (f": {text}" if text else "")
    else:  # an instance, such as the hookimpl marker: what its type is for
        text = first_paragraph(type(value).__doc__)
    if not text:
        raise ValueError(
            f"{name}: no docstring (or `#:` comment above it in {module_name}) to show; add one"
        )
    return text.replace("|", "\\|")


def _names(text: str, names: list[str]) -> set[str]:
    return {name for name in names if re.search(rf"\b{re.escape(name)}\b", text)}


def hooks_naming(names: list[str]) -> dict[str, list[str]]:
    """For each name, the hooks whose signature or docstring names it."""
    found: dict[str, list[str]] = {name: [] for name in names}
    for function in hookspec_functions():
        text = str(inspect.signature(function)) + (function.__doc__ or "")
        for name in _names(text, names):
            found[name].append(f"[`{function.__name__}`](hooks.md#{function.__name__})")
    return found


def pages_naming(names: list[str]) -> dict[str, list[str]]:
    """For each name, the pages whose code names it, linked from docs/plugins/."""
    found: dict[str, list[str]] = {name: [] for name in names}
    for page in sorted(DOCS.rglob("*.md")):
        if page in SKIPPED_PAGES:
            continue
        text = page.read_text(encoding="utf-8")
        title = next((line[2:] for line in text.splitlines() if line.startswith("# ")), page.stem)
        code = "\n".join(_CODE.findall(text))
        target = Path(os.path.relpath(page, OUTPUT.parent)).as_posix()
        for name in _names(code, names):
            found[name].append(f"[{title}]({target})")
    return found


def render() -> str:
    """The whole page."""
    names: list[str] = list(sdk.__all__)
    modules = sources()
    hooks = hooks_naming(names)
    pages = pages_naming(names)
    out = [
        "# Plugin API",
        "",
        "<!-- Generated by docs/gen_api_reference.py from rallypoint/sdk.py. Do not edit:",
        "     change rallypoint.sdk and run `.venv/bin/python docs/gen_api_reference.py`. -->",
        "",
        *render_docstring(sdk.__doc__ or ""),
        "Import every name below from `rallypoint.sdk`; a plugin's tests add the testing kit "
        "(see [Testing a plugin](writing.md#testing-a-plugin)). The last columns link the "
        "hooks that take or return a name and the pages whose code uses it.",
        "",
        "| name | kind | what it is | hooks | pages |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        value = getattr(sdk, name)
        out.append(
            f"| `{name}` | {kind_of(value)} | {summary(name, value, modules.get(name))} "
            f"| {', '.join(hooks[name]) or '-'} | {', '.join(pages[name]) or '-'} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the page is out of date; write nothing"
    )
    check = parser.parse_args(argv).check
    text = render()
    if OUTPUT.exists() and OUTPUT.read_text(encoding="utf-8") == text:
        return 0
    if check:
        print(f"{OUTPUT.relative_to(DOCS.parent)} is out of date: run {__file__}", file=sys.stderr)
        return 1
    OUTPUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generate docs/plugins/hooks.md from the hook specifications in ``rallypoint.hookspecs``.

Usage:
    python docs/gen_hook_reference.py           write docs/plugins/hooks.md
    python docs/gen_hook_reference.py --check   exit 1 if docs/plugins/hooks.md is out of date

The page is built only from the code: each function of ``rallypoint.hookspecs`` that carries
pluggy's ``rallypoint_spec`` marker becomes a ``## name`` section with its signature, whether
it is ``firstresult`` and its docstring; the table at the top is computed by importing the
built-in plugins and looking for functions named like the ``register_*`` hooks.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from rallypoint import hookspecs
from rallypoint.plugins import BUILTIN_PLUGINS

OUTPUT = Path(__file__).resolve().parent / "plugins" / "hooks.md"
MARKER = f"{hookspecs.PROJECT_NAME}_spec"

#: Page sections in the order of the banners in hookspecs.py.
GROUPS = ("Extension points", "Command line", "Lifecycle")

#: What a reader must know about a section in this version. Update when the multi-node
#: rendezvous or the checkpoint storage API lands.
GROUP_NOTES = {
    "Extension points": (
        "Registrations are collected, checked for duplicate names and used by "
        "`rallypoint run` to validate its flags. The agent calls the restart policy after "
        "every failure and feeds every event to the chosen metrics sinks; the leader of "
        "each rendezvous round calls the rank assigner. A rendezvous backend's `connect` "
        "(or `create_handler`) serves every job of more than one node that names it; a job "
        "of one node runs the rendezvous in the agent's memory whatever `--rdzv-backend` "
        "says (see [Writing a plugin](writing.md#a-rendezvous-backend)). A checkpoint backend's `open` "
        "gives the workers' `rallypoint.checkpoint` the storage for `--checkpoint-dir` "
        "(see [Writing a checkpoint backend](../checkpoint-storage.md))."
    ),
    "Lifecycle": (
        "The agent calls these hooks at each phase of a run, for every plugin that "
        "implements them, in its main thread; return values are ignored. Each call "
        "corresponds to one event of the `--event-log` (see the user guide's "
        "[Event log](../user-guide.md#event-log)): `agent_started`, "
        "`rendezvous_completed`, `workers_started`, `worker_failed` (once per failed "
        "worker), `workers_restarted`, `scale_changed` (only when the number of nodes "
        "changes, so never on one node) and `agent_stopping`. An exception in a hook is "
        "logged with the plugin's name and does not stop the run; every other plugin "
        "still gets the event, since the agent calls the implementations one plugin at "
        "a time. Keep hooks quick: they run in the agent's main loop."
    ),
}

_SECTION = re.compile(r"^(Args|Arguments|Returns|Yields|Raises|Note|Notes):\s*$")
_RST_LITERAL = re.compile(r"``(.+?)``")


class _Source(str):
    """An annotation string that ``inspect`` prints as written, without quotes."""

    def __repr__(self) -> str:
        return str(self)


def hookspec_functions(module: ModuleType = hookspecs) -> list[Callable[..., Any]]:
    """The hook specifications of ``module``, in source order."""
    functions = [
        value
        for value in vars(module).values()
        if inspect.isfunction(value)
        and value.__module__ == module.__name__
        and hasattr(value, MARKER)
    ]
    return sorted(functions, key=lambda f: f.__code__.co_firstlineno)


def group_of(name: str) -> str:
    """The page section of a hook, from its name."""
    if name == "register_commands":
        return "Command line"
    if name.startswith("register_"):
        return "Extension points"
    if name.startswith("on_"):
        return "Lifecycle"
    raise ValueError(f"hook {name!r}: no section for it; extend group_of() in {__file__}")


def signature_line(function: Callable[..., Any]) -> str:
    """``def name(params) -> result:`` with annotations as they are spelled in the source."""
    signature = inspect.signature(function)

    def shown(annotation: Any) -> Any:
        return _Source(annotation) if isinstance(annotation, str) else annotation

    parameters = [p.replace(annotation=shown(p.annotation)) for p in signature.parameters.values()]
    signature = signature.replace(
        parameters=parameters, return_annotation=shown(signature.return_annotation)
    )
    return f"def {function.__name__}{signature}:"


def markdown_text(text: str) -> str:
    """reStructuredText literals (````x````) as Markdown code (```x```)."""
    return _RST_LITERAL.sub(r"`\1`", text)


def _block(lines: list[str], start: int) -> tuple[list[str], int]:
    """The indented block that starts at ``lines[start]`` (blank lines inside kept)."""
    end = start
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith((" ", "\t"))):
        end += 1
    block = lines[start:end]
    while block and not block[-1].strip():
        block.pop()
    return block, end


def _fence(block: list[str], language: str) -> list[str]:
    code = textwrap.dedent("\n".join(block)).strip("\n")
    return [f"```{language}", *code.splitlines(), "```", ""]


def _section(title: str, block: list[str]) -> list[str]:
    """An ``Args:``-style section: entries ``name: text`` as a list, anything else as text."""
    body = textwrap.dedent("\n".join(block)).splitlines()
    if title in ("Args", "Arguments"):
        items: list[str] = []
        for line in body:
            if line.strip() and not line.startswith(" ") and ":" in line:
                name, _, rest = line.partition(":")
                items.append(f"- `{name.strip()}`: {rest.strip()}")
            elif line.strip() and items:
                items[-1] += " " + line.strip()
        return [f"**{title}:**", "", *(markdown_text(item) for item in items), ""]
    text = " ".join(line.strip() for line in body if line.strip())
    return [f"**{title}:** {markdown_text(text)}", ""]


def render_docstring(doc: str) -> list[str]:
    """A Google-style docstring as Markdown lines.

    ``Example::`` and other ``::`` paragraphs are followed by a fenced code block (Python
    for examples), ``Args:`` becomes a list and ``Returns:`` a paragraph.
    """
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            out.extend([markdown_text(" ".join(paragraph)), ""])
            paragraph.clear()

    index = 0
    while index < len(lines):
        line = lines[index].rstrip()
        section = _SECTION.match(line)
        if section:
            flush()
            block, index = _block(lines, index + 1)
            out.extend(_section(section.group(1), block))
            continue
        if line.endswith("::"):
            label = line[:-2].rstrip()
            language = "python" if label == "Example" else ""
            if label == "Example":
                flush()
                out.extend(["**Example:**", ""])
            else:
                paragraph.append(label + ":")
                flush()
            block, index = _block(lines, index + 1)
            out.extend(_fence(block, language))
            continue
        if line.strip():
            paragraph.append(line.strip())
        else:
            flush()
        index += 1
    flush()
    return out


def builtin_implementations(hook_names: list[str]) -> Iterator[tuple[str, str, str]]:
    """``(hook, built-in modules, names they register)`` for every ``register_*`` hook."""
    modules = [importlib.import_module(name) for name in BUILTIN_PLUGINS]
    for hook in hook_names:
        if not hook.startswith("register_"):
            continue
        providers: list[str] = []
        registered: list[str] = []
        for module in modules:
            function = getattr(module, hook, None)
            if not inspect.isfunction(function):
                continue
            providers.append(f"`{module.__name__}`")
            if not inspect.signature(function).parameters:
                registered += [f"`{item.name}`" for item in function()]
        yield hook, ", ".join(providers) or "none", ", ".join(registered) or "-"


def render() -> str:
    """The whole page."""
    functions = hookspec_functions()
    names = [function.__name__ for function in functions]
    first = [name for name in names if getattr(getattr(hookspecs, name), MARKER)["firstresult"]]
    out = [
        "# Hook reference",
        "",
        "<!-- Generated by docs/gen_hook_reference.py from rallypoint/hookspecs.py. Do not edit:",
        "     change the hookspecs and run `.venv/bin/python docs/gen_hook_reference.py`. -->",
        "",
        *render_docstring(hookspecs.__doc__ or ""),
        "Import the marker and the dataclasses from the plugin API: `from rallypoint.sdk import hookimpl` (see [the plugin API](api.md)). "
        + (
            "Hooks marked *firstresult* stop at the first implementation that returns "
            f"something other than `None`: {', '.join(f'`{n}`' for n in first)}."
            if first
            else "No hook is *firstresult*: every implementation of a hook is called, "
            "and for the `register_*` hooks all their results are collected."
        ),
        "",
        "Which built-in plugin implements each `register_*` hook "
        "(built-ins are registered exactly like installed plugins):",
        "",
        "| hook | built-in plugin | registers |",
        "|---|---|---|",
        *(
            f"| [`{hook}`](#{hook}) | {modules} | {registered} |"
            for hook, modules, registered in builtin_implementations(names)
        ),
        "",
    ]
    for group in GROUPS:
        members = [f for f in functions if group_of(f.__name__) == group]
        if not members:
            continue
        out.extend([f"# {group}", ""])
        if group in GROUP_NOTES:
            out.extend([GROUP_NOTES[group], ""])
        for function in members:
            spec = getattr(function, MARKER)
            out.extend(
                [
                    f"## {function.__name__}",
                    "",
                    "```python",
                    signature_line(function),
                    "```",
                    "",
                    f"*firstresult*: {'yes' if spec['firstresult'] else 'no'}",
                    "",
                    *render_docstring(function.__doc__ or ""),
                ]
            )
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the page is out of date; write nothing"
    )
    args = parser.parse_args(argv)
    text = render()
    current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else None
    if args.check:
        if current != text:
            print(
                f"{OUTPUT.relative_to(OUTPUT.parents[2])} is out of date: "
                "run python docs/gen_hook_reference.py",
                file=sys.stderr,
            )
            return 1
        return 0
    if current != text:
        OUTPUT.parent.mkdir(parents=True, exist_ok=True)
        OUTPUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Long options shortened as argparse allows (torchrun's ``--nnode 2 --nproc_per 4``), and
one sentence with the likely option for one that does not exist.

click matches option names exactly; torchrun's argparse takes any unambiguous prefix. So
``rallypoint run`` expands prefixes itself before click parses, up to the script: what
follows it is the script's own.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from rallypoint.errors import UsageError


def _options(command: Any) -> list[Any]:
    """The command's options (click's, or the copy of click that typer >= 0.24 vendors)."""
    return [p for p in command.params if getattr(p, "param_type_name", "") == "option"]


def expand(command: Any, args: Sequence[str], flags: Sequence[str] = ()) -> list[str]:
    """``args`` with every unambiguous prefix of a long option of ``command`` written out;
    ``flags`` are more options that take no value (click's ``--help``).

    Raises:
        UsageError: a prefix of several options (naming them), or an option that is no
            prefix of any (naming the closest, if one is close).
    """
    names: dict[str, Any] = {}  # every long spelling -> its option
    shorts: dict[str, Any] = {}
    for option in _options(command):
        for name in (*option.opts, *option.secondary_opts):
            (names if name.startswith("--") else shorts)[name] = option
    expanded: list[str] = []
    position = 0
    for flag in flags:
        if flag.startswith("--"):
            names[flag] = None
    while position < len(args):
        arg = args[position]
        position += 1
        if arg == "--" or not arg.startswith("-"):
            return [*expanded, arg, *args[position:]]  # the script and its arguments
        name, sep, value = arg.partition("=")
        if name.startswith("--") and name not in names:
            name = _resolve(name, names)
        expanded.append(name + sep + value)
        option = names.get(name) or shorts.get(name)
        takes_value = option is not None and not option.is_flag and not option.count
        if takes_value and not sep and position < len(args):
            expanded.append(args[position])  # its value, whatever it looks like
            position += 1
    return expanded


def _resolve(name: str, names: dict[str, Any]) -> str:
    """The long option ``name`` abbreviates."""
    matches = [spelling for spelling in names if spelling.startswith(name)]
    options: dict[int, str] = {}  # one spelling per option, the hyphenated one first
    for match in sorted(matches, key=lambda m: ("_" in m, m)):
        options.setdefault(id(names[match]), match)
    if len(options) == 1:
        return next(iter(options.values()))
    if len(options) > 1:
        listed = ", ".join(sorted(options.values()))
        raise UsageError(f"ambiguous option {name}: it could be {listed}.")
    hyphenated = [spelling for spelling in names if "_" not in spelling]
    close = difflib.get_close_matches(name.replace("_", "-"), hyphenated, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else "."
    raise UsageError(f"no such option: {name}{hint} See 'rallypoint run --help'.")

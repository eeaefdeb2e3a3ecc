"""Which of torch and rallypoint a job's workers import: the preloaded interpreter
imports those first.

Importing torch takes seconds and a few hundred megabytes; a script that never imports it
should not wait for it, nor carry it. So the agent reads (never runs) the worker's program
and the modules of its own it imports, in its folder, following their imports, and finds
whether any imports ``torch`` (or ``torch.*``) and ``rallypoint`` (its worker API, whose
import is a tenth of a second a restart would pay again). A program that uses
``torch.optim`` also gets ``torch._dynamo`` preloaded: every torch optimizer imports it
when it is created (two seconds here), which each restarted worker would pay again. What
it cannot see (an import by a string, by an installed package of the job's) it does not
guess at: ``--preload torch`` says so.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

#: How many of the program's own files are read at most.
_FILES = 200
#: The packages preloaded when the program imports them.
PRELOADED = ("torch", "rallypoint")
#: Preloaded, after torch, when the program uses torch's optimizers (``OPTIMIZERS``).
DYNAMO = "torch._dynamo"
OPTIMIZERS = "torch.optim"


def imported(program: str, path0: str, module: bool = False) -> tuple[str, ...]:
    """Which of ``PRELOADED`` ``program`` (a script, a folder with ``__main__.py``, or with
    ``module`` a module name found from ``path0``), or a module of its folder it imports,
    imports."""
    root = path0 or os.getcwd()
    if module:  # python -m runs a package's __main__.py, after its __init__.py
        base = os.path.join(root, *program.split("."))
        todo = [_module_file(program, root), os.path.join(base, "__main__.py")]
    else:
        todo = [_script_file(program)]
    seen: set[str] = set()
    found: set[str] = set()
    while todo and len(seen) < _FILES and len(found) < len(PRELOADED) + 1:
        path = todo.pop()
        if path is None or path in seen or not os.path.isfile(path):
            continue
        seen.add(path)
        for name, folder in _imported(path):
            top = name.partition(".")[0]
            if folder is None and top in PRELOADED:
                found.add(top)
                if name == OPTIMIZERS or name.startswith(OPTIMIZERS + "."):
                    found.add(DYNAMO)
            else:
                todo.append(_module_file(name, folder or root))
    order = ("torch", DYNAMO, "rallypoint") if "torch" in found else PRELOADED
    return tuple(name for name in order if name in found)


def _script_file(path: str) -> str | None:
    if os.path.isdir(path):
        path = os.path.join(path, "__main__.py")
    return path if os.path.isfile(path) else None


def _module_file(name: str, root: str) -> str | None:
    """The file of module ``name`` under ``root``, if it is there (a package: its
    ``__init__.py``; run with ``-m``: its ``__main__.py`` is read too, by the caller's walk)."""
    base = os.path.join(root, *name.split("."))
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    main = os.path.join(base, "__main__.py")
    return main if os.path.isfile(main) else None


def _imported(path: str) -> Iterator[tuple[str, str | None]]:
    """The names ``path`` imports, anywhere in it (a function's imports too), each with
    the folder a relative import starts from (None: an absolute one)."""
    try:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read(), path)
    except (OSError, SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if _names_optimizers(node):  # torch.optim.SGD(...) after a plain import torch
            yield OPTIMIZERS, None
        if isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            folder = None
            if node.level:  # from . import x: x is in this file's package
                folder = os.path.dirname(path)
                for _ in range(node.level - 1):
                    folder = os.path.dirname(folder)
            prefix = f"{node.module}." if node.module else ""
            if node.module:
                yield node.module, folder
            yield from ((prefix + alias.name, folder) for alias in node.names)


def _names_optimizers(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "optim"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    )

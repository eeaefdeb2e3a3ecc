"""The shape the core keeps (issue 24): no function longer than 60 lines, so that each one
can be read at once, and no class longer than 400, so that each holds one concern.
Decorators count; a nested function counts inside its parent too."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core" / "rallypoint"
LONGEST = 60
LONGEST_CLASS = 400


def _lengths(root: Path, kinds: tuple[type[ast.AST], ...]) -> Iterator[tuple[str, str, int, int]]:
    """``(path, name, line, lines)`` of every definition of one of ``kinds`` under ``root``."""
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, kinds):
                assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = (node.end_lineno or node.lineno) - first + 1
                yield str(path.relative_to(root.parent)), node.name, node.lineno, length


def long_functions(root: Path) -> list[str]:
    return [
        f"{path}:{line} {name}: {length} lines"
        for path, name, line, length in _lengths(root, (ast.FunctionDef, ast.AsyncFunctionDef))
        if length > LONGEST
    ]


def long_classes(root: Path) -> dict[str, int]:
    """``{"path:Class": lines}`` of the classes longer than ``LONGEST_CLASS`` lines."""
    return {
        f"{path}:{name}": length
        for path, name, _line, length in _lengths(root, (ast.ClassDef,))
        if length > LONGEST_CLASS
    }


def test_no_function_of_the_core_is_longer_than_60_lines() -> None:
    assert long_functions(CORE) == []


def test_no_class_of_the_core_is_longer_than_400_lines() -> None:
    assert long_classes(CORE) == {}, "split these by concern"


def test_the_check_finds_a_long_function(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(LONGEST))
    (tmp_path / "long.py").write_text(f"def long():\n{body}")
    (tmp_path / "short.py").write_text("def short():\n    return 1\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/long.py:1 long: {LONGEST + 1} lines"]


def test_the_check_finds_a_long_class(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(LONGEST_CLASS))
    (tmp_path / "long.py").write_text(f"@decorated\nclass Long:\n{body}")
    (tmp_path / "short.py").write_text("class Short:\n    pass\n")
    assert long_classes(tmp_path) == {f"{tmp_path.name}/long.py:Long": LONGEST_CLASS + 2}

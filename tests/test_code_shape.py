"""The shape the core keeps (issue 24): no function longer than 60 lines, so that each one
can be read at once. Decorators count; a nested function counts inside its parent too."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core" / "rallypoint"
LONGEST = 60


def long_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = (node.end_lineno or node.lineno) - first + 1
                if length > LONGEST:
                    found.append(
                        f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {length} lines"
                    )
    return found


def test_no_function_of_the_core_is_longer_than_60_lines() -> None:
    assert long_functions(CORE) == []


def test_the_check_finds_a_long_function(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(LONGEST))
    (tmp_path / "long.py").write_text(f"def long():\n{body}")
    (tmp_path / "short.py").write_text("def short():\n    return 1\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/long.py:1 long: {LONGEST + 1} lines"]

"""The package's layout: rules about its source that hold for every module of ``dlscale/``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dlscale"

MAX_FUNCTION_LINES = 60
"""The longest a function may be, from its ``def`` line to its last (decorators not counted)."""


def long_functions(folder: Path, limit: int) -> list[str]:
    """Every function and method (nested ones too) under ``folder`` longer than ``limit`` lines, as
    ``path:line name (n lines)`` with the path relative to ``folder``'s parent."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        for node in sorted(functions, key=lambda n: n.lineno):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                where = path.relative_to(folder.parent).as_posix()
                found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_the_limit() -> None:
    """A function over ``MAX_FUNCTION_LINES`` lines does more than one thing: split it into named pieces."""
    assert any(PACKAGE.rglob("*.py")), f"no modules found under {PACKAGE}"
    long = long_functions(PACKAGE, MAX_FUNCTION_LINES)
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_long_functions_are_named_with_their_place_and_length(tmp_path: Path) -> None:
    """The check itself: it finds a long function and a long method, async or not, and names each."""
    folder = tmp_path / "pkg"
    folder.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(4))
    (folder / "m.py").write_text(
        f"def short():\n    pass\n\n\n@staticmethod\ndef long():\n{body}\n\n\n"
        f"class C:\n    async def method(self):\n{body.replace('    ', '        ')}\n"
    )
    assert long_functions(folder, 4) == ["pkg/m.py:6 long (5 lines)", "pkg/m.py:14 method (5 lines)"]

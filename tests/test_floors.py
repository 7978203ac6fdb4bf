"""No import runs back up a floor: the bottom modules, strategies/ and callbacks/ never import what sits above them.

The floors, bottom up: the root modules every floor uses (rank-zero output, option checks, the checkpoint file
format, the model summary), `strategies/`, `callbacks/`, `trainer/`. An import under ``if TYPE_CHECKING:`` is for
annotations only and never runs; every other import counts, inside a function too (it runs when the function does).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The root modules of the bottom floor.
BOTTOM = ("checkpoint_file.py", "model_summary.py", "options.py", "rank_zero.py", "rng.py")
#: What each floor must never import at run time.
ABOVE = {
    "bottom": ("syncline.trainer", "syncline.strategies", "syncline.callbacks", "syncline.examples", "syncline.lab"),
    "strategies": ("syncline.trainer", "syncline.callbacks", "syncline.examples", "syncline.lab"),
    "callbacks": ("syncline.trainer", "syncline.examples", "syncline.lab"),
}


def _floor_files() -> dict[str, list[Path]]:
    return {
        "bottom": [ROOT / name for name in BOTTOM],
        "strategies": sorted((ROOT / "strategies").rglob("*.py")),
        "callbacks": sorted((ROOT / "callbacks").rglob("*.py")),
    }


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _run_time_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in `tree` outside ``if TYPE_CHECKING:`` blocks."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def upward_imports() -> list[str]:
    """``path:line imports module`` for every run-time import that runs back up a floor."""
    out = []
    for floor, paths in _floor_files().items():
        for path in paths:
            for line, module in _run_time_imports(ast.parse(path.read_text(), str(path))):
                if any(module == above or module.startswith(above + ".") for above in ABOVE[floor]):
                    out.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return out


def test_no_import_runs_back_up_a_floor():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import_and_skips_a_type_only_one():
    code = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from syncline.trainer.trainer import Trainer\n"
        "def f():\n    from syncline.trainer.seed import seed_everything\n"
    )
    assert _run_time_imports(ast.parse(code)) == [(1, "typing"), (5, "syncline.trainer.seed")]

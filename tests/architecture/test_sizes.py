"""Sizes a reader can hold in mind: no module of ``penstock/`` over 600 lines, no function
over 80 (from its ``def`` to its last line, docstring included), no folder of more than 24
modules. A module that outgrows the limit splits by concern; a function splits into named
steps; a folder groups its modules into subpackages a reader can name."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "penstock"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_FOLDER_MODULES = 24


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in modules()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_function_is_over_80_lines() -> None:
    long: dict[str, int] = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = lines
    assert long == {}


def test_no_folder_holds_more_than_24_modules() -> None:
    folders = {path.parent for path in modules()}
    crowded = {
        str(folder.relative_to(PACKAGE.parent)): count
        for folder in folders
        if (count := len(list(folder.glob("*.py")))) > MAX_FOLDER_MODULES
    }
    assert crowded == {}

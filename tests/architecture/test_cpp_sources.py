"""C++ lives in C++ files: a kernel is a ``.cpp``/``.h`` source of its package, built by
:mod:`penstock.engines.transformers.kernels.loader`, never a Python string compiled with
``load_inline``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "penstock"
CPP_MARKERS = ("#include", "PYBIND11_MODULE", "TORCH_CHECK")


def cpp_strings(tree: ast.AST) -> list[int]:
    """The lines of the string constants that hold C++."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and any(marker in node.value for marker in CPP_MARKERS)
    ]


def load_inline_uses(tree: ast.AST) -> list[int]:
    """The lines that import, name or call ``load_inline``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "load_inline" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id == "load_inline":
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "load_inline":
            lines.append(node.lineno)
    return lines


def places(check: str) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        lines = cpp_strings(tree) if check == "cpp" else load_inline_uses(tree)
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}" for line in lines]
    return found


def test_no_cpp_in_python_strings() -> None:
    assert places("cpp") == []


def test_no_load_inline() -> None:
    assert places("load_inline") == []


def test_the_checks_see_inline_cpp() -> None:
    tree = ast.parse(
        "from torch.utils import cpp_extension\n"
        "from torch.utils.cpp_extension import load_inline\n"
        'SOURCE = r"""\n#include <torch/extension.h>\n"""\n'
        'kernel = cpp_extension.load_inline("k", cpp_sources=SOURCE)\n'
    )
    assert cpp_strings(tree) == [3]
    assert load_inline_uses(tree) == [2, 6]

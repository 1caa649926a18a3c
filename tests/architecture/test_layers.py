"""Imports point one way: a module never imports from a layer above its own.

The layers, top to bottom, are listed in DESIGN.md; a package not listed here fails the
test, so a new package has to be given its place.
"""

from __future__ import annotations

import ast
from pathlib import Path

import penstock

PACKAGE_ROOT = Path(penstock.__file__).parent

LAYERS: list[set[str]] = [
    {"app", "ray", "__main__"},
    {"routers"},
    {"serving"},
    {"rl", "lora", "media", "responses", "metadata_upload"},
    {"gateway"},
    {"engines"},
    {"preprocess", "multimodal"},
    {"http", "memory", "nixl_agent"},
    {
        "schemas",
        "metrics",
        "tracing",
        "errors",
        "settings",
        "setting_types",
        "options",
        "destinations",
        "extras",
        "__init__",
    },
]


def layer_of(top: str) -> int:
    for depth, names in enumerate(LAYERS):
        if top in names:
            return depth
    raise AssertionError(f"penstock.{top} has no layer; add it to LAYERS and DESIGN.md")


def top_name(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every ``penstock.*`` import in the file, including lazy and TYPE_CHECKING ones."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("penstock.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "penstock":
                found += [(node.lineno, _from_package(a.name)) for a in node.names]
            elif node.module.startswith("penstock."):
                found.append((node.lineno, node.module))
    return found


def _from_package(name: str) -> str:
    """``from penstock import x``: a submodule if there is one, else a name of the package."""
    is_module = (PACKAGE_ROOT / name).is_dir() or (PACKAGE_ROOT / f"{name}.py").is_file()
    return f"penstock.{name}" if is_module else "penstock"


def source_files() -> list[Path]:
    return sorted(PACKAGE_ROOT.rglob("*.py"))


def own_top(path: Path) -> str:
    relative = path.relative_to(PACKAGE_ROOT)
    return relative.parts[0].removesuffix(".py")


def test_every_package_has_a_layer() -> None:
    for path in source_files():
        layer_of(own_top(path))


def test_no_module_imports_from_a_layer_above_it() -> None:
    upward = []
    for path in source_files():
        own = layer_of(own_top(path))
        for line, module in imported_modules(path):
            target = layer_of(top_name(module))
            if target < own:
                upward.append(f"{path.relative_to(PACKAGE_ROOT.parent)}:{line} imports {module}")
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "example.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from penstock.app.server import serve\n"
        "def later():\n"
        "    import penstock.routers.chat\n"
    )
    targets = [layer_of(top_name(m)) for _, m in imported_modules(module)]
    assert targets == [layer_of("app"), layer_of("routers")]

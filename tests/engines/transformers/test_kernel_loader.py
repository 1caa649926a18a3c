"""A kernel's build is named after its sources, local headers included: an edited kernel
is built afresh, never loaded from a cached build of an older source."""

from __future__ import annotations

from pathlib import Path

from penstock.engines.transformers.kernels.loader import build_name, source_files


def write_kernel(folder: Path, header_body: str) -> None:
    (folder / "kernel.cpp").write_text('#include <vector>\n#include "helpers.h"\nint f();\n')
    (folder / "helpers.h").write_text('#pragma once\n#include "inner.h"\n')
    (folder / "inner.h").write_text(header_body)


def test_an_edited_header_renames_the_build(tmp_path: Path) -> None:
    write_kernel(tmp_path, "inline int g() { return 1; }\n")
    first = build_name("penstock_example", ["kernel.cpp"], tmp_path)
    assert first == build_name("penstock_example", ["kernel.cpp"], tmp_path)
    write_kernel(tmp_path, "inline int g() { return 2; }\n")
    second = build_name("penstock_example", ["kernel.cpp"], tmp_path)
    assert first.startswith("penstock_example_") and second != first


def test_the_sources_are_followed_through_their_local_includes(tmp_path: Path) -> None:
    write_kernel(tmp_path, "")
    found = source_files(["kernel.cpp"], tmp_path)
    assert [path.name for path in found] == ["kernel.cpp", "helpers.h", "inner.h"]

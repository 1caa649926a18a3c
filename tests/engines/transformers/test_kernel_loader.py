"""The kernel loader: a build is named after its sources (local headers included) and the
toolchain, not the path of the torch that built it; the first start says it is building
and how long that takes; a second venv, or a second process starting at once, builds
nothing; a machine without a compiler gets one warning that says what it loses.

The builds here are of ``kernel_probe/probe.cpp``, which compiles in a second.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from penstock.engines.transformers.kernels import loader, paged_attention
from penstock.engines.transformers.kernels.loader import (
    KernelBuildError,
    build_name,
    load_extension,
    source_files,
)
from penstock.engines.transformers.weights import cpu_weights
from tests.support.server import REPO_ROOT

PROBE_DIR = Path(__file__).parent / "kernel_probe"
LOADER = "penstock.engines.transformers.kernels.loader"

# One start of a venv: load the probe from the cache folder argv[1], print torch's path
# and the probe's answer; the loader logs to stderr.
START = f"""
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
import torch
from {LOADER} import load_extension
probe = load_extension("penstock_probe", ["probe.cpp"], [], Path(sys.argv[1]),
                       build_cpu_s=1, folder=Path({str(PROBE_DIR)!r}))
print(torch.__file__, probe.answer())
"""


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
    assert build_name("penstock_example", ["kernel.cpp"], tmp_path, ("-mavx2",)) != second


def test_the_sources_are_followed_through_their_local_includes(tmp_path: Path) -> None:
    write_kernel(tmp_path, "")
    found = source_files(["kernel.cpp"], tmp_path)
    assert [path.name for path in found] == ["kernel.cpp", "helpers.h", "inner.h"]


def test_the_first_start_says_it_builds_and_later_ones_load_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOADER)
    name = build_name("penstock_probe", ["probe.cpp"], PROBE_DIR)
    # What a build killed with its process (SIGKILL) leaves behind.
    (tmp_path / "torch_extensions" / f"{name}.building.x1y2" / "obj").mkdir(parents=True)
    probe = load_extension(
        "penstock_probe", ["probe.cpp"], [], tmp_path, build_cpu_s=1, folder=PROBE_DIR
    )
    assert probe.answer() == 42
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("building CPU kernel penstock_probe_")
    assert "first start only, about" in lines[0]
    assert lines[1].startswith("built CPU kernel penstock_probe_")
    caplog.clear()
    again = load_extension(
        "penstock_probe", ["probe.cpp"], [], tmp_path, build_cpu_s=1, folder=PROBE_DIR
    )
    assert again.answer() == 42 and caplog.records == []
    # Only the library stays: the staging folder and the compiler's files are gone.
    kept = sorted(path.name for path in (tmp_path / "torch_extensions").rglob("*"))
    assert kept == sorted([name, f"{name}.lock", f"{name}.so"])


def start(cache: Path, site: Path | None) -> subprocess.Popen[str]:
    """A start in a venv whose torch lives at ``site``/torch (the shared one's: None)."""
    path = os.pathsep.join([*([str(site)] if site else []), str(REPO_ROOT)])
    return subprocess.Popen(
        [sys.executable, "-c", START, str(cache)],
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str]) -> tuple[str, str]:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return out, err


def test_two_venvs_share_one_build_started_at_once_or_alternately(tmp_path: Path) -> None:
    # A second venv with the same torch installed elsewhere: a torch at another path.
    other_site = tmp_path / "other-venv"
    other_site.mkdir()
    (other_site / "torch").symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    cache = tmp_path / "cache"
    together = [finish(process) for process in [start(cache, None), start(cache, other_site)]]
    torch_paths = {out.split()[0] for out, _ in together}
    assert len(torch_paths) == 2 and {out.split()[1] for out, _ in together} == {"42"}
    assert sum(err.count("INFO building CPU kernel") for _, err in together) == 1
    for site in (None, other_site, None):
        out, err = finish(start(cache, site))
        assert out.split()[1] == "42" and "building" not in err


def test_without_a_compiler_one_warning_says_what_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(KernelBuildError, match=r"no C\+\+ compiler"):
        load_extension(
            "penstock_probe", ["probe.cpp"], [], tmp_path, build_cpu_s=1, folder=PROBE_DIR
        )
    # A process that loaded no kernel yet, as a server's start is.
    monkeypatch.setattr(loader, "_compiler_reported", threading.Event())
    for module in (paged_attention, cpu_weights):
        monkeypatch.setattr(module, "_kernel", None)
        monkeypatch.setattr(module, "_failure", None)
    caplog.set_level(logging.INFO)
    assert paged_attention.load_attention_kernel(tmp_path) is not None
    assert not cpu_weights.kernel_for_weights(tmp_path)
    warnings = [
        record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING
    ]
    assert len(warnings) == 1
    assert "no C++ compiler" in warnings[0]
    assert "padded batch" in warnings[0] and "weights stay float32" in warnings[0]
    assert not paged_attention.kernel_ready() and cpu_weights._kernel is None

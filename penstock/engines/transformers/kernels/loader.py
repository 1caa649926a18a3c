"""Builds a C++ extension from this folder's sources on first use, then loads it from disk.

``torch.utils.cpp_extension`` compiles into ``torch_extensions/<name>`` of the model cache
folder. The name carries a digest of the extension's source files and of the local headers
they include, so a changed kernel is built afresh instead of loading a build of an older
source left in the cache (ninja judges by file times, and an installed file can be older
than a build it differs from).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).parent
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_files(sources: list[str], folder: Path = KERNEL_DIR) -> list[Path]:
    """``sources`` and every local header they include, directly or not, in a stable order."""
    found: list[Path] = []
    pending = [folder / name for name in sources]
    while pending:
        path = pending.pop(0)
        if path in found:
            continue
        found.append(path)
        included = _LOCAL_INCLUDE.findall(path.read_text(encoding="utf-8"))
        pending += [path.parent / name for name in included]
    return found


def build_name(name: str, sources: list[str], folder: Path = KERNEL_DIR) -> str:
    digest = hashlib.sha256()
    for path in source_files(sources, folder):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{name}_{digest.hexdigest()[:16]}"


def load_extension(name: str, sources: list[str], flags: list[str], cache_dir: Path) -> Any:
    """Compile (once per source digest) and import the extension ``name`` from ``sources``,
    files of this folder; raises what the compiler or the import raised."""
    from torch.utils.cpp_extension import load

    full_name = build_name(name, sources)
    build_dir = cache_dir / "torch_extensions" / full_name
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(
        full_name,
        sources=[str(KERNEL_DIR / source) for source in sources],
        extra_cflags=flags,
        build_directory=str(build_dir),
        verbose=False,
    )

"""Compiles one kernel extension, in a process of its own (see :mod:`.loader`).

``python build.py NAME FOLDER FLAGS_JSON SOURCE...``: builds ``FOLDER/NAME.so``.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    from torch.utils.cpp_extension import load

    name, folder, flags, *sources = argv
    load(
        name,
        sources=sources,
        extra_cflags=json.loads(flags),
        # The OpenMP runtime at::parallel_for calls into (see loader._PARALLEL_FLAGS).
        extra_ldflags=["-fopenmp"],
        build_directory=folder,
        verbose=False,
    )


if __name__ == "__main__":
    main(sys.argv[1:])

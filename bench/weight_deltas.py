"""Time the delta pulls of :mod:`penstock.rl.deltas` on a synthetic float32 checkpoint.

A step of training changes a fraction of each tensor's elements; slime publishes it as an
``xor`` or ``overwrite`` delta, SkyRL as an XOR delta. This prints, per kind: the
published bytes against the checkpoint's size, the time to copy the base (the first
pull), and the time and GB/s of applying one version (decompress, patch, checksum).

    .venv/bin/python bench/weight_deltas.py --mb 64 --changed 0.1
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard
from safetensors.numpy import load_file, save_file

from penstock.rl import deltas

TENSORS = 16


def checkpoint(folder: Path, megabytes: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    folder.mkdir(parents=True)
    size = megabytes * 2**20 // 4 // TENSORS
    tensors = {f"layer.{n}.weight": rng.standard_normal(size, np.float32) for n in range(TENSORS)}
    save_file(tensors, str(folder / "model.safetensors"))
    return {
        name: array.view(np.uint8)
        for name, array in load_file(folder / "model.safetensors").items()
    }


def stepped(
    old: dict[str, np.ndarray], changed: float, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    new = {}
    for name, data in old.items():
        values = data.view(np.float32).copy()
        picked = rng.random(values.size) < changed
        values[picked] += rng.standard_normal(int(picked.sum())).astype(np.float32) * 1e-3
        new[name] = values.view(np.uint8)
    return new


def publish_slime(
    folder: Path, old: dict[str, np.ndarray], new: dict[str, np.ndarray], encoding: str
) -> int:
    folder.mkdir(parents=True)
    payload, sums = {}, {}
    for name, data in new.items():
        if encoding == "xor":
            raw = (data ^ old[name]).tobytes()
        else:
            positions = np.flatnonzero(old[name] != data).astype("<u4")
            raw = (
                np.array([positions.size], "<u4").tobytes()
                + positions.tobytes()
                + data[positions].tobytes()
            )
        payload[name] = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(raw), np.uint8)
        sums[name] = deltas.checksum("xxh3-128", data)
    save_file(payload, str(folder / "model-00000-of-00001.safetensors"), metadata=sums)
    metadata = {
        "version": "000001",
        "base_version": "000000",
        "delta_encoding": encoding,
        "compression_format": "zstd",
        "checksum_format": "xxh3-128",
    }
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": metadata, "weight_map": {}})
    )
    return sum(p.nbytes for p in payload.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=64, help="checkpoint size")
    parser.add_argument("--changed", type=float, default=0.1, help="fraction of elements changed")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = checkpoint(root / "base", args.mb, rng)
        new = stepped(base, args.changed, rng)
        total = sum(data.nbytes for data in base.values())
        for encoding in ("xor", "overwrite"):
            source = root / f"published-{encoding}"
            published = publish_slime(source / "weight_v000001", base, new, encoding)
            local = root / f"local-{encoding}"
            started = time.perf_counter()
            deltas.pull_slime(local, root / "base", source, 0)
            seeded = time.perf_counter() - started
            started = time.perf_counter()
            deltas.pull_slime(local, root / "base", source, 1)
            applied = time.perf_counter() - started
            print(
                f"slime {encoding:9s} checkpoint {total / 2**20:.0f} MiB, published "
                f"{published / 2**20:.1f} MiB ({published / total:.1%}); base copy {seeded:.3f} s; "
                f"one version {applied:.3f} s ({total / applied / 1e9:.2f} GB/s)"
            )
            shutil.rmtree(local)


if __name__ == "__main__":
    main()

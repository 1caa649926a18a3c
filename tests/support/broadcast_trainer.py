"""A trainer process that joins a weights update group as rank 0 and broadcasts a
checkpoint's tensors (each shifted by ``SHIFT``) one at a time, in the checkpoint's
order, then holds before tensor ``--stop-after``, so a test can kill it mid-broadcast.

    python -m tests.support.broadcast_trainer MODEL_DIR --port P --stop-after K

It prints ``joined`` once the group is up, ``sent NAME`` after each tensor and
``holding`` when it stops sending (then waits to be killed).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from penstock.engines.weights.sync import DEFAULT_GROUP_NAME, init_custom_process_group

SHIFT = 0.25


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in file order, as this trainer broadcasts them."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stop-after", type=int, required=True)
    args = parser.parse_args()
    group = init_custom_process_group(
        backend="gloo",
        master_address="127.0.0.1",
        master_port=args.port,
        rank=0,
        world_size=2,
        group_name=DEFAULT_GROUP_NAME,
        timeout_s=20,
    )
    print("joined", flush=True)
    for sent, (name, tensor) in enumerate(checkpoint_tensors(args.model_dir).items()):
        if sent == args.stop_after:
            print("holding", flush=True)
            time.sleep(3600)
        dist.broadcast(tensor + SHIFT, src=0, group=group)
        print(f"sent {name}", flush=True)


if __name__ == "__main__":
    main()

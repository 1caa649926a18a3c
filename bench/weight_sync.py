"""Weight sync on the default model (SmolLM2-135M): GiB/s and pause-to-resume per method.

Starts ``penstock serve --engine transformers`` (the default model) on loopback, loads
the same checkpoint here as the trainer, and for each method pauses, pushes every
tensor, resumes: ``update_weights_from_disk`` (safetensors written beforehand, not
timed), gloo broadcast (per tensor, and one flattened bucket), and tensors (base64
safetensors over HTTP in 24 MiB buckets; a larger tensor travels alone, so the server
runs with --max-body-mb 400), and NIXL (the engine READs every tensor from this process
over UCX; the push includes registering and deregistering them). GiB/s is the model's
bytes over the push call alone; pause-to-resume includes the pause and resume calls.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.default_model import ensure_default_model
from penstock.rl.trainer import WeightPusher
from tests.support.server import running_server

BUCKET_BYTES = 24 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def buckets(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > BUCKET_BYTES:
            out.append({})
            size = 0
        out[-1][name] = tensor
        size += nbytes
    return out


def timed(pusher: WeightPusher, push: Callable[[], object]) -> tuple[float, float]:
    """(push seconds, pause-to-resume seconds)."""
    started = time.perf_counter()
    pusher.pause("retract")
    pushed = time.perf_counter()
    push()
    pushed = time.perf_counter() - pushed
    pusher.resume()
    return pushed, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--only",
        nargs="*",
        default=[],
        help="run only the methods whose label contains one of these texts (default: all)",
    )
    args = parser.parse_args()
    model_dir = ensure_default_model(default_model_cache_dir())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    # Tied tensors (lm_head = embeddings) are sent once, as checkpoints hold them.
    seen: set[int] = set()
    unique = {}
    for name, tensor in weights.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            unique[name] = tensor
    total = sum(t.numel() * t.element_size() for t in unique.values())
    gib = total / 2**30
    with tempfile.TemporaryDirectory() as folder:
        disk = Path(folder) / "ckpt"
        disk.mkdir()
        save_file(unique, str(disk / "model.safetensors"))
        serve = ["--engine", "transformers", "--admin-api-key", "k", "--max-body-mb", "400"]
        serve += ["--", "--cpu-threads", "2"]
        with running_server(serve, Path(folder), ready_timeout=600) as server:
            pusher = WeightPusher(server.base_url, admin_key="k", timeout_s=600)
            pusher.init_group("127.0.0.1", free_port(), timeout_s=60)
            methods: dict[str, Callable[[], object]] = {
                "update_weights_from_disk": lambda: pusher.post(
                    "/update_weights_from_disk", {"model_path": str(disk)}
                ),
                "broadcast (per tensor)": lambda: pusher.broadcast(unique),
                "broadcast (flattened bucket)": lambda: pusher.broadcast(unique, flattened=True),
                "tensors (safetensors, 24 MiB buckets; one tensor per bucket past that)": lambda: [
                    pusher.push_tensors(b) for b in buckets(unique)
                ],
                "nixl (engine READs over UCX)": lambda: pusher.push_nixl(unique),
            }
            print(f"model bytes: {gib:.3f} GiB ({len(unique)} tensors)")
            print(f"{'method':40} {'GiB/s':>7} {'push s':>7} {'pause->resume s':>16}")
            for label, push in methods.items():
                if args.only and not any(part in label for part in args.only):
                    continue
                best = min(timed(pusher, push) for _ in range(args.repeats))
                print(f"{label:40} {gib / best[0]:7.2f} {best[0]:7.2f} {best[1]:16.2f}")
            pusher.destroy_group()
            pusher.close()


if __name__ == "__main__":
    main()

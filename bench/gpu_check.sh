#!/usr/bin/env bash
# The GPU check: one run, under 8 minutes on one GPU; each check prints PASS, FAIL or SKIP.
# Without CUDA in this environment's torch it says so and runs the CPU-safe parts only.
# Nothing is installed or downloaded. Arguments go to bench/gpu_check.py (--cpu-only,
# --budget-s, --engine vllm: penstock serve --engine vllm, in an interpreter with vLLM, see
# bench/gpu_check_vllm.py). The exit status is 1 when a check failed, 124 when the run
# overran.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
    echo "FAIL  environment: no $PYTHON (set PYTHON to the project's interpreter)"
    exit 1
fi
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The script keeps to its own budget (440 s by default); this bounds it whatever happens.
exec timeout --kill-after=10 470 "$PYTHON" bench/gpu_check.py "$@"

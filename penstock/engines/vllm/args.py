"""The vllm engine's command line: vLLM's own engine arguments, parsed by vLLM's parser.

``--model`` left out serves Penstock's default model folder (SmolLM2-135M-Instruct,
converted once into the model cache), under the default model's name.
JSON output is compact, as Penstock's default (vLLM's structured outputs with the xgrammar
backend and ``disable_any_whitespace``), unless ``--structured-outputs-config`` is given.
Penstock's worker methods (:mod:`.worker_extension`) are installed as vLLM's
``--worker-extension-cls`` unless another class is given (tensor pushes then refused).
``--deterministic`` is refused: vLLM's batch-invariant mode is not mapped onto it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from penstock.engines.builtin_options import default_model_cache_dir
from penstock.engines.vllm.worker_extension import EXTENSION_QUALNAME
from penstock.errors import EngineLoadError

DETERMINISTIC_REFUSAL = (
    "--deterministic: the vllm engine does not map it onto vLLM's batch-invariant mode "
    "(VLLM_BATCH_INVARIANT=1 with a supported attention backend); serve without it, or "
    "use --engine transformers"
)


def _parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(
        prog="penstock serve --engine vllm --",
        description="vLLM's engine arguments (AsyncEngineArgs), as vllm serve takes them.",
    )
    return AsyncEngineArgs.add_cli_args(parser)


def given(argv: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


async def parse_engine_args(argv: list[str]) -> AsyncEngineArgs:
    """vLLM's engine arguments from ``argv``; ``--help`` prints them and exits."""
    if "--deterministic" in argv:
        raise EngineLoadError(DETERMINISTIC_REFUSAL)
    if not given(argv, "--model"):
        from penstock.engines.transformers.default_model import (
            DEFAULT_MODEL_NAME,
            prepare_default_model,
        )

        folder = await prepare_default_model(default_model_cache_dir())
        argv = ["--model", str(folder), *argv]
        if not given(argv, "--served-model-name"):
            argv += ["--served-model-name", DEFAULT_MODEL_NAME]
    args: Any = _parser().parse_args(argv)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    if not given(argv, "--worker-extension-cls"):
        engine_args.worker_extension_cls = EXTENSION_QUALNAME
    if not any(arg.startswith("--structured-outputs-config") for arg in argv):
        # vLLM reads the whitespace rule of JSON output from its engine config only (the
        # request's field is not read), and only with the xgrammar or guidance backend.
        engine_args.structured_outputs_config = StructuredOutputsConfig(
            backend="xgrammar", disable_any_whitespace=True
        )
    if not await asyncio.to_thread(os.path.isdir, engine_args.model):
        raise EngineLoadError(
            f"--model {engine_args.model}: the vllm engine serves a local checkpoint folder "
            "(the gateway tokenizes with its tokenizer and chat template)"
        )
    return engine_args


def served_name(engine_args: AsyncEngineArgs) -> str | None:
    names = engine_args.served_model_name
    if isinstance(names, list | tuple):
        return names[0] if names else None
    return names

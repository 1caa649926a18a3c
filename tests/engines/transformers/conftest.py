"""Tiny checkpoints built once per test session, and a started engine per test."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from penstock.engines.transformers import TransformersEngine
from tests.support.tiny_llm import build_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def other_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """Same architecture and vocabulary as ``tiny_model_dir``, different random weights."""
    return build_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama-other"), seed=1, tokenizer_from=tiny_model_dir
    )


@pytest.fixture(scope="session")
def wider_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """Same tensor names as ``tiny_model_dir`` but a larger hidden size: wrong shapes."""
    folder = tmp_path_factory.mktemp("tiny-llama-wider")
    build_tiny_llama(folder, seed=2, tokenizer_from=tiny_model_dir)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder)
    config = model.config
    config.hidden_size = 96
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def copy_with_eos(source: Path, target: Path, eos_token_id: int) -> Path:
    """A copy of a checkpoint whose generation config declares another end-of-sequence id."""
    shutil.copytree(source, target)
    config_path = target / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = eos_token_id
    config_path.write_text(json.dumps(config))
    return target


async def start_engine(model_dir: Path, *extra: str) -> TransformersEngine:
    engine, _ = await TransformersEngine.from_args(["--model", str(model_dir), *extra])
    await engine.start(7)
    return engine


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[TransformersEngine]:
    started = await start_engine(tiny_model_dir)
    yield started
    await started.cleanup()

"""Tiny checkpoints built once per test session, and a started engine per test."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

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


def save_tiny_lora(model_dir: Path, folder: Path, *, seed: int, **config: Any) -> Path:
    """A random LoRA adapter for the checkpoint in ``model_dir``, saved by peft.

    ``init_lora_weights=False`` makes both LoRA matrices random, so the adapter changes
    the model's output (peft's default starts B at zero: no change at all).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    options = {"r": 4, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    get_peft_model(base, LoraConfig(**{**options, **config})).save_pretrained(folder)
    return folder


def peft_greedy(
    model_dir: Path,
    lora_dir: Path,
    prompt: list[int],
    max_tokens: int,
    dtype: torch.dtype | None = None,
) -> list[int]:
    """Greedy tokens of an adapter run by peft's own ``PeftModel``, one full pass per token
    (in ``dtype``, else the checkpoint's)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cast = {} if dtype is None else {"dtype": dtype}
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, **cast)
    model = PeftModel.from_pretrained(base, str(lora_dir)).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(max_tokens):
            next_id = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def tiny_lora_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    return save_tiny_lora(tiny_model_dir, tmp_path_factory.mktemp("tiny-lora"), seed=11)


@pytest.fixture(scope="session")
def second_tiny_lora_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """Another adapter for the same model, on other modules and with other weights."""
    return save_tiny_lora(
        tiny_model_dir,
        tmp_path_factory.mktemp("tiny-lora-second"),
        seed=12,
        target_modules=["k_proj", "o_proj", "up_proj"],
    )


@pytest.fixture(scope="session")
def wider_tiny_lora_dir(
    tmp_path_factory: pytest.TempPathFactory, wider_tiny_model_dir: Path
) -> Path:
    """An adapter whose tensor names fit ``tiny_model_dir`` but whose shapes don't."""
    return save_tiny_lora(wider_tiny_model_dir, tmp_path_factory.mktemp("tiny-lora-wider"), seed=13)


@pytest.fixture(scope="session")
def gpt2_tiny_lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter for another architecture (GPT-2's fused ``c_attn``), absent from Llama."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = tmp_path_factory.mktemp("tiny-gpt2")
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(model_dir)
    return save_tiny_lora(
        model_dir,
        tmp_path_factory.mktemp("tiny-lora-gpt2"),
        seed=14,
        target_modules=["c_attn"],
        fan_in_fan_out=True,
    )

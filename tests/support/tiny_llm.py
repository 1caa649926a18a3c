"""A complete tiny causal-LM checkpoint built offline: random Llama weights + the tiny tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from tests.support.tiny import build_tokenizer


def build_tiny_llama(
    folder: Path,
    *,
    seed: int = 0,
    tokenizer_from: Path | None = None,
    config_changes: dict[str, int] | None = None,
) -> Path:
    """Save a random-init ``LlamaForCausalLM`` with tokenizer and chat template into ``folder``.

    ``tokenizer_from`` reuses an already trained tokenizer folder (same vocabulary), so two
    checkpoints built with different seeds have identical parameter names and shapes.
    ``config_changes`` overrides fields of :func:`tiny_llama_config` (e.g. wider heads).
    """
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        build_tokenizer(folder)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (folder / name).write_bytes((tokenizer_from / name).read_bytes())
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = tiny_llama_config(tokenizer)
    if config_changes:
        config = LlamaConfig(**{**config.to_dict(), **config_changes})
    torch.manual_seed(seed)
    save_sharpened(LlamaForCausalLM(config), config, folder)
    return folder


def tiny_llama_config(tokenizer: Tokenizer) -> LlamaConfig:
    """The text model of every tiny checkpoint, stopping at ``<|im_end|>``."""
    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.token_to_id("<|im_end|>"),
        pad_token_id=tokenizer.token_to_id("<pad>"),
        tie_word_embeddings=False,
    )


def save_sharpened(model: PreTrainedModel, text_config: LlamaConfig, folder: Path) -> None:
    """Save ``model`` into ``folder`` with its output head scaled up and a generation
    config that stops where ``text_config`` does."""
    # Random init gives near-uniform logits; a wider spread keeps greedy choices stable
    # against float rounding so batched and single runs pick the same tokens.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config = GenerationConfig(
        eos_token_id=text_config.eos_token_id, pad_token_id=text_config.pad_token_id
    )
    model.save_pretrained(folder)


def build_tiny_moe(folder: Path, *, seed: int = 0) -> Path:
    """A random-init Qwen2-MoE checkpoint (8 experts, 2 per token, both layers sparse)
    with the tiny tokenizer: the text model of :func:`tiny_llama_config` made a mixture of
    experts."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    dense = tiny_llama_config(Tokenizer.from_file(str(folder / "tokenizer.json")))
    config = Qwen2MoeConfig(
        **{
            key: getattr(dense, key)
            for key in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
                "eos_token_id",
                "pad_token_id",
                "tie_word_embeddings",
            )
        },
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(seed)
    save_sharpened(Qwen2MoeForCausalLM(config), config, folder)  # type: ignore[arg-type]
    return folder

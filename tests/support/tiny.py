"""Tiny real artifacts built offline for tests: a BPE tokenizer with a chat template."""

from __future__ import annotations

import functools
import glob
import json
import os
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def stdlib_corpus(limit: int = 60) -> list[str]:
    """Source files that ship with every Python: a corpus that needs no download."""
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:limit]


@functools.cache
def _trained_tokenizer(vocab_size: int) -> str:
    """The tokenizer's JSON. Training is deterministic and takes a CPU second, and the
    suite builds dozens of tiny checkpoints: each process trains one per vocabulary size."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(stdlib_corpus(), trainer)
    return tokenizer.to_str(pretty=True)


def build_tokenizer(folder: Path, vocab_size: int = 2000) -> Path:
    """Train a byte-level BPE tokenizer and save it Hugging Face style into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(_trained_tokenizer(vocab_size), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": None,
        "model_max_length": 2048,
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<pad>"}, indent=2)
    )
    return folder


SENTENCEPIECE_WORDS = ["hello", "world", "the", "quick", "brown", "fox"]


def build_sentencepiece_tokenizer(folder: Path) -> Path:
    """A SentencePiece-style tokenizer (Unigram, Metaspace ``▁`` pre-tokenizer and decoder).

    Whole words come first in the vocabulary, so the sample engine, which emits ordinary
    ids in id order, generates ``▁hello ▁world ▁the ...``: tokens whose leading space only
    shows when they follow other text.
    """
    folder.mkdir(parents=True, exist_ok=True)
    pieces = [("<unk>", 0.0), ("</s>", 0.0)]
    pieces += [(f"\u2581{word}", -1.0) for word in SENTENCEPIECE_WORDS]
    pieces += [(char, -5.0) for char in "\u2581abcdefghijklmnopqrstuvwxyz"]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="always"
    )
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.add_special_tokens(["<unk>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 2048,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder

"""A text prompt gets the special tokens the tokenizer's post-processor adds, exactly as
``tokenizers`` (and so Hugging Face and vLLM) add them: none when it adds none, even when
the tokenizer names a BOS token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, processors

from penstock.preprocess import Preprocessor
from tests.preprocess.conftest import SAMPLE_TOKENIZER, ModelFolderFactory

SMOLLM2_TOKENIZER = Path.home() / ".cache/penstock/models/SmolLM2-135M-Instruct"
TEXT = "The capital of France is"


def test_a_named_bos_is_not_added_when_the_post_processor_adds_none(
    model_folder: ModelFolderFactory,
) -> None:
    preprocessor = Preprocessor.from_folder(
        model_folder(extra_config={"bos_token": "<|im_start|>"})
    )
    assert preprocessor.bos_token_id is not None
    ids = preprocessor.encode(TEXT)
    assert preprocessor.with_special_tokens(ids) == ids


def test_the_post_processors_tokens_are_added_around_the_prompt(
    model_folder: ModelFolderFactory,
) -> None:
    tokenizer = Tokenizer.from_file(str(SAMPLE_TOKENIZER / "tokenizer.json"))
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>",
        special_tokens=[("<|im_start|>", start), ("<|im_end|>", end)],
    )
    folder = model_folder()
    tokenizer.save(str(folder / "tokenizer.json"))
    preprocessor = Preprocessor.from_folder(folder)
    ids = preprocessor.encode(TEXT)
    assert preprocessor.with_special_tokens(ids) == [start, *ids, end]
    assert preprocessor.with_special_tokens(ids) == tokenizer.encode(TEXT).ids


@pytest.mark.skipif(not SMOLLM2_TOKENIZER.is_dir(), reason="SmolLM2 is not converted here")
def test_smollm2_prompts_match_the_tokenizer_with_special_tokens() -> None:
    preprocessor = Preprocessor.from_folder(SMOLLM2_TOKENIZER)
    tokenizer = Tokenizer.from_file(str(SMOLLM2_TOKENIZER / "tokenizer.json"))
    config = json.loads((SMOLLM2_TOKENIZER / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>"
    for text in (TEXT, "Hello", "<|im_start|>user\nhi"):
        expected = tokenizer.encode(text, add_special_tokens=True).ids
        assert preprocessor.with_special_tokens(preprocessor.encode(text)) == expected
    assert preprocessor.with_special_tokens(preprocessor.encode(TEXT))[0] != 1

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from penstock.preprocess import Preprocessor
from tests.support.tiny import CHATML_TEMPLATE

SAMPLE_TOKENIZER = Path(__file__).parents[2] / "penstock/engines/assets/sample-tokenizer"

ModelFolderFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def preprocessor() -> Preprocessor:
    """The shipped byte-level BPE tokenizer with its ChatML template."""
    return Preprocessor.from_folder(SAMPLE_TOKENIZER)


@pytest.fixture(scope="session")
def sentencepiece_style(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    """A Llama-style tokenizer: Metaspace pieces, byte fallback, a decoder that strips the
    leading space of the first token."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for character in "\u2581abcdefghijklmnopqrstuvwxyz":
        vocab[character] = len(vocab)
    merges = [("\u2581", "t"), ("h", "e"), ("\u2581t", "he"), ("r", "e"), ("\u2581the", "re")]
    merges += [("\u2581", "h"), ("\u2581h", "i")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(["<s>", "</s>"])
    folder = tmp_path_factory.mktemp("sentencepiece-style")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return Preprocessor.from_folder(folder)


@pytest.fixture
def model_folder(tmp_path: Path) -> ModelFolderFactory:
    """Writes a model folder: the sample tokenizer.json plus the given config files."""

    def write(
        *,
        chat_template: Any = CHATML_TEMPLATE,
        extra_config: dict[str, Any] | None = None,
        files: dict[str, Any] | None = None,
    ) -> Path:
        folder = tmp_path / "model"
        folder.mkdir(exist_ok=True)
        shutil.copy(SAMPLE_TOKENIZER / "tokenizer.json", folder / "tokenizer.json")
        config: dict[str, Any] = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
        if chat_template is not None:
            config["chat_template"] = chat_template
        config.update(extra_config or {})
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        for name, content in (files or {}).items():
            text = content if isinstance(content, str) else json.dumps(content)
            (folder / name).write_text(text, encoding="utf-8")
        return folder

    return write


@pytest.fixture
def with_template(model_folder: ModelFolderFactory) -> Callable[[str], Preprocessor]:
    """A preprocessor whose chat template is the given source."""

    def load(template: str) -> Preprocessor:
        return Preprocessor.from_folder(model_folder(chat_template=template))

    return load

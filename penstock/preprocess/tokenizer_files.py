"""Reading a Hugging Face style tokenizer folder: tokenizer, chat templates, special tokens.

Only local files are read; nothing is downloaded. The fast tokenizer (``tokenizer.json``) is
loaded with the ``tokenizers`` library directly so that serving never imports transformers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from penstock.errors import PreprocessorLoadError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_JINJA_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE = "chat_template.json"

DEFAULT_TEMPLATE_NAME = "default"

# transformers writes int(1e30) as model_max_length when the real limit is unknown.
_UNKNOWN_MODEL_MAX_LENGTH = int(1e30)

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclass(frozen=True)
class TokenizerFiles:
    """Everything the preprocessor needs from a tokenizer folder, already parsed."""

    folder: Path
    tokenizer: Tokenizer
    chat_templates: dict[str, str]
    special_tokens: dict[str, str]
    generation_eos_token_ids: list[int]
    model_max_length: int | None


def read_tokenizer_folder(path: str | os.PathLike[str]) -> TokenizerFiles:
    folder = Path(path)
    if not folder.is_dir():
        raise PreprocessorLoadError(f"Tokenizer folder {folder} does not exist or is not a folder")
    tokenizer = _load_tokenizer(folder / TOKENIZER_FILE)
    tokenizer_config = _read_json_object(folder / TOKENIZER_CONFIG_FILE)
    special_tokens_map = _read_json_object(folder / SPECIAL_TOKENS_MAP_FILE)
    generation_config = _read_json_object(folder / GENERATION_CONFIG_FILE)
    return TokenizerFiles(
        folder=folder,
        tokenizer=tokenizer,
        chat_templates=_read_chat_templates(folder, tokenizer_config),
        special_tokens=_special_tokens(tokenizer_config, special_tokens_map),
        generation_eos_token_ids=_generation_eos_token_ids(
            generation_config, folder / GENERATION_CONFIG_FILE
        ),
        model_max_length=_model_max_length(tokenizer_config),
    )


def _load_tokenizer(file: Path) -> Tokenizer:
    if not file.is_file():
        raise PreprocessorLoadError(
            f"{file} is missing: Penstock needs a fast tokenizer file ({TOKENIZER_FILE}) "
            "in the model folder"
        )
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust loader raises plain Exception for any parse error
        raise PreprocessorLoadError(f"{file} could not be loaded as a tokenizer: {exc}") from exc
    # A tokenizer.json saved during training may carry truncation or padding; applied to a
    # prompt they would silently cut or pad it.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _read_json_object(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PreprocessorLoadError(f"{file} is unreadable: {exc}") from exc
    if not isinstance(value, dict):
        raise PreprocessorLoadError(f"{file} must hold a JSON object, not {type(value).__name__}")
    return value


def _read_chat_templates(folder: Path, tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """Templates by name; a lone template is named ``default``.

    Like transformers, a standalone template file wins over the one inside
    ``tokenizer_config.json`` (``save_pretrained`` writes the file and drops the key).
    """
    jinja_file = folder / CHAT_TEMPLATE_JINJA_FILE
    if jinja_file.is_file():
        try:
            return {DEFAULT_TEMPLATE_NAME: jinja_file.read_text(encoding="utf-8")}
        except (OSError, UnicodeDecodeError) as exc:
            raise PreprocessorLoadError(f"{jinja_file} is unreadable: {exc}") from exc
    json_file = folder / CHAT_TEMPLATE_JSON_FILE
    processor_config = _read_json_object(json_file)
    if "chat_template" in processor_config:
        return _parse_chat_template_value(processor_config["chat_template"], json_file)
    return _parse_chat_template_value(
        tokenizer_config.get("chat_template"), folder / TOKENIZER_CONFIG_FILE
    )


def _parse_chat_template_value(value: Any, source: Path) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT_TEMPLATE_NAME: value}
    if isinstance(value, list):
        templates: dict[str, str] = {}
        for entry in value:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise PreprocessorLoadError(
                    f"{source}: each chat_template entry must be "
                    '{"name": <string>, "template": <string>}'
                )
            templates[entry["name"]] = entry["template"]
        return templates
    raise PreprocessorLoadError(
        f"{source}: chat_template must be a string or a list of named templates, "
        f"not {type(value).__name__}"
    )


def _special_tokens(
    tokenizer_config: dict[str, Any], special_tokens_map: dict[str, Any]
) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        content = _token_content(tokenizer_config.get(key))
        if content is None:
            content = _token_content(special_tokens_map.get(key))
        if content is not None:
            tokens[key] = content
    return tokens


def _token_content(value: Any) -> str | None:
    """A special token is written either as its text or as ``{"content": text, ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _generation_eos_token_ids(generation_config: dict[str, Any], source: Path) -> list[int]:
    value = generation_config.get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in values):
        raise PreprocessorLoadError(
            f"{source}: eos_token_id must be an integer or a list of integers, got {value!r}"
        )
    return values


def _model_max_length(tokenizer_config: dict[str, Any]) -> int | None:
    value = tokenizer_config.get("model_max_length")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if value <= 0 or value >= _UNKNOWN_MODEL_MAX_LENGTH:
        return None
    return value

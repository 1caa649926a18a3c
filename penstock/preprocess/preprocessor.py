"""One model's tokenizer and chat template, the text side of the token pipeline."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from penstock.errors import InvalidRequestError, PreprocessorLoadError
from penstock.preprocess.chat_template import (
    compile_template,
    iterates_content,
    render_template,
    select_template_name,
)
from penstock.preprocess.detokenizer import IncrementalDetokenizer, PlainTokenTexts
from penstock.preprocess.segments import segmented_encoder
from penstock.preprocess.token_bytes import is_byte_level, token_bytes_reader
from penstock.preprocess.tokenizer_files import (
    TokenizerFiles,
    read_tokenizer_folder,
)

# Past this many characters (or token ids), text goes through the tokenizer's batch calls,
# which release the GIL while they work, so a worker thread tokenizing a long prompt
# leaves the event loop running; the single calls hold it, and are quicker on short input.
RELEASE_GIL_SIZE = 4096


class Preprocessor:
    """Tokenizer + chat template of one model, loaded from a local folder."""

    def __init__(self, files: TokenizerFiles) -> None:
        self.folder: Path = files.folder
        self._tokenizer = files.tokenizer
        self._special_tokens = files.special_tokens
        self._segments = segmented_encoder(self._tokenizer, batch_above=RELEASE_GIL_SIZE)
        self._templates = _compile_templates(files)
        self._content_parts = {
            name: iterates_content(source) for name, source in files.chat_templates.items()
        }
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.model_max_length: int | None = files.model_max_length
        self.bos_token_id: int | None = self._special_token_id("bos_token")
        self._added_before, self._added_after = _post_processor_tokens(self._tokenizer)
        self.eos_token_ids: list[int] = _unique(
            [
                *([eos] if (eos := self._special_token_id("eos_token")) is not None else []),
                *files.generation_eos_token_ids,
            ]
        )
        self._added_tokens = {
            token_id: added.content
            for token_id, added in self._tokenizer.get_added_tokens_decoder().items()
        }
        self._read_token_bytes = token_bytes_reader(self._tokenizer)
        self._plain_texts = (
            PlainTokenTexts(self._tokenizer) if is_byte_level(self._tokenizer) else None
        )
        self._token_texts: dict[int, str] = {}
        # An upper bound on any token's length in characters: byte-level entries count
        # bytes, word-piece entries their "##", so the stored form is never shorter.
        self.max_token_chars: int = max(
            (len(token) for token in self._tokenizer.get_vocab(with_added_tokens=True)),
            default=1,
        )

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str]) -> Preprocessor:
        return cls(read_tokenizer_folder(path))

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are parsed as special,
        none are added."""
        if self._segments is not None:
            return self._segments.encode(text)
        if len(text) > RELEASE_GIL_SIZE:
            return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def with_special_tokens(self, token_ids: list[int]) -> list[int]:
        """``token_ids`` with the special tokens the tokenizer's post-processor puts around
        one input (``add_special_tokens=True`` in Hugging Face): a BOS for Llama 3, none for
        SmolLM2 or Qwen. What vLLM and ``AutoTokenizer`` make of a text prompt."""
        if not self._added_before and not self._added_after:
            return token_ids
        return [*self._added_before, *token_ids, *self._added_after]

    def encode_inputs(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text with the special tokens the tokenizer adds around an
        input (BERT's ``[CLS]`` and ``[SEP]``, a BOS): what embedding and classification
        checkpoints were trained on. One batch call, which leaves the GIL."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts)]

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        if len(token_ids) > RELEASE_GIL_SIZE:
            return self._tokenizer.decode_batch(
                [token_ids], skip_special_tokens=skip_special_tokens
            )[0]
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        name = select_template_name(self._templates, tools)
        if name is None:
            raise InvalidRequestError(
                "This model has no chat template, so it cannot serve chat requests; "
                "send the prompt text to /v1/completions instead.",
                param="messages",
            )
        return render_template(
            self._templates[name],
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self._special_tokens,
            chat_template_kwargs=chat_template_kwargs,
            content_parts=self._content_parts.get(name, False),
        )

    def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return self.encode(
            self.render_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
        )

    def new_detokenizer(
        self, prompt_token_ids: list[int] | None = None, *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self._tokenizer,
            prompt_token_ids,
            skip_special_tokens=skip_special_tokens,
            plain_texts=self._plain_texts,
        )

    def token_text(self, token_id: int) -> str:
        """Text of one token as logprobs show it ("" for an id outside the vocabulary)."""
        text = self._token_texts.get(token_id)
        if text is None:
            if not 0 <= token_id < self.vocab_size:
                return ""
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it (byte-level BPE's ``Ġ`` for a space),
        as vLLM's ``/tokenize`` returns ``token_strs``; "" for an id outside it."""
        id_to_token = self._tokenizer.id_to_token
        return [id_to_token(token_id) or "" for token_id in token_ids]

    def token_bytes(self, token_id: int) -> list[int]:
        """UTF-8 bytes of one token; part of a multi-byte character gives just its part."""
        added = self._added_tokens.get(token_id)
        if added is not None:
            return list(added.encode("utf-8"))
        piece = self._tokenizer.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        if piece is None:
            return []
        return list(self._read_token_bytes(piece))

    def _special_token_id(self, key: str) -> int | None:
        token = self._special_tokens.get(key)
        return None if token is None else self._tokenizer.token_to_id(token)


def _post_processor_tokens(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the post-processor adds before and after one input, read off one probe."""
    encoding = tokenizer.encode("a", add_special_tokens=True)
    ids, added = encoding.ids, encoding.special_tokens_mask
    before = 0
    while before < len(ids) and added[before]:
        before += 1
    after = len(ids)
    while after > before and added[after - 1]:
        after -= 1
    return ids[:before], ids[after:]


def _compile_templates(files: TokenizerFiles) -> dict[str, jinja2.Template]:
    compiled: dict[str, jinja2.Template] = {}
    for name, source in files.chat_templates.items():
        try:
            compiled[name] = compile_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise PreprocessorLoadError(
                f"The chat template {name!r} in {files.folder} does not compile: "
                f"{exc.message} (line {exc.lineno})"
            ) from exc
    return compiled


def _unique(values: list[int]) -> list[int]:
    return list(dict.fromkeys(values))

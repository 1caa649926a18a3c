"""Streaming token ids to text without splitting a UTF-8 character."""

from __future__ import annotations

import logging

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from penstock.preprocess.token_bytes import byte_level_bytes

logger = logging.getLogger(__name__)

# DecodeStream raises this when a decoder is not prefix-stable (the text of the tokens seen
# so far changes once more arrive); starting a fresh stream recovers.
_INVALID_PREFIX_MESSAGE = "Invalid prefix encountered"

# How much of the prompt primes the stream: enough context for decoders that treat the
# first token specially (a SentencePiece leading space), small enough to stay cheap.
_PRIMING_TOKENS = 8


class PlainTokenTexts:
    """The text of each token a byte-level decoder turns into whole characters by itself.

    With a byte-level decoder a token stands for the same bytes wherever it appears, so
    when the stream so far ends on a character boundary, such a token's text is its own
    decoding, whatever came before: a lookup replaces a pass through ``DecodeStream``.
    Tokens that hold part of a character, and added (special) tokens, map to ``""`` and
    go through the stream. One table per tokenizer, filled as tokens are first seen.
    """

    __slots__ = ("_added", "_texts", "_tokenizer", "_vocab_size")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._added = frozenset(tokenizer.get_added_tokens_decoder())
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._texts: dict[int, str] = {}

    def get(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._read(token_id)
            if isinstance(token_id, int) and 0 <= token_id < self._vocab_size:
                self._texts[token_id] = text
        return text

    def _read(self, token_id: int) -> str:
        if not isinstance(token_id, int) or token_id in self._added:
            return ""
        if not 0 <= token_id < self._vocab_size:
            return ""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return ""
        try:
            return byte_level_bytes(piece).decode("utf-8")
        except UnicodeDecodeError:
            return ""


class IncrementalDetokenizer:
    """Turns a stream of token ids into text without ever emitting a broken UTF-8 character.

    ``DecodeStream`` holds back a token while the text ends in an incomplete character, so
    each :meth:`step` returns only whole characters ("" while one is incomplete).
    :meth:`flush` returns whatever is still held back once the stream ends.
    """

    __slots__ = ("_pending_ids", "_plain", "_skip_special_tokens", "_stream", "_tokenizer")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        plain_texts: PlainTokenTexts | None = None,
    ) -> None:
        """``plain_texts``: the tokenizer's table when its decoder is byte-level (no token
        then depends on what precedes it, so the prompt need not prime the stream)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._plain = plain_texts
        # With the table, the stream is made at the first token it has no text for: most
        # completions never need one.
        self._stream: DecodeStream | None = (
            None
            if plain_texts is not None
            else DecodeStream(
                _priming_ids(tokenizer, prompt_token_ids), skip_special_tokens=skip_special_tokens
            )
        )
        self._pending_ids: list[int] = []

    def step(self, token_id: int) -> str:
        plain = self._plain
        if plain is not None and not self._pending_ids:
            # The table's dict first: a token seen before costs no call of its own.
            text = plain._texts.get(token_id) or plain.get(token_id)
            if text:
                return text
        stream = self._stream
        if stream is None:
            stream = self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        try:
            text = stream.step(self._tokenizer, token_id)
        except (OverflowError, TypeError):
            # The Rust side refuses ids that are not u32 (negative, huge); they have no text.
            return ""
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX_MESSAGE):
                raise
            logger.debug("detokenizer prefix became invalid; restarting the decode stream")
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            text = self._stream.step(self._tokenizer, [*self._pending_ids, token_id])
        if text is None:
            self._pending_ids.append(token_id)
            return ""
        if self._pending_ids:
            self._pending_ids.clear()
        return text

    def flush(self) -> str:
        """Text of tokens still held back at the end of the stream (with U+FFFD for bytes
        that never formed a character)."""
        if not self._pending_ids:
            return ""
        text = self._tokenizer.decode(
            self._pending_ids, skip_special_tokens=self._skip_special_tokens
        )
        self._pending_ids.clear()
        return text


def _priming_ids(tokenizer: Tokenizer, prompt_token_ids: list[int] | None) -> list[int] | None:
    """The shortest prompt tail (at least ``_PRIMING_TOKENS``) that decodes to whole characters.

    A tail starting inside a multi-byte character would decode to U+FFFD, which the stream
    would then see as an incomplete character.
    """
    if not prompt_token_ids:
        return None
    for length in range(_PRIMING_TOKENS, min(len(prompt_token_ids), 4 * _PRIMING_TOKENS) + 1):
        tail = prompt_token_ids[-length:]
        if "\ufffd" not in tokenizer.decode(tail, skip_special_tokens=False):
            return tail
    if len(prompt_token_ids) <= _PRIMING_TOKENS:
        return list(prompt_token_ids)
    return None

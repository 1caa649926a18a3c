"""ASCII text through a GPT-2 style byte-level tokenizer, word by word, in Python.

A byte-level tokenizer with ``use_regex`` splits text into words with GPT-2's pattern,
maps each word's bytes to printable characters and runs its model on each word alone.
Most of a short prompt's tokenizing time is that split (the tokenizer tracks every
character's offsets while it cuts); on ASCII the pattern is plain character classes,
which Python's ``re`` matches exactly as the tokenizer's Oniguruma does, and a word seen
before needs no model call. Text with any other character takes the tokenizer, whose
``\\p{L}``, ``\\p{N}`` and ``\\s`` follow Unicode tables Python's ``re`` does not share.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer

from penstock.preprocess.token_bytes import byte_level_alphabet

# GPT-2's split (``'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+``)
# for ASCII: ``\p{L}`` is A-Z and a-z, ``\p{N}`` 0-9, and ``\s`` Unicode's White_Space, of
# which ASCII has these six (not the separators 0x1C-0x1F that Python's ``\s`` adds).
_SPACE = r" \t\n\x0b\x0c\r"
_ASCII_GPT2_SPLIT = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_SPACE}A-Za-z0-9]+"
    rf"|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+"
)

# Words remembered with their ids (~150 bytes each); past this many the memory starts
# again: a chat's vocabulary comes back quickly, and clearing costs nothing per lookup.
DEFAULT_CAPACITY_WORDS = 1 << 14


class ByteLevelWords:
    """Token ids of ASCII text holding no added token, for one byte-level tokenizer
    (see :func:`byte_level_words`). Safe to call from several threads at once."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        add_prefix_space: bool,
        capacity_words: int = DEFAULT_CAPACITY_WORDS,
    ) -> None:
        self._model = tokenizer.model
        self._add_prefix_space = add_prefix_space
        # Each ASCII character's printable stand-in in the tokenizer's vocabulary.
        self._printable = str.maketrans(
            {
                chr(byte): character
                for character, byte in byte_level_alphabet().items()
                if byte < 128
            }
        )
        self._capacity_words = capacity_words
        self._words: dict[str, tuple[int, ...]] = {}

    def ids(self, text: str) -> list[int]:
        """``text`` must be ASCII with no added token in it (the caller splits them off)."""
        if self._add_prefix_space and text and not text.startswith(" "):
            text = " " + text
        ids: list[int] = []
        words = self._words
        for word in _ASCII_GPT2_SPLIT.findall(text):
            known = words.get(word)
            if known is None:
                known = self._word_ids(word)
            ids += known
        return ids

    def _word_ids(self, word: str) -> tuple[int, ...]:
        ids = tuple(token.id for token in self._model.tokenize(word.translate(self._printable)))
        if len(self._words) >= self._capacity_words:
            self._words.clear()
        self._words[word] = ids
        return ids


def byte_level_words(tokenizer: Tokenizer) -> ByteLevelWords | None:
    """A :class:`ByteLevelWords` for ``tokenizer`` when its pre-tokenizer is exactly a
    byte-level one with GPT-2's split and nothing normalizes the text first; else None."""
    if tokenizer.normalizer is not None or tokenizer.pre_tokenizer is None:
        return None
    config: dict[str, Any] = json.loads(tokenizer.pre_tokenizer.__getstate__())
    if config.get("type") != "ByteLevel" or not config.get("use_regex", True):
        return None
    return ByteLevelWords(tokenizer, add_prefix_space=bool(config.get("add_prefix_space")))

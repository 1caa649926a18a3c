"""ASCII text through a byte-level BPE tokenizer, word by word, in Python.

A byte-level tokenizer splits text into words with a regular expression (GPT-2's, or a
``Split`` pre-tokenizer's such as Llama 3's or Qwen2's), maps each word's bytes to
printable characters and runs its model on each word alone. Most of a short prompt's
tokenizing time is that split (the tokenizer tracks every character's offsets while it
cuts); on ASCII the known patterns are plain character classes, which Python's ``re``
matches exactly as the tokenizer's Oniguruma does, and a word seen before needs no model
call. Text with any other character takes the tokenizer, whose ``\\p{L}``, ``\\p{N}`` and
``\\s`` follow Unicode tables Python's ``re`` does not share.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer

from penstock.preprocess.token_bytes import byte_level_alphabet

# For ASCII, ``\p{L}`` is A-Z and a-z, ``\p{N}`` 0-9, and ``\s`` Unicode's White_Space, of
# which ASCII has these six (not the separators 0x1C-0x1F that Python's ``\s`` adds).
_SPACE = r" \t\n\x0b\x0c\r"
_WORD_END = rf"[{_SPACE}]*[\r\n]+|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+"

# GPT-2's split, ``'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+``
# (a byte-level pre-tokenizer's own, with ``use_regex``), for ASCII.
_GPT2_SPLIT = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_SPACE}A-Za-z0-9]+"
    rf"|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+"
)

# ``Split`` patterns as tokenizer.json files write them, each with its ASCII form.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_ASCII_SPLITS = {
    _LLAMA3_SPLIT: re.compile(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}"
        rf"| ?[^{_SPACE}A-Za-z0-9]+[\r\n]*|{_WORD_END}"
    ),
    _QWEN2_SPLIT: re.compile(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
        rf"| ?[^{_SPACE}A-Za-z0-9]+[\r\n]*|{_WORD_END}"
    ),
}

# Normalizers that leave ASCII text as it is.
_ASCII_IDENTITY_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})

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
        split: re.Pattern[str],
        add_prefix_space: bool,
        capacity_words: int = DEFAULT_CAPACITY_WORDS,
    ) -> None:
        self._model = tokenizer.model
        self._split = split
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
        for word in self._split.findall(text):
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
    """A :class:`ByteLevelWords` for ``tokenizer`` when its words are split by a pattern
    known here and then mapped byte-level, and its normalizer, if any, leaves ASCII as it
    is; else None.

    Two shapes qualify: a byte-level pre-tokenizer with GPT-2's split (``use_regex``), and
    a ``Split`` of a known pattern (isolating its matches) followed by a byte-level one
    without its own split or prefix space (Llama 3's, Qwen2's).
    """
    if tokenizer.pre_tokenizer is None or not _leaves_ascii(tokenizer.normalizer):
        return None
    config: dict[str, Any] = json.loads(tokenizer.pre_tokenizer.__getstate__())
    if config.get("type") == "ByteLevel" and config.get("use_regex", True):
        return ByteLevelWords(
            tokenizer, split=_GPT2_SPLIT, add_prefix_space=bool(config.get("add_prefix_space"))
        )
    if config.get("type") != "Sequence":
        return None
    parts = config.get("pretokenizers") or []
    if len(parts) != 2:
        return None
    split, byte_level = parts
    pattern = (split.get("pattern") or {}).get("Regex")
    if (
        split.get("type") != "Split"
        or pattern not in _ASCII_SPLITS
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex", True)
        or byte_level.get("add_prefix_space")
    ):
        return None
    return ByteLevelWords(tokenizer, split=_ASCII_SPLITS[pattern], add_prefix_space=False)


def _leaves_ascii(normalizer: Any) -> bool:
    if normalizer is None:
        return True
    config: dict[str, Any] = json.loads(normalizer.__getstate__())
    if config.get("type") == "Sequence":
        return all(
            part.get("type") in _ASCII_IDENTITY_NORMALIZERS for part in config["normalizers"]
        )
    return config.get("type") in _ASCII_IDENTITY_NORMALIZERS

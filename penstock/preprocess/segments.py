"""Tokenizing between added tokens, with the long pieces that recur remembered.

A chat prompt is the same system prompt and earlier turns again and again, cut apart by
the template's added tokens (``<|im_start|>``, ``<|im_end|>``). A tokenizer splits its
input at every added token before anything else, and then tokenizes each piece on its
own; for the tokenizers :func:`segmented_encoder` accepts, the ids of a text are
therefore the ids of its parts, joined. :class:`SegmentedEncoder` keeps the ids of long
pieces it has seen, so a long system prompt or conversation history is not tokenized
again with every request; for a GPT-2 style byte-level tokenizer, the rest of an ASCII
text goes word by word (:mod:`penstock.preprocess.byte_level_words`).
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice
from typing import Any

from tokenizers import Tokenizer

from penstock.preprocess.byte_level_words import ByteLevelWords, byte_level_words

# Pre-tokenizers that cut each piece alone, whatever comes before or after it.
# ``Metaspace`` is missing on purpose: with ``prepend_scheme="first"`` it marks only the
# text's first piece, which a piece tokenized alone cannot know.
_PIECEWISE_PRE_TOKENIZERS = frozenset(
    {
        "BertPreTokenizer",
        "ByteLevel",
        "CharDelimiterSplit",
        "Digits",
        "Punctuation",
        "Split",
        "UnicodeScripts",
        "Whitespace",
        "WhitespaceSplit",
    }
)

# Pieces (and texts) shorter than this are tokenized with what is around them and never
# kept: cutting a piece out costs a tokenizer call of its own, a few µs, which a short
# piece's tokens would not repay (bench/README.md, "Prompts tokenized by pieces and by
# words").
DEFAULT_MIN_PIECE_CHARS = 128

# A long text with more added tokens than this is tokenized whole (see
# ``SegmentedEncoder._many_added_tokens``): 128 turns of a conversation, whose pieces
# hold the GIL ~1 ms in all at most.
MAX_CUTS = 256

# What the remembered pieces may take, in bytes: a piece's text, its ids as 32-bit integers
# and what each entry costs on top (``_ENTRY_BYTES``: the string, array and dict entries).
DEFAULT_CAPACITY_BYTES = 4 << 20
_ENTRY_BYTES = 200


class SegmentedEncoder:
    """Token ids of a text, its long pieces between the tokenizer's added tokens taken from
    those kept (least recently used dropped first), the rest tokenized in runs, or by
    ``words`` when the text is ASCII.

    Safe to call from several threads at once: the preprocessing pool's workers tokenize
    long prompts while the event loop tokenizes short ones.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        batch_above: int,
        words: ByteLevelWords | None = None,
        min_piece_chars: int = DEFAULT_MIN_PIECE_CHARS,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
    ) -> None:
        self._tokenizer = tokenizer
        added = {token.content: token_id for token_id, token in _added_tokens(tokenizer)}
        self._added_ids = added
        # Longest first: at one position the regex takes the first alternative that
        # matches, so this finds the leftmost-longest token, as the tokenizer does.
        alternatives = sorted(added, key=len, reverse=True)
        self._splitter = re.compile("|".join(map(re.escape, alternatives)))
        self._min_piece_chars = min_piece_chars
        self._words = words
        self._capacity_bytes = capacity_bytes
        self._batch_above = batch_above
        self._pieces: OrderedDict[str, array[int]] = OrderedDict()
        self._held_bytes = 0
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        # A long text is tokenized on a worker thread: its tokenizer calls are the batch
        # ones, which release the GIL while they work, so the event loop runs meanwhile.
        # The single call holds it, and is quicker on the short texts the loop tokenizes.
        release = len(text) > self._batch_above
        if release and self._many_added_tokens(text):
            return self._tokenize(text, release)
        if self._words is not None and text.isascii():
            return self._encode_ascii(text, release)
        if len(text) < self._min_piece_chars:
            return self._tokenize(text, release)
        ids: list[int] = []
        # The text from ``run_start`` on is not tokenized yet; ``piece_start`` is where the
        # piece after the last added token begins.
        run_start = piece_start = 0
        for token in self._splitter.finditer(text):
            if token.start() - piece_start >= self._min_piece_chars:
                ids += self._run(text[run_start:piece_start], release)
                ids += self._piece(text[piece_start : token.start()], release)
                run_start = token.start()
            piece_start = token.end()
        if len(text) - piece_start >= self._min_piece_chars:
            ids += self._run(text[run_start:piece_start], release)
            ids += self._piece(text[piece_start:], release)
        else:
            ids += self._run(text[run_start:], release)
        return ids

    def _many_added_tokens(self, text: str) -> bool:
        """Whether ``text`` holds more than ``MAX_CUTS`` added tokens: cut at every one,
        the Python around each piece would hold the GIL for as long as there are pieces."""
        return next(islice(self._splitter.finditer(text), MAX_CUTS, None), None) is not None

    def _encode_ascii(self, text: str, release: bool) -> list[int]:
        ids: list[int] = []
        start = 0
        for token in self._splitter.finditer(text):
            if token.start() > start:
                ids += self._ascii_piece(text[start : token.start()], release)
            ids.append(self._added_ids[token.group()])
            start = token.end()
        if start < len(text):
            ids += self._ascii_piece(text[start:], release)
        return ids

    def _ascii_piece(self, piece: str, release: bool) -> Sequence[int]:
        if len(piece) >= self._min_piece_chars:
            return self._piece(piece, release)
        assert self._words is not None
        return self._words.ids(piece)

    def _run(self, text: str, release: bool) -> list[int]:
        added = self._added_ids.get(text)
        if added is not None:
            return [added]
        return self._tokenize(text, release) if text else []

    def _piece(self, piece: str, release: bool) -> array[int]:
        with self._lock:
            known = self._pieces.get(piece)
            if known is not None:
                self._pieces.move_to_end(piece)
                return known
        ids = array("I", self._tokenize(piece, release))
        if _entry_bytes(piece, ids) <= self._capacity_bytes:
            self._remember(piece, ids)
        return ids

    def _tokenize(self, text: str, release: bool) -> list[int]:
        if release:
            return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def _remember(self, piece: str, ids: array[int]) -> None:
        with self._lock:
            if piece in self._pieces:
                return
            self._pieces[piece] = ids
            self._held_bytes += _entry_bytes(piece, ids)
            while self._held_bytes > self._capacity_bytes:
                dropped = self._pieces.popitem(last=False)
                self._held_bytes -= _entry_bytes(*dropped)


def _entry_bytes(piece: str, ids: array[int]) -> int:
    return len(piece) + ids.itemsize * len(ids) + _ENTRY_BYTES


def segmented_encoder(tokenizer: Tokenizer, *, batch_above: int) -> SegmentedEncoder | None:
    """A :class:`SegmentedEncoder` of ``tokenizer`` (texts over ``batch_above`` characters
    make only GIL-releasing batch calls), or None when the tokenizer's ids of a text may
    differ from the joined ids of the text's pieces.

    They are the same when nothing reads across the added tokens' cuts: added tokens
    matched exactly in the raw text (no ``lstrip``, ``rstrip``, ``single_word`` or
    ``normalized``, no two with one text), special tokens split out, a pre-tokenizer from
    the piecewise set, and no truncation or padding. A normalizer is no obstacle: the
    tokenizer normalizes each piece alone too, after cutting out the added tokens.
    """
    added = _added_tokens(tokenizer)
    if not added or tokenizer.encode_special_tokens:
        return None
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return None
    if any(t.lstrip or t.rstrip or t.single_word or t.normalized for _, t in added):
        return None
    contents = [t.content for _, t in added]
    if "" in contents or len(set(contents)) != len(contents):
        return None
    pre_tokenizer = tokenizer.pre_tokenizer
    if pre_tokenizer is not None and not _is_piecewise(json.loads(pre_tokenizer.__getstate__())):
        return None
    return SegmentedEncoder(tokenizer, batch_above=batch_above, words=byte_level_words(tokenizer))


def _added_tokens(tokenizer: Tokenizer) -> list[tuple[int, Any]]:
    return sorted(tokenizer.get_added_tokens_decoder().items())


def _is_piecewise(config: dict[str, Any]) -> bool:
    if config.get("type") == "Sequence":
        return all(_is_piecewise(part) for part in config.get("pretokenizers", []))
    return config.get("type") in _PIECEWISE_PRE_TOKENIZERS

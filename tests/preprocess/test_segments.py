"""Tokenizing piece by piece between added tokens gives the tokenizer's own ids."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers

from penstock.preprocess import Preprocessor
from penstock.preprocess.byte_level_words import _GPT2_SPLIT, ByteLevelWords, byte_level_words
from penstock.preprocess.segments import (
    MAX_CUTS,
    SegmentedEncoder,
    _entry_bytes,
    segmented_encoder,
)
from tests.preprocess.conftest import SAMPLE_TOKENIZER

ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


class CountingTokenizer:
    """A tokenizer that records the texts of its single and batch calls."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.single: list[str] = []
        self.batch: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.tokenizer, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> object:
        self.single.append(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> object:
        self.batch.extend(texts)
        return self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)


def _sample_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(SAMPLE_TOKENIZER / "tokenizer.json"))


def _with_pre_tokenizer(pre_tokenizer: pre_tokenizers.PreTokenizer) -> Tokenizer:
    tokenizer = _sample_tokenizer()
    tokenizer.pre_tokenizer = pre_tokenizer
    return tokenizer


def _split_then_bytes(pattern: str, *, prefix_space: bool = False) -> pre_tokenizers.Sequence:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(pattern=Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=False),
        ]
    )


def _with_normalizer(
    pre_tokenizer: pre_tokenizers.PreTokenizer, normalizer: normalizers.Normalizer
) -> Tokenizer:
    tokenizer = _with_pre_tokenizer(pre_tokenizer)
    tokenizer.normalizer = normalizer
    return tokenizer


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

PIECEWISE_TOKENIZERS = {
    "sample": _sample_tokenizer(),
    "Llama 3's split, then byte-level": _with_pre_tokenizer(_split_then_bytes(LLAMA3_SPLIT)),
    "Qwen2's split, then byte-level, NFC": _with_normalizer(
        _split_then_bytes(QWEN2_SPLIT), normalizers.NFC()
    ),
    "byte-level, lowercased": _with_normalizer(
        pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.Lowercase()
    ),
    "byte-level with a prefix space": _with_pre_tokenizer(
        pre_tokenizers.ByteLevel(add_prefix_space=True)
    ),
    "split digits, then byte-level": _with_pre_tokenizer(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(pattern=Regex(r"\d{1,3}"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    ),
}

# Text made of what a chat prompt has: words, spaces, newlines, digits, contractions,
# ASCII control characters, non-ASCII, the added tokens, and pieces of them that are not.
fragments = st.sampled_from(
    [
        *ADDED,
        *("<|im_", "im_end|>", "<", "|>", " ", "  ", "\n", "\n\n", "user", "system"),
        *(
            "'s",
            "'S",
            "'ll",
            "'LL",
            "don't",
            "12345",
            "7",
            "\t",
            "\r\n",
            "\x0b",
            "\x0c",
            "\x1c",
            "\x7f",
            " \n ",
        ),
    ]
)
ascii_text = st.text(alphabet=st.characters(max_codepoint=127), max_size=12)
ascii_prompts = st.lists(
    st.one_of(fragments, ascii_text, st.from_regex(r"[0-9]{1,7}", fullmatch=True)),
    max_size=14,
).map("".join)
prompts = st.one_of(
    ascii_prompts,
    st.lists(st.one_of(fragments, ascii_text, st.text(max_size=12)), max_size=14).map("".join),
)


@pytest.mark.parametrize("with_words", [False, True])
@pytest.mark.parametrize("min_piece_chars", [1, 6, 128])
@pytest.mark.parametrize("name", PIECEWISE_TOKENIZERS)
@settings(max_examples=150, deadline=None)
@given(text=prompts)
def test_the_ids_are_the_tokenizers_own_first_time_and_remembered(
    name: str, min_piece_chars: int, with_words: bool, text: str
) -> None:
    tokenizer = PIECEWISE_TOKENIZERS[name]
    assert segmented_encoder(tokenizer, batch_above=4096) is not None
    encoder = SegmentedEncoder(
        tokenizer,
        batch_above=4096,
        min_piece_chars=min_piece_chars,
        words=byte_level_words(tokenizer) if with_words else None,
    )
    expected = tokenizer.encode(text, add_special_tokens=False).ids
    assert encoder.encode(text) == expected
    assert encoder.encode(text) == expected


def test_a_long_system_prompt_is_tokenized_once_and_the_rest_in_one_call() -> None:
    tokenizer = _sample_tokenizer()
    counting = CountingTokenizer(tokenizer)
    calls = counting.single
    encoder = SegmentedEncoder(
        counting,  # type: ignore[arg-type]
        batch_above=4096,
        min_piece_chars=30,
    )
    system = "system\nYou are terse: one line, no more."
    for question in ("What is 2+2?", "And 3+3?"):
        text = f"<|im_start|>{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
    assert calls == [
        system,
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
        "<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n",
    ]
    # Below the shortest piece kept, a text is one call, as without pieces.
    calls.clear()
    assert encoder.encode("<|im_start|>user\nhi") == [1, *tokenizer.encode("user\nhi").ids]
    assert calls == ["<|im_start|>user\nhi"]


def test_the_remembered_text_stays_within_its_capacity() -> None:
    tokenizer = _sample_tokenizer()
    encoder = SegmentedEncoder(tokenizer, batch_above=4096, min_piece_chars=1, capacity_bytes=1000)
    texts = [f"<|im_start|>user\nquestion number {i}<|im_end|>" for i in range(50)]
    texts.append("<|im_start|>" + "a long piece that no cache of a kilobyte holds" * 30)
    for text in texts + texts[::-1]:
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
        held = sum(_entry_bytes(piece, ids) for piece, ids in encoder._pieces.items())
        assert held == encoder._held_bytes <= 1000
    assert len(encoder._pieces) >= 3


def test_long_pieces_go_through_the_batch_call_with_the_same_ids() -> None:
    tokenizer = _sample_tokenizer()
    encoder = SegmentedEncoder(tokenizer, batch_above=64, min_piece_chars=1)
    text = "<|im_start|>user\n" + "many words in a long message, 12345 " * 20 + "<|im_end|>"
    assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids


def test_threads_tokenizing_at_once_each_get_their_own_ids() -> None:
    tokenizer = _sample_tokenizer()
    encoder = SegmentedEncoder(tokenizer, batch_above=4096, min_piece_chars=1, capacity_bytes=2000)
    texts = [f"<|im_start|>user\nmessage {i % 37} of many<|im_end|>\n" for i in range(3000)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(encoder.encode, texts))
    assert got == [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]


def test_the_preprocessor_tokenizes_by_pieces_with_the_tokenizers_ids(
    preprocessor: Preprocessor,
) -> None:
    system = "You answer questions about the weather, briefly and politely. " * 8
    text = preprocessor.render_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": "Rain today?"}],
        add_generation_prompt=True,
    )
    expected = _sample_tokenizer().encode(text, add_special_tokens=False).ids
    assert preprocessor.encode(text) == expected
    assert preprocessor.encode(text) == expected


def _metaspace_first() -> Tokenizer:
    tokenizer = _sample_tokenizer()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    return tokenizer


def _normalized() -> Tokenizer:
    tokenizer = _sample_tokenizer()
    tokenizer.normalizer = normalizers.Lowercase()
    return tokenizer


def _stripping_token() -> Tokenizer:
    tokenizer = _sample_tokenizer()
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, normalized=False)])
    return tokenizer


def _no_added_tokens() -> Tokenizer:
    config = json.loads(_sample_tokenizer().to_str())
    config["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(config))


def _special_tokens_as_text() -> Tokenizer:
    tokenizer = _sample_tokenizer()
    tokenizer.encode_special_tokens = True
    return tokenizer


@pytest.mark.parametrize(
    "make",
    [_metaspace_first, _stripping_token, _no_added_tokens, _special_tokens_as_text],
)
def test_a_tokenizer_that_reads_across_the_cuts_is_tokenized_whole(
    make: Callable[[], Tokenizer],
) -> None:
    assert segmented_encoder(make(), batch_above=4096) is None


def test_metaspace_first_would_give_other_ids_piece_by_piece(
    sentencepiece_style: Preprocessor,
) -> None:
    # Why Metaspace is refused: only the text's first piece gets the word mark.
    tokenizer = sentencepiece_style._tokenizer
    assert segmented_encoder(tokenizer, batch_above=4096) is None
    whole = tokenizer.encode("<s>hi there", add_special_tokens=False).tokens
    pieces = [
        *tokenizer.encode("<s>", add_special_tokens=False).tokens,
        *tokenizer.encode("hi there", add_special_tokens=False).tokens,
    ]
    assert whole != pieces


BYTE_LEVEL_TOKENIZERS = [
    name
    for name in PIECEWISE_TOKENIZERS
    if name not in ("split digits, then byte-level", "byte-level, lowercased")
]


@pytest.mark.parametrize("name", BYTE_LEVEL_TOKENIZERS)
@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.one_of(fragments, ascii_text), max_size=20).map("".join))
def test_ascii_words_get_the_tokenizers_ids(name: str, text: str) -> None:
    tokenizer = PIECEWISE_TOKENIZERS[name]
    words = byte_level_words(tokenizer)
    assert words is not None
    text = "".join(part for part in re.split("|".join(map(re.escape, ADDED)), text))
    expected = tokenizer.encode(text, add_special_tokens=False).ids
    assert words.ids(text) == expected
    assert words.ids(text) == expected


def test_known_words_need_no_tokenizer_call_and_the_memory_starts_again_when_full() -> None:
    tokenizer = _sample_tokenizer()
    words = ByteLevelWords(tokenizer, split=_GPT2_SPLIT, add_prefix_space=False, capacity_words=4)
    text = "Tell me a story"
    assert words.ids(text) == tokenizer.encode(text).ids
    assert set(words._words) == {"Tell", " me", " a", " story"}
    assert words.ids(" again") == tokenizer.encode(" again").ids
    assert set(words._words) == {" again"}


def test_the_sample_tokenizer_encodes_ascii_by_words_and_the_rest_whole(
    preprocessor: Preprocessor,
) -> None:
    encoder = preprocessor._segments
    assert encoder is not None and encoder._words is not None
    for content in ("Tell me a story.", "Raconte-moi une histoire, s\u2019il te pla\u00eet."):
        text = preprocessor.render_chat(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        assert preprocessor.encode(text) == _sample_tokenizer().encode(text).ids


@pytest.mark.parametrize(
    "pre_tokenizer",
    [
        pre_tokenizers.ByteLevel(use_regex=False),
        pre_tokenizers.Whitespace(),
        pre_tokenizers.Sequence([pre_tokenizers.ByteLevel()]),
        _split_then_bytes(r"\d{1,3}"),
        _split_then_bytes(LLAMA3_SPLIT, prefix_space=True),
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(pattern=Regex(LLAMA3_SPLIT), behavior="removed"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
    ],
)
def test_words_are_taken_only_behind_a_known_split(
    pre_tokenizer: pre_tokenizers.PreTokenizer,
) -> None:
    assert byte_level_words(_with_pre_tokenizer(pre_tokenizer)) is None
    assert byte_level_words(_normalized()) is None
    lowercased_llama = _with_normalizer(_split_then_bytes(LLAMA3_SPLIT), normalizers.Lowercase())
    assert byte_level_words(lowercased_llama) is None


def test_a_long_text_takes_only_the_gil_releasing_calls_and_whole_past_max_cuts() -> None:
    tokenizer = _sample_tokenizer()
    counting = CountingTokenizer(tokenizer)
    batch, single = counting.batch, counting.single
    encoder = SegmentedEncoder(
        counting,  # type: ignore[arg-type]
        batch_above=4096,
        words=byte_level_words(tokenizer),
    )
    turn = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + "long answer " * 20
    dense = "<|im_end|>" * (MAX_CUTS + 1) + "x" * 4096
    assert encoder.encode(dense) == tokenizer.encode(dense, add_special_tokens=False).ids
    assert batch == [dense] and single == []
    batch.clear()
    sparse = turn * (MAX_CUTS // 4) + "\u00e9" + "x" * 4096
    assert encoder.encode(sparse) == tokenizer.encode(sparse, add_special_tokens=False).ids
    assert sparse not in batch and single == []
    batch.clear()
    ascii_sparse = turn * (MAX_CUTS // 4) + "x" * 4096
    assert encoder.encode(ascii_sparse) == tokenizer.encode(ascii_sparse).ids
    assert ascii_sparse not in batch and batch and single == []

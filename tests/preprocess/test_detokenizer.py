from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from penstock.preprocess import Preprocessor
from penstock.preprocess.detokenizer import IncrementalDetokenizer, PlainTokenTexts

# Multi-byte characters the sample tokenizer (trained on ASCII-heavy source code) splits
# into single-byte tokens: 2-, 3- and 4-byte UTF-8, combining marks, ZWJ emoji sequences.
TRICKY = [
    *("é", "ñ", "ü", "ß", "e\u0301", "\u200b"),
    *("世界", "日本語", "한국어"),
    *("🎉", "👩\u200d💻", "🇳🇴", "\U0001d518"),
]

unicode_text = st.lists(
    st.one_of(
        st.text(
            alphabet=st.characters(
                blacklist_categories=("Cs",), blacklist_characters="\ufffd", max_codepoint=0x1FAFF
            ),
            max_size=12,
        ),
        st.sampled_from(TRICKY),
        st.sampled_from([" ", "\n", "def ", "return", "<|im_end|>"]),
    ),
    max_size=12,
).map("".join)


def _has_lone_surrogate(text: str) -> bool:
    return any("\ud800" <= char <= "\udfff" for char in text)


@settings(max_examples=300, deadline=None)
@given(text=unicode_text)
def test_streamed_text_equals_batch_decode_and_never_splits_a_character(
    preprocessor: Preprocessor, text: str
) -> None:
    ids = preprocessor.encode(text)
    detokenizer = preprocessor.new_detokenizer()

    pieces = [detokenizer.step(token_id) for token_id in ids]

    for piece in pieces:
        assert "\ufffd" not in piece
        assert not _has_lone_surrogate(piece)
    assert "".join(pieces) == preprocessor.decode(ids)
    assert detokenizer.flush() == ""


@settings(max_examples=100, deadline=None)
@given(text=unicode_text)
def test_special_tokens_are_kept_when_not_skipped(preprocessor: Preprocessor, text: str) -> None:
    ids = preprocessor.encode(text + "<|im_end|>")
    detokenizer = preprocessor.new_detokenizer(skip_special_tokens=False)

    streamed = "".join(detokenizer.step(token_id) for token_id in ids)

    assert streamed == preprocessor.decode(ids, skip_special_tokens=False)
    assert streamed.endswith("<|im_end|>")


@settings(max_examples=100, deadline=None)
@given(prompt=unicode_text, completion=unicode_text)
def test_a_primed_stream_yields_only_the_completion(
    preprocessor: Preprocessor, prompt: str, completion: str
) -> None:
    prompt_ids = preprocessor.tokenize_chat([{"role": "user", "content": prompt}])
    completion_ids = preprocessor.encode(completion)
    detokenizer = preprocessor.new_detokenizer(prompt_ids)

    streamed = "".join(detokenizer.step(token_id) for token_id in completion_ids)

    assert streamed == preprocessor.decode(completion_ids)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=1999), max_size=40))
def test_arbitrary_model_output_is_fully_accounted_for_after_flush(
    preprocessor: Preprocessor, ids: list[int]
) -> None:
    # A random-weight model emits any ids, including byte tokens that never form a
    # character; streaming plus flush still gives the same text as one batch decode.
    detokenizer = preprocessor.new_detokenizer()

    streamed = "".join(detokenizer.step(token_id) for token_id in ids) + detokenizer.flush()

    assert streamed == preprocessor.decode(ids)


def test_incomplete_character_is_held_back_until_complete(preprocessor: Preprocessor) -> None:
    ids = preprocessor.encode("🎉")
    detokenizer = preprocessor.new_detokenizer()

    assert len(ids) == 4
    assert [detokenizer.step(token_id) for token_id in ids] == ["", "", "", "🎉"]


def test_flush_returns_a_dangling_partial_character_as_replacement(
    preprocessor: Preprocessor,
) -> None:
    detokenizer = preprocessor.new_detokenizer()
    first_byte_of_emoji = preprocessor.encode("🎉")[0]

    assert detokenizer.step(preprocessor.encode("ok")[0]) == "ok"
    assert detokenizer.step(first_byte_of_emoji) == ""
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.flush() == ""


def test_ids_outside_the_vocabulary_produce_no_text(preprocessor: Preprocessor) -> None:
    detokenizer = preprocessor.new_detokenizer()

    assert detokenizer.step(preprocessor.vocab_size + 10) == ""
    assert detokenizer.step(-1) == ""
    assert detokenizer.step(preprocessor.encode("ok")[0]) == "ok"


def test_a_byte_level_token_that_is_whole_characters_reads_as_its_own_decoding(
    preprocessor: Preprocessor,
) -> None:
    table = PlainTokenTexts(preprocessor._tokenizer)
    plain = 0
    for token_id in range(preprocessor.vocab_size):
        text = table.get(token_id)
        if text:
            plain += 1
            assert text == preprocessor.decode([token_id], skip_special_tokens=False)
    # Every added token, and every byte of a multi-byte character, goes through the stream.
    assert table.get(preprocessor.encode("<|im_end|>")[0]) == ""
    assert all(table.get(token_id) == "" for token_id in preprocessor.encode("🎉"))
    assert plain > preprocessor.vocab_size // 2


model_output = st.lists(
    st.one_of(
        st.integers(min_value=-2, max_value=2005),
        st.sampled_from([*range(0, 8), 1999, 2000]),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    prompt=unicode_text,
    completion=unicode_text,
    noise=model_output,
    skip_special_tokens=st.booleans(),
)
def test_the_table_lookup_streams_exactly_what_the_decode_stream_alone_does(
    preprocessor: Preprocessor,
    prompt: str,
    completion: str,
    noise: list[int],
    skip_special_tokens: bool,
) -> None:
    prompt_ids = preprocessor.tokenize_chat([{"role": "user", "content": prompt}])
    ids = preprocessor.encode(completion + "<|im_end|>") + noise + preprocessor.encode(completion)
    with_table = preprocessor.new_detokenizer(prompt_ids, skip_special_tokens=skip_special_tokens)
    stream_only = IncrementalDetokenizer(
        preprocessor._tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
    )

    assert [with_table.step(token_id) for token_id in ids] == [
        stream_only.step(token_id) for token_id in ids
    ]
    assert with_table.flush() == stream_only.flush()

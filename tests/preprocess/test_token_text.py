from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from penstock.preprocess import Preprocessor


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30))
def test_token_bytes_concatenate_to_the_utf8_of_the_text(
    preprocessor: Preprocessor, text: str
) -> None:
    ids = preprocessor.encode(text)
    joined = bytes(byte for token_id in ids for byte in preprocessor.token_bytes(token_id))
    assert joined == text.encode("utf-8")


def test_partial_character_token_gives_its_real_bytes(preprocessor: Preprocessor) -> None:
    ids = preprocessor.encode("🎉")

    assert [preprocessor.token_bytes(token_id) for token_id in ids] == [[240], [159], [142], [137]]
    assert preprocessor.token_text(ids[0]) == "\ufffd"


def test_token_text_of_ordinary_and_special_tokens(preprocessor: Preprocessor) -> None:
    (space_return,) = preprocessor.encode(" return")
    (im_end,) = preprocessor.encode("<|im_end|>")

    assert preprocessor.token_text(space_return) == " return"
    assert preprocessor.token_bytes(space_return) == list(b" return")
    assert preprocessor.token_text(im_end) == "<|im_end|>"
    assert preprocessor.token_bytes(im_end) == list(b"<|im_end|>")


def test_every_vocabulary_id_has_text_and_bytes(preprocessor: Preprocessor) -> None:
    for token_id in range(preprocessor.vocab_size):
        assert isinstance(preprocessor.token_text(token_id), str)
        assert preprocessor.token_bytes(token_id)


def test_ids_outside_the_vocabulary_have_empty_text_and_bytes(
    preprocessor: Preprocessor,
) -> None:
    for token_id in (-1, preprocessor.vocab_size, 2**40):
        assert preprocessor.token_text(token_id) == ""
        assert preprocessor.token_bytes(token_id) == []


def test_sentencepiece_pieces_and_byte_fallback_give_real_bytes(
    sentencepiece_style: Preprocessor,
) -> None:
    ids = sentencepiece_style.encode("hi there é!")

    assert [bytes(sentencepiece_style.token_bytes(token_id)) for token_id in ids] == [
        b" hi",
        b" there",
        b" ",
        b"\xc3",
        b"\xa9",
        b"!",
    ]
    assert sentencepiece_style.bos_token_id == 1
    assert sentencepiece_style.eos_token_ids == [2]


def test_sentencepiece_stream_holds_byte_fallback_until_complete(
    sentencepiece_style: Preprocessor,
) -> None:
    ids = sentencepiece_style.encode("hi there é!")
    detokenizer = sentencepiece_style.new_detokenizer()

    assert [detokenizer.step(token_id) for token_id in ids] == [
        "hi",
        " there",
        " ",
        "",
        "é",
        "!",
    ]


def test_priming_with_the_prompt_keeps_the_first_completion_space(
    sentencepiece_style: Preprocessor,
) -> None:
    prompt_ids = sentencepiece_style.encode("hi")
    (there,) = sentencepiece_style.encode("there")

    # Decoded alone the first piece loses its space; after a prompt it must keep it.
    assert sentencepiece_style.new_detokenizer().step(there) == "there"
    assert sentencepiece_style.new_detokenizer(prompt_ids).step(there) == " there"

"""The output options trainers send (special tokens in the text, the stop string kept)
reach the choice that folds the engine's tokens, with the shipped tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from penstock.preprocess import Preprocessor
from penstock.preprocess.stop_strings import StopStringMatcher
from penstock.serving.choice import ChoiceState

SAMPLE_TOKENIZER = Path(__file__).parents[2] / "penstock/engines/assets/sample-tokenizer"
IM_END = 2


@pytest.fixture(scope="module")
def preprocessor() -> Preprocessor:
    return Preprocessor.from_folder(SAMPLE_TOKENIZER)


def fold(choice: ChoiceState, token_ids: list[int]) -> str:
    for position, token in enumerate(token_ids):
        chunk: dict[str, Any] = {"token_ids": [token], "index": 0}
        if position == len(token_ids) - 1:
            chunk["finish_reason"] = "length"
        choice.consume(chunk, None)
    return choice.text


def test_special_tokens_show_only_when_not_skipped(preprocessor: Preprocessor) -> None:
    ids = [*preprocessor.encode("hi"), IM_END]
    shown = ChoiceState(
        0,
        preprocessor,
        [],
        prompt_token_ids=[],
        keep_text=True,
        want_logprobs=False,
        skip_special_tokens=False,
    )
    hidden = ChoiceState(
        0, preprocessor, [], prompt_token_ids=[], keep_text=True, want_logprobs=False
    )
    assert fold(shown, ids) == "hi<|im_end|>"
    assert fold(hidden, ids) == "hi"


@pytest.mark.parametrize("include", [True, False])
def test_the_matched_stop_string_is_kept_when_asked(
    preprocessor: Preprocessor, include: bool
) -> None:
    choice = ChoiceState(
        0,
        preprocessor,
        ["lo w"],
        prompt_token_ids=[],
        keep_text=True,
        want_logprobs=False,
        include_stop=include,
    )
    fold(choice, preprocessor.encode("hello world"))
    assert choice.text == ("hello w" if include else "hel")
    assert choice.finish_reason == "stop"


def test_the_matcher_names_the_stop_that_matched_across_chunks() -> None:
    matcher = StopStringMatcher(["xyz", "END"])
    assert matcher.feed("abcE") == ("abc", False)
    assert matcher.feed("ND!") == ("", True)
    assert matcher.matched == "END"

from __future__ import annotations

import pytest

from penstock.errors import InvalidRequestError
from penstock.preprocess import (
    Preprocessor,
    check_prompt_chars,
    check_token_budget,
    prompt_char_limit,
)


def test_requested_max_tokens_that_fit_are_kept() -> None:
    assert check_token_budget(1900, 148, 2048) == 148
    assert check_token_budget(1900, 1, 2048) == 1


def test_missing_max_tokens_becomes_the_room_left() -> None:
    assert check_token_budget(1900, None, 2048) == 148


def test_unknown_context_length_keeps_the_request_max_tokens() -> None:
    assert check_token_budget(10**6, 50, None) == 50
    assert check_token_budget(10**6, None, None) is None


def test_prompt_plus_completion_overflow_states_both_numbers_and_the_limit() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_token_budget(1900, 200, 2048)

    error = caught.value
    assert error.status_code == 400
    assert error.param == "max_tokens"
    assert error.message == (
        "This model's maximum context length is 2048 tokens. However, you requested 2100 "
        "tokens (1900 in the messages, 200 in the completion). Please reduce the length of "
        "the messages or completion."
    )


def test_prompt_alone_filling_the_context_blames_the_prompt() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_token_budget(2048, None, 2048)

    assert caught.value.param == "messages"
    assert caught.value.message == (
        "This model's maximum context length is 2048 tokens. However, you requested 2048 "
        "tokens in the messages, which leaves no room for the completion. Please reduce the "
        "length of the messages."
    )


def test_prompt_overflow_with_max_tokens_names_the_completions_prompt() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_token_budget(3000, 16, 2048, prompt_param="prompt")

    assert caught.value.param == "prompt"
    assert caught.value.message == (
        "This model's maximum context length is 2048 tokens. However, you requested 3016 "
        "tokens (3000 in the prompt, 16 in the completion). Please reduce the length of the "
        "prompt."
    )


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_max_tokens_below_one_is_rejected(max_tokens: int) -> None:
    with pytest.raises(InvalidRequestError, match=f"at least 1, got {max_tokens}") as caught:
        check_token_budget(10, max_tokens, 2048)
    assert caught.value.param == "max_tokens"


def test_a_token_budget_may_leave_either_overflow_to_the_engine() -> None:
    assert check_token_budget(1900, 200, 2048, reject_total_overflow=False) == 200
    assert check_token_budget(2048, 10, 2048, reject_prompt_overflow=False) == 10
    with pytest.raises(InvalidRequestError) as caught:
        check_token_budget(2048, 10, 2048, reject_total_overflow=False)
    assert caught.value.param == "messages"
    with pytest.raises(InvalidRequestError) as caught:
        check_token_budget(1900, 200, 2048, reject_prompt_overflow=False)
    assert caught.value.param == "max_tokens"


def test_the_character_bound_is_context_length_times_chars_per_token() -> None:
    assert prompt_char_limit(2048, 35) == 71_680
    assert prompt_char_limit(2048, 3.5) == 7168
    assert prompt_char_limit(None, 35) is None


def test_a_prompt_at_the_character_bound_passes_and_one_more_is_refused() -> None:
    check_prompt_chars(71_680, 2048, 35, prompt_param="prompt")
    check_prompt_chars(10**9, None, 35)
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt_chars(71_681, 2048, 35, prompt_param="prompt")
    error = caught.value
    assert (error.status_code, error.param, error.code) == (
        400,
        "prompt",
        "context_length_exceeded",
    )
    assert error.message == (
        "This model's maximum context length is 2048 tokens. However, you sent 71681 "
        "characters in the prompt, more than the 71680 that can fit (at most 35 characters "
        "per token). Please reduce the length of the prompt."
    )


@pytest.mark.parametrize("tokenizer", ["preprocessor", "sentencepiece_style"])
def test_no_token_holds_more_characters_than_the_bound_assumes(
    tokenizer: str, request: pytest.FixtureRequest
) -> None:
    pre: Preprocessor = request.getfixturevalue(tokenizer)
    for text in (" " * 5000, "#" * 5000, "ab" * 2500, "<|im_start|>" * 400, "日本" * 2000):
        assert len(text) <= pre.max_token_chars * len(pre.encode(text))

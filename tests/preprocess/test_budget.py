from __future__ import annotations

import pytest

from penstock.errors import InvalidRequestError
from penstock.preprocess import check_token_budget


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

"""The context-length checks every prompt passes: by characters before it is tokenized,
by tokens before it reaches an engine.

The character check needs no tokenizer run: no token is longer than ``chars_per_token``
characters, so a prompt of more than ``context_length * chars_per_token`` characters
needs more tokens than the context holds, and is refused before any work is spent on it.
With ``chars_per_token`` the longest token of the vocabulary, the bound refuses only
prompts that can never fit (unless the tokenizer's normalizer deletes characters, or an
unknown-token rule folds a run of characters into one token).
"""

from __future__ import annotations

import math

from penstock.errors import InvalidRequestError

_WHAT_THE_PROMPT_IS = {"messages": "the messages", "prompt": "the prompt"}
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def prompt_char_limit(context_length: int | None, chars_per_token: float) -> int | None:
    """The most characters a prompt may have and still fit ``context_length`` tokens.

    None when the context length is unknown: nothing can be ruled out.
    """
    if context_length is None:
        return None
    return math.floor(context_length * chars_per_token)


def check_prompt_chars(
    chars: int,
    context_length: int | None,
    chars_per_token: float,
    *,
    prompt_param: str = "messages",
) -> None:
    """Refuse a prompt of ``chars`` characters that can't fit the context (400)."""
    limit = prompt_char_limit(context_length, chars_per_token)
    if limit is None or chars <= limit:
        return
    prompt_name = _WHAT_THE_PROMPT_IS.get(prompt_param, f"the {prompt_param}")
    raise InvalidRequestError(
        f"This model's maximum context length is {context_length} tokens. However, "
        f"you sent {chars} characters in {prompt_name}, more than the {limit} that can "
        f"fit (at most {chars_per_token:g} characters per token). Please reduce the "
        f"length of {prompt_name}.",
        param=prompt_param,
        code=CONTEXT_LENGTH_EXCEEDED,
    )


def check_token_budget(
    prompt_tokens: int,
    max_tokens: int | None,
    context_length: int | None,
    *,
    prompt_param: str = "messages",
    reject_prompt_overflow: bool = True,
    reject_total_overflow: bool = True,
) -> int | None:
    """The effective ``max_tokens``: the request's own, else whatever room the context leaves.

    Raises :class:`InvalidRequestError` when the prompt fills the context by itself
    (``param`` is ``prompt_param``) or prompt plus completion overflow it (``param`` is
    ``max_tokens``). With no known context length the request's ``max_tokens`` stands,
    None included: the engine then decides when to stop. An overflow whose
    ``reject_*_overflow`` flag is False (an engine's ``TokenBudget`` delegating it) passes
    with the request's ``max_tokens`` unchanged: the engine clamps or rejects it.
    """
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError(
            f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens"
        )
    if context_length is None:
        return max_tokens
    prompt_name = _WHAT_THE_PROMPT_IS.get(prompt_param, f"the {prompt_param}")
    if prompt_tokens >= context_length:
        if not reject_prompt_overflow:
            return max_tokens
        if max_tokens is None:
            requested = (
                f"{prompt_tokens} tokens in {prompt_name}, which leaves no room for the completion"
            )
        else:
            requested = (
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in {prompt_name}, "
                f"{max_tokens} in the completion)"
            )
        raise InvalidRequestError(
            f"This model's maximum context length is {context_length} tokens. However, "
            f"you requested {requested}. Please reduce the length of {prompt_name}.",
            param=prompt_param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    if max_tokens is None:
        return context_length - prompt_tokens
    if prompt_tokens + max_tokens > context_length and reject_total_overflow:
        raise InvalidRequestError(
            f"This model's maximum context length is {context_length} tokens. However, "
            f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in "
            f"{prompt_name}, {max_tokens} in the completion). Please reduce the length of "
            f"{prompt_name} or completion.",
            param="max_tokens",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    return max_tokens

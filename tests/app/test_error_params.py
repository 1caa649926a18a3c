"""The field a 400 names in ``error.param`` when the error is about the body as a whole or
about two fields together."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from penstock.app.handlers import validation_error_from
from penstock.routers.tokenize import TokenizeRequest
from penstock.schemas.openai import ChatCompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def _param(model: Any, body: Any) -> str | None:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()]
    return validation_error_from(RequestValidationError(errors)).param


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (ChatCompletionRequest, {"messages": MESSAGES, "stream_options": {}}, "stream_options"),
        (ChatCompletionRequest, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        (TokenizeRequest, {}, "prompt"),
        (ChatCompletionRequest, [1, 2], "body"),
    ],
)
def test_a_400_names_the_field_a_validator_blames_or_the_body(
    model: Any, body: Any, param: str
) -> None:
    assert _param(model, body) == param

"""``POST /tokenize`` and ``POST /detokenize`` with vLLM's request and response shapes.

RL trainers use them to build and check token-level rollouts with exactly the tokenizer
and chat template the server applies.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field, model_validator

from penstock.errors import InvalidRequestError
from penstock.gateway import ServedModel
from penstock.preprocess import Preprocessor
from penstock.schemas.openai import ChatMessage, NonNegativeInt
from penstock.schemas.unicode import RequestModel
from penstock.serving.requests import check_token_ids

router = APIRouter(tags=["tokenize"])


class TokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    tokens: list[NonNegativeInt] = Field(default_factory=list)


def _preprocessor(model: ServedModel, param: str) -> Preprocessor:
    if model.preprocessor is None:
        raise InvalidRequestError(
            f"The model '{model.name}' has no tokenizer configured", param=param
        )
    return model.preprocessor


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    model = request.app.state.gateway.resolve(body.model)
    pre = _preprocessor(model, "prompt" if body.prompt is not None else "messages")
    if body.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tokens = pre.tokenize_chat(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs,
        )
    else:
        tokens = pre.encode(body.prompt or "")
    return {
        "count": len(tokens),
        "max_model_len": model.context_length,
        "tokens": tokens,
        "token_strs": [pre.token_text(t) for t in tokens],
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    model = request.app.state.gateway.resolve(body.model)
    pre = _preprocessor(model, "tokens")
    check_token_ids(body.tokens, model, "tokens")
    return {"prompt": pre.decode(body.tokens, skip_special_tokens=False)}

"""``POST /tokenize`` and ``POST /detokenize`` with vLLM's request and response shapes.

RL trainers use them to build and check token-level rollouts with exactly the tokenizer
and chat template the server applies. Input too long to fit the model's context is
refused by its length before tokenizing, as on the generation routes; large inputs are
tokenized (or decoded) off the event loop.

Both routes are answered by :class:`penstock.app.hot.HotRoutes`, not FastAPI
(:mod:`penstock.routers.hot` lists them): FastAPI's parser, dependencies and error
handlers never run for them.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field, model_validator
from starlette.responses import Response

from penstock.errors import FieldValueError, InvalidRequestError
from penstock.gateway import ServedModel
from penstock.preprocess import Preprocessor
from penstock.schemas.fields import refuse_unknown, refuse_unsupported
from penstock.schemas.openai import ChatMessage, NonNegativeInt
from penstock.schemas.unicode import JSONValue, RequestModel
from penstock.serving.framing import json_response
from penstock.serving.limits import (
    body_size,
    check_prompt_length,
    check_token_ids,
    default_model_name,
)
from penstock.serving.prompts import off_loop, render_and_tokenize

router = APIRouter(tags=["tokenize"])


# vLLM's tokenize fields this server cannot honour, with the value that asks for nothing.
TOKENIZE_UNSUPPORTED: dict[str, Any] = {
    "continue_final_message": False,
    "chat_template": None,
    "tools": None,
    "mm_processor_kwargs": None,
}


class TokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)

    # Left out or empty: the served model, as in vLLM.
    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # The tokenizer's BOS token first; vLLM's defaults: on for a prompt, off for
    # messages (a chat template writes its own).
    add_special_tokens: bool | None = None
    # ``token_strs``, each token as the vocabulary spells it; null unless asked for.
    return_token_strs: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldValueError("prompt", "give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")

    model: str = ""
    tokens: list[NonNegativeInt]


def _preprocessor(model: ServedModel, param: str) -> Preprocessor:
    if model.preprocessor is None:
        raise InvalidRequestError(
            f"The model '{model.name}' has no tokenizer configured", param=param
        )
    return model.preprocessor


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    gateway = request.app.state.gateway
    refuse_unsupported(body, TOKENIZE_UNSUPPORTED)
    refuse_unknown(body, gateway.settings.allow_unknown_fields)
    model = gateway.resolve(body.model or default_model_name(gateway))
    param = "prompt" if body.prompt is not None else "messages"
    pre = _preprocessor(model, param)
    settings = gateway.settings
    if body.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        chars = sum(_content_chars(message.get("content")) for message in messages)
        check_prompt_length(settings, model, pre, chars, param)
        tokens = await off_loop(
            gateway,
            None,
            max(chars, body_size(request)),
            render_and_tokenize,
            settings,
            model,
            pre,
            messages,
            add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs,
        )
    else:
        text = body.prompt or ""
        check_prompt_length(settings, model, pre, len(text), param)
        tokens = await off_loop(gateway, None, len(text), pre.encode, text)
    # vLLM's defaults: a prompt gets what the tokenizer adds around an input, messages
    # (whose template writes its own special tokens) nothing.
    add_special = body.add_special_tokens
    if add_special is None:
        add_special = body.prompt is not None
    if add_special:
        tokens = pre.with_special_tokens(tokens)
    token_strs = None
    if body.return_token_strs:
        token_strs = await off_loop(gateway, None, len(tokens), pre.token_pieces, tokens)
    return json_response(
        {
            "count": len(tokens),
            "max_model_len": model.context_length,
            "tokens": tokens,
            "token_strs": token_strs,
        }
    )


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text") or "") for part in content or [])


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    gateway = request.app.state.gateway
    model = gateway.resolve(body.model or default_model_name(gateway))
    pre = _preprocessor(model, "tokens")
    text = await off_loop(gateway, None, len(body.tokens), _checked_decode, model, pre, body.tokens)
    return {"prompt": text}


def _checked_decode(model: ServedModel, pre: Preprocessor, tokens: list[int]) -> str:
    check_token_ids(tokens, model, "tokens")
    return pre.decode(tokens, skip_special_tokens=False)

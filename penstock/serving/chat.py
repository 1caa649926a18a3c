"""Chat completions: the conversation as one engine request, and the chat response format.

The stream opens with one ``{"role": "assistant"}`` chunk per choice; deltas carry
``content`` (and, on the last one, ``tool_calls`` when a parser found calls), and with a
reasoning parser ``reasoning_content`` with the same text as ``reasoning`` (the names
DeepSeek's API and vLLM's have used, and vLLM's now).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from penstock.gateway import Gateway, ServedModel
from penstock.multimodal.inputs import MediaInputs
from penstock.schemas.openai import ChatCompletionRequest
from penstock.serving.choice import ChoiceState, Delta, LogprobEntry
from penstock.serving.completions import check_prompt_logprobs, vllm_prompt_logprobs
from penstock.serving.deadline import request_deadline
from penstock.serving.framing import TEXT_SLOT
from penstock.serving.generation import Generation
from penstock.serving.guided import combine, sampling_guided_decoding, tool_call_constraint
from penstock.serving.limits import check_budget, served_model
from penstock.serving.parsing import output_parsing
from penstock.serving.prompts import chat_prompt
from penstock.serving.requests import (
    engine_context,
    generate_request,
    key_cache_scope,
    metadata_uploader,
)
from penstock.serving.stream import ResponsePlan, respond, shows_anything


def chat_logprobs(
    model: ServedModel, entries: list[LogprobEntry], *, tokens_as_ids: bool = False
) -> dict[str, Any]:
    """``tokens_as_ids``: each ``token`` is ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``); its ``bytes`` stay the token's own."""
    pre = model.preprocessor

    def token(token_id: int) -> tuple[str, list[int]]:
        if pre is None:
            return f"token_id:{token_id}", []
        text = f"token_id:{token_id}" if tokens_as_ids else pre.token_text(token_id)
        return text, pre.token_bytes(token_id)

    content = []
    for entry in entries:
        text, raw = token(entry.token_id)
        top = []
        for alternative in entry.top:
            alt_text, alt_raw = token(alternative.token_id)
            top.append({"token": alt_text, "logprob": alternative.logprob, "bytes": alt_raw})
        content.append({"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


class ChatFormat:
    """Chat's choices: a ``delta``/``message`` per choice, token ids of the prompt on top."""

    __slots__ = ("model", "return_token_ids", "role", "tokens_as_ids")

    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"

    def __init__(
        self,
        model: ServedModel,
        *,
        return_token_ids: bool,
        tokens_as_ids: bool = False,
        role: str = "assistant",
    ) -> None:
        self.model = model
        # The answer's role: vLLM's, the last message's when no generation prompt opens
        # an assistant turn.
        self.role = role
        self.return_token_ids = return_token_ids
        self.tokens_as_ids = tokens_as_ids

    def prelude(self, generations: Sequence[Generation]) -> list[dict[str, Any]]:
        (generation,) = generations
        roles = []
        for choice in generation.choices:
            role: dict[str, Any] = {
                "index": choice.index,
                "delta": {"role": self.role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            if self.return_token_ids and choice.index == 0:
                role["prompt_token_ids"] = generation.request["token_ids"]
            roles.append(role)
        return roles

    def text_only(self, delta: Delta) -> bool:
        """Whether the delta's choice is :meth:`text_choice` with its text."""
        return bool(
            delta.text
            and delta.finish_reason is None
            and not delta.logprobs
            and not delta.tool_calls
            and not delta.reasoning
            and not self.return_token_ids
        )

    @staticmethod
    def text_choice(index: int) -> dict[str, Any]:
        return {
            "index": index,
            "delta": {"content": TEXT_SLOT},
            "logprobs": None,
            "finish_reason": None,
        }

    def chunk_choice(self, delta: Delta) -> dict[str, Any] | None:
        text = delta.text
        if not (delta.reasoning or shows_anything(text, delta, self.return_token_ids)):
            return None
        message: dict[str, Any] = {"content": text} if text else {}
        if delta.reasoning:
            message["reasoning_content"] = message["reasoning"] = delta.reasoning
        if delta.tool_calls:
            message["tool_calls"] = [call.as_openai(i) for i, call in enumerate(delta.tool_calls)]
        item: dict[str, Any] = {
            "index": delta.choice.index,
            "delta": message,
            "logprobs": chat_logprobs(self.model, delta.logprobs, tokens_as_ids=self.tokens_as_ids)
            if delta.logprobs
            else None,
            "finish_reason": delta.finish_reason,
        }
        # vLLM's: on the chunk that finishes the choice only.
        if delta.finish_reason:
            item["stop_reason"] = delta.choice.stop_reason
        if self.return_token_ids:
            item["token_ids"] = delta.token_ids
        return item

    def response_choice(self, generation: Generation, choice: ChoiceState) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": choice.text, "refusal": None}
        reasoning = choice.reasoning
        if reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning or None
        if choice.tool_calls:
            message["content"] = choice.text or None
            message["tool_calls"] = [call.as_openai() for call in choice.tool_calls]
        item: dict[str, Any] = {
            "index": choice.index,
            "message": message,
            "logprobs": chat_logprobs(self.model, choice.logprobs, tokens_as_ids=self.tokens_as_ids)
            if choice.logprobs is not None
            else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "weight_versions": choice.weight_version_segments(),
        }
        if self.return_token_ids:
            item["token_ids"] = choice.token_ids
        return item

    def response_fields(self, generations: Sequence[Generation]) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if generations[0].prompt_logprobs is not None:
            fields["prompt_logprobs"] = vllm_prompt_logprobs(
                self.model, generations[0].prompt_logprobs, self.tokens_as_ids
            )
        if self.return_token_ids:
            fields["prompt_token_ids"] = generations[0].request["token_ids"]
        return fields


async def create_chat_completion(
    gateway: Gateway, body: ChatCompletionRequest, request: Request, media: MediaInputs
) -> Response:
    deadline = request_deadline(request, gateway.settings)
    model = served_model(gateway, body, "chat", "chat completions")
    check_prompt_logprobs(body, model)
    uploader = metadata_uploader(body, gateway.settings)
    guided_decoding = combine(
        sampling_guided_decoding(body, model),
        tool_call_constraint(body, model.tool_call_parser),
        model,
    )
    prompt = await chat_prompt(gateway, body, model, deadline, request, media)
    max_tokens = body.max_new_tokens
    check_budget(len(prompt.token_ids), max_tokens, model, "messages")
    engine_request = generate_request(
        body,
        model,
        prompt.token_ids,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        multi_modal_data=prompt.multi_modal_data,
        guided_decoding=guided_decoding,
        uploader=uploader,
        key_scope=key_cache_scope(request),
    )
    generation = Generation(
        gateway,
        model,
        engine_request,
        engine_context(request, user=body.user),
        stops=body.stop_list,
        keep_text=not body.stream,
        want_logprobs=body.logprobs,
        endpoint="chat_completions",
        streaming=body.stream,
        deadline=deadline,
    )
    attach_parsers(generation, body, prompt.token_ids)
    chat_format = ChatFormat(
        model,
        return_token_ids=body.return_token_ids,
        tokens_as_ids=body.return_tokens_as_token_ids,
        role="assistant" if body.add_generation_prompt else body.messages[-1].role,
    )
    plan = ResponsePlan(chat_format, [generation], body, uploader, deadline)
    return await respond(request, plan)


def attach_parsers(
    generation: Generation, body: ChatCompletionRequest, prompt_token_ids: list[int]
) -> None:
    """Split each choice's answer with its model's tool-call and reasoning parsers."""
    model = generation.model
    parsing = output_parsing(
        body, model.tool_call_parser, model.reasoning_parser, model.preprocessor, prompt_token_ids
    )
    if parsing is not None:
        for choice in generation.choices:
            choice.parse_with(parsing)

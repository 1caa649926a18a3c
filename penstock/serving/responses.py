"""``POST /v1/responses``: the Responses API on the chat serving path, and its event shapes.

A request becomes the chat request it amounts to (:mod:`penstock.serving.response_input`)
and runs as one chat :class:`Generation` through :func:`respond`; only the shapes differ.
A stream opens with ``response.created`` and ``response.in_progress``; the first text
opens the message item (``response.output_item.added``, ``response.content_part.added``)
and each text delta is a ``response.output_text.delta``. Once the engine is done the
message item is closed, each parsed tool call follows as a ``function_call`` item, and
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it) carries
the whole response, stored first when ``store`` is set: a client told it is complete can
fetch it. A non-stream request answers that same response object.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from penstock.errors import NotFoundError
from penstock.gateway import Gateway
from penstock.media.records import Owner
from penstock.multimodal.inputs import MediaInputs
from penstock.responses.async_store import AsyncResponseStore
from penstock.responses.records import StoredResponse
from penstock.schemas.responses import ResponsesRequest
from penstock.serving.chat import attach_parsers
from penstock.serving.choice import ChoiceState, Delta
from penstock.serving.deadline import request_deadline
from penstock.serving.framing import JSONObject
from penstock.serving.generation import Generation, usage
from penstock.serving.guided import combine, sampling_guided_decoding, tool_call_constraint
from penstock.serving.limits import check_budget, check_prompt_length, served_model
from penstock.serving.prompts import chat_prompt
from penstock.serving.requests import engine_context, generate_request, key_cache_scope
from penstock.serving.response_input import chat_request, reasoning_chars, turn_messages
from penstock.serving.stream import ResponsePlan, respond

# Finish reasons that leave a response incomplete, with the reason OpenAI gives.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _new_id(prefix: str) -> str:
    return prefix + os.urandom(24).hex()


class ResponsesFormat:
    """The Responses API's objects and events; one response per request (``n`` is 1).

    It keeps the stream's state: the event sequence number and the open message item.
    """

    id_prefix = "resp_"
    chunk_object = "response"
    response_object = "response"

    def __init__(
        self,
        body: ResponsesRequest,
        conversation: list[dict[str, Any]],
        store: AsyncResponseStore,
        owner: Owner | None,
    ) -> None:
        self.body = body
        self.conversation = conversation
        self.store = store
        self.owner = owner
        self.response_id = _new_id("resp_")
        self.message_id = _new_id("msg_")
        self.reasoning_id = _new_id("rs_")
        self.created_at = int(time.time())
        self.sequence = 0
        self.message_open = False
        # Streamed reasoning opens its item first; the message then comes second.
        self.reasoning_open = False

    # -- the response object ---------------------------------------------------------------

    def response_body(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = self.body
        text_format = body.text.format if body.text and body.text.format else None
        tool_choice = body.tool_choice
        response = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            # As the client named it: an alias stays an alias.
            "model": body.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {
                "effort": body.reasoning.effort if body.reasoning else None,
                "summary": body.reasoning.summary if body.reasoning else None,
            },
            "store": body.store,
            "temperature": body.temperature,
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format
                else {"type": "text"}
            },
            "tool_choice": tool_choice.model_dump()
            if tool_choice is not None and not isinstance(tool_choice, str)
            else tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "top_p": body.top_p,
            "truncation": "disabled",
            "metadata": body.metadata or {},
            # OpenAI's fields of what this server never does: run a response in the
            # background, pick a tier, penalise repeats (a Responses request has no field
            # asking for them).
            "background": False,
            "service_tier": "auto",
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
        }
        if body.user is not None:
            response["user"] = body.user
        return response

    def _message(self, text: str, status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [part] if text or status == "completed" else [],
        }

    def _reasoning(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if text else []
        return {
            "id": self.reasoning_id,
            "type": "reasoning",
            "summary": [],
            "content": content,
            "status": status,
        }

    def _output(self, choice: ChoiceState) -> list[dict[str, Any]]:
        reasoning = choice.reasoning
        output = [self._reasoning(reasoning, "completed")] if reasoning else []
        if choice.text:
            output.append(self._message(choice.text, "completed"))
        for call in choice.tool_calls:
            output.append(
                {
                    "id": _new_id("fc_"),
                    "type": "function_call",
                    "call_id": _new_id("call_"),
                    "name": call.name,
                    "arguments": call.arguments,
                    "status": "completed",
                }
            )
        return output

    async def finished(self, generations: Sequence[Generation]) -> dict[str, Any]:
        """The response once every delta is in; stored first when ``store`` is set."""
        ((choice,),) = (generation.choices for generation in generations)
        incomplete = _INCOMPLETE.get(choice.finish_reason or "")
        response = self.response_body(
            "incomplete" if incomplete else "completed", self._output(choice)
        )
        if incomplete:
            response["incomplete_details"] = {"reason": incomplete}
        counts = usage(generations)
        response["usage"] = {
            "input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": counts.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            },
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts["total_tokens"],
        }
        if self.body.store and self.owner is not None:
            await self.store.add(self.owner.tag, self._stored(response))
        return response

    def _stored(self, response: dict[str, Any]) -> StoredResponse:
        reply: dict[str, Any] = {"role": "assistant", "content": None}
        for item in response["output"]:
            if item["type"] == "message":
                reply["content"] = item["content"][0]["text"]
            elif item["type"] == "reasoning":
                reply["reasoning_content"] = item["content"][0]["text"]
            else:
                call = {"name": item["name"], "arguments": item["arguments"]}
                call_entry = {"id": item["call_id"], "type": "function", "function": call}
                reply.setdefault("tool_calls", []).append(call_entry)
        items = [
            {"id": _new_id("item_"), **item.model_dump(by_alias=True, exclude_none=True)}
            for item in self.body.items
        ]
        return StoredResponse(response, items, [*self.conversation, reply])

    # -- the StreamFormat of :mod:`penstock.serving.stream` --------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def prelude(self, generations: Sequence[Generation]) -> list[dict[str, Any]]:
        opening = self.response_body("in_progress", [])
        return [
            {"events": [self._event("response.created", response=opening)]},
            {"events": [self._event("response.in_progress", response=opening)]},
        ]

    @property
    def _message_index(self) -> int:
        return 1 if self.reasoning_open else 0

    def chunk_choice(self, delta: Delta) -> dict[str, Any] | None:
        events = self._reasoning_events(delta.reasoning) if delta.reasoning else []
        if not delta.text:
            return {"events": events} if events else None
        if not self.message_open:
            self.message_open = True
            events += self._message_opening()
        where = {
            "item_id": self.message_id,
            "output_index": self._message_index,
            "content_index": 0,
        }
        events.append(
            self._event("response.output_text.delta", **where, delta=delta.text, logprobs=[])
        )
        return {"events": events}

    def _reasoning_events(self, text: str) -> list[dict[str, Any]]:
        events = []
        # The parsers give all of a choice's reasoning before any of its text.
        if not self.reasoning_open:
            self.reasoning_open = True
            item = self._reasoning("", "in_progress")
            events.append(self._event("response.output_item.added", output_index=0, item=item))
        where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        return events

    def _message_opening(self) -> list[dict[str, Any]]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        index = self._message_index
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=self._message("", "in_progress"),
            ),
            self._event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    async def closing(self, generations: Sequence[Generation]) -> list[dict[str, Any]]:
        """The events after the last delta: each item closed, then the whole response."""
        response = await self.finished(generations)
        events: list[dict[str, Any]] = []
        for index, item in enumerate(response["output"]):
            if item["type"] == "message":
                events += self._message_closing(item, index)
            elif item["type"] == "reasoning":
                events += self._reasoning_closing(item)
            else:
                events += self._function_call_events(index, item)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        events.append(self._event(kind, response=response))
        return [{"events": events}]

    def _message_closing(self, message: dict[str, Any], index: int) -> list[dict[str, Any]]:
        part = message["content"][0]
        where = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=index, item=message),
        ]

    def _reasoning_closing(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        text = item["content"][0]["text"]
        where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.reasoning_text.done", **where, text=text),
            self._event("response.output_item.done", output_index=0, item=item),
        ]

    def _function_call_events(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        where = {"item_id": item["id"], "output_index": index}
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def encoder(self, plan: ResponsePlan) -> ResponseEventEncoder:
        return ResponseEventEncoder()


class ResponseEventEncoder:
    """Each event as a named server-sent event, as OpenAI streams them."""

    __slots__ = ()

    def frame(
        self, choices: list[JSONObject], weight_version: str | None, usage: JSONObject | None = None
    ) -> bytes:
        return b"".join(
            b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
            for batch in choices
            for event in batch["events"]
        )


async def _history(
    body: ResponsesRequest, store: AsyncResponseStore, owner: Owner | None
) -> list[dict[str, Any]]:
    """The conversation ``previous_response_id`` names; 404 when the caller can't see it."""
    if body.previous_response_id is None:
        return []
    found = await store.get(body.previous_response_id, owner) if owner is not None else None
    if found is None:
        raise NotFoundError(
            f"Previous response with id '{body.previous_response_id}' not found.",
            param="previous_response_id",
        )
    return found.conversation


async def create_response(
    gateway: Gateway,
    body: ResponsesRequest,
    request: Request,
    media: MediaInputs,
    store: AsyncResponseStore,
    owner: Owner | None,
) -> Response:
    """Serve one Responses API request; ``owner`` is whose stored responses it reads and
    writes (None when it needs none: nothing stored, no previous response)."""
    deadline = request_deadline(request, gateway.settings)
    conversation = [*await _history(body, store, owner), *turn_messages(body)]
    chat = chat_request(body, conversation)
    model = served_model(gateway, chat, "chat", "the Responses API")
    # The response names the model that served it, also when the request named none.
    body.model = chat.model
    if model.preprocessor is not None:
        reasoning = reasoning_chars(body)
        check_prompt_length(gateway.settings, model, model.preprocessor, reasoning, "input")
    guided_decoding = combine(
        sampling_guided_decoding(chat, model),
        tool_call_constraint(chat, model.tool_call_parser),
        model,
    )
    prompt = await chat_prompt(gateway, chat, model, deadline, request, media)
    check_budget(len(prompt.token_ids), chat.max_tokens, model, "input")
    engine_request = generate_request(
        chat,
        model,
        prompt.token_ids,
        max_tokens=chat.max_tokens,
        logprobs=None,
        multi_modal_data=prompt.multi_modal_data,
        guided_decoding=guided_decoding,
        key_scope=key_cache_scope(request),
    )
    generation = Generation(
        gateway,
        model,
        engine_request,
        engine_context(request, user=body.user),
        stops=chat.stop_list,
        keep_text=True,
        want_logprobs=False,
        endpoint="responses",
        streaming=body.stream,
        deadline=deadline,
    )
    attach_parsers(generation, chat, prompt.token_ids)
    fmt = ResponsesFormat(body, conversation, store, owner)
    return await respond(request, ResponsePlan(fmt, [generation], chat, None, deadline))

"""Completions: one engine request per prompt, and the completions response format.

Choice ``index`` is ``prompt_index * n + choice``. With ``echo`` the prompt's text opens
each choice: in the stream it is prepended to the choice's first delta; not streamed, with
``logprobs``, its tokens open the choice's logprobs too, from the engine's prompt logprobs
as in vLLM (the first token has none). vLLM's
``prompt_logprobs`` (not streamed, as in vLLM) come back on each choice of the prompt, in
vLLM's shape (:func:`vllm_prompt_logprobs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from penstock.engines.contract import SUPPORTS_PROMPT_LOGPROBS
from penstock.errors import InvalidRequestError
from penstock.gateway import Gateway, ServedModel
from penstock.metadata_upload import MetadataUploader
from penstock.schemas.openai import ChatCompletionRequest, CompletionRequest
from penstock.serving.choice import ChoiceState, Delta, LogprobEntry
from penstock.serving.deadline import Deadline, request_deadline
from penstock.serving.framing import TEXT_SLOT
from penstock.serving.generation import Generation
from penstock.serving.guided import sampling_guided_decoding
from penstock.serving.limits import engine_capability, served_model
from penstock.serving.prompts import completion_prompts
from penstock.serving.requests import (
    engine_context,
    generate_request,
    key_cache_scope,
    metadata_uploader,
)
from penstock.serving.stream import ResponsePlan, respond, shows_anything


def completion_logprobs(
    model: ServedModel, entries: list[LogprobEntry], text_offset: int, tokens_as_ids: bool = False
) -> dict[str, Any]:
    """``tokens_as_ids``: each token is named ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``); the text offsets stay those of the text."""
    text_of, label = _token_names(model, tokens_as_ids)
    tokens, values, tops, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        tokens.append(label(entry.token_id))
        values.append(entry.logprob)
        # vLLM's: the chosen token first, then the likeliest others (logprobs=0: only it).
        top = {label(entry.token_id): entry.logprob}
        top.update((label(alt.token_id), alt.logprob) for alt in entry.top)
        tops.append(top)
        offsets.append(offset)
        offset += len(text_of(entry.token_id))
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def prompt_completion_logprobs(
    model: ServedModel, token_ids: list[int], positions: list[Any], tokens_as_ids: bool
) -> dict[str, Any]:
    """The echoed prompt's part of a choice's ``logprobs``, from the engine's prompt
    logprobs (per position None, or the prompt's token first, then the likeliest others);
    its text offsets count from the prompt's start."""
    text_of, label = _token_names(model, tokens_as_ids)
    tokens, values, tops, offsets = [], [], [], []
    offset = 0
    for token_id, entries in zip(token_ids, positions, strict=False):
        tokens.append(label(token_id))
        values.append(None if entries is None else entries[0]["logprob"])
        tops.append(
            None if entries is None else {label(e["token_id"]): e["logprob"] for e in entries}
        )
        offsets.append(offset)
        offset += len(text_of(token_id))
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _token_names(
    model: ServedModel, tokens_as_ids: bool
) -> tuple[Callable[[int], str], Callable[[int], str]]:
    """A token's text (for offsets) and its name in ``tokens`` and ``top_logprobs``."""
    pre = model.preprocessor

    def text_of(token_id: int) -> str:
        return pre.token_text(token_id) if pre is not None else f"token_id:{token_id}"

    def label(token_id: int) -> str:
        return f"token_id:{token_id}" if tokens_as_ids else text_of(token_id)

    return text_of, label


def vllm_prompt_logprobs(
    model: ServedModel, positions: list[Any] | None, tokens_as_ids: bool = False
) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token
    ``{token_id: {"logprob", "rank", "decoded_token"}}``, the prompt's own token first."""
    if positions is None:
        return None
    pre = model.preprocessor

    def decoded(token_id: int) -> str | None:
        if tokens_as_ids:
            return f"token_id:{token_id}"
        return pre.token_text(token_id) if pre is not None else None

    return [
        None
        if entries is None
        else {
            str(entry["token_id"]): {
                "logprob": entry["logprob"],
                "rank": entry["rank"],
                "decoded_token": decoded(entry["token_id"]),
            }
            for entry in entries
        }
        for entries in positions
    ]


class CompletionFormat:
    """Completions' choices: ``text`` per choice, the prompt's token ids on each choice."""

    __slots__ = (
        "_echoes",
        "_text_offsets",
        "_unsent_echoes",
        "_unsent_prompt_ids",
        "model",
        "return_token_ids",
        "tokens_as_ids",
    )

    id_prefix = "cmpl-"
    chunk_object = "text_completion"
    response_object = "text_completion"

    def __init__(
        self,
        model: ServedModel,
        echoes: dict[int, str],
        *,
        return_token_ids: bool,
        tokens_as_ids: bool = False,
        echoed_prompt_ids: dict[int, list[int]] | None = None,
    ) -> None:
        """``echoes``: the prompt text each choice (by index) opens with;
        ``echoed_prompt_ids``: its token ids, which a stream sends on the echo's chunk."""
        self.model = model
        self.return_token_ids = return_token_ids
        self.tokens_as_ids = tokens_as_ids
        self._echoes = echoes
        self._unsent_echoes = dict(echoes)
        self._unsent_prompt_ids = dict(echoed_prompt_ids or {})
        # Where each choice's next text starts within the whole choice text, echo included.
        self._text_offsets = {index: len(echo) for index, echo in echoes.items()}

    def prelude(self, generations: Sequence[Generation]) -> list[dict[str, Any]]:
        return []

    def text_only(self, delta: Delta) -> bool:
        """Whether the delta's choice is :meth:`text_choice` with its text."""
        return bool(
            delta.text
            and delta.finish_reason is None
            and not delta.logprobs
            and not self.return_token_ids
            and not self._echoes
        )

    @staticmethod
    def text_choice(index: int) -> dict[str, Any]:
        return {
            "index": index,
            "text": TEXT_SLOT,
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }

    def chunk_choice(self, delta: Delta) -> dict[str, Any] | None:
        index = delta.choice.index
        text = delta.text
        prompt_ids = None
        if self._unsent_echoes:
            text = self._unsent_echoes.pop(index, "") + text
            prompt_ids = self._unsent_prompt_ids.pop(index, None)
        if not shows_anything(text, delta, self.return_token_ids):
            return None
        item: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.choice.stop_reason if delta.finish_reason else None,
        }
        if self._echoes:
            # As vLLM streams an echo: the prompt's ids on its chunk, null on the rest.
            item["prompt_token_ids"] = prompt_ids
        if delta.logprobs:
            start = self._text_offsets.get(index, 0)
            item["logprobs"] = completion_logprobs(
                self.model, delta.logprobs, start, self.tokens_as_ids
            )
            self._text_offsets[index] = start + len(delta.text)
        if self.return_token_ids:
            item["token_ids"] = delta.token_ids
        return item

    def response_choice(self, generation: Generation, choice: ChoiceState) -> dict[str, Any]:
        echo = self._echoes.get(choice.index, "")
        item: dict[str, Any] = {
            "index": choice.index,
            "text": echo + choice.text,
            "logprobs": completion_logprobs(
                self.model, choice.logprobs, len(echo), self.tokens_as_ids
            )
            if choice.logprobs is not None
            else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "weight_versions": choice.weight_version_segments(),
        }
        if self._echoes and item["logprobs"] is not None and generation.prompt_logprobs:
            prompt = prompt_completion_logprobs(
                self.model,
                generation.request["token_ids"],
                generation.prompt_logprobs,
                self.tokens_as_ids,
            )
            item["logprobs"] = {key: prompt[key] + item["logprobs"][key] for key in prompt}
        if generation.prompt_logprobs is not None:
            item["prompt_logprobs"] = vllm_prompt_logprobs(
                self.model, generation.prompt_logprobs, self.tokens_as_ids
            )
        if self.return_token_ids:
            item["prompt_token_ids"] = generation.request["token_ids"]
            item["token_ids"] = choice.token_ids
        return item

    def response_fields(self, generations: Sequence[Generation]) -> dict[str, Any]:
        return {}


def check_prompt_logprobs(
    body: CompletionRequest | ChatCompletionRequest, model: ServedModel
) -> None:
    """``prompt_logprobs`` only from an engine that reports them, and not streamed."""
    if body.prompt_logprobs is None:
        return
    if not engine_capability(model, SUPPORTS_PROMPT_LOGPROBS):
        raise InvalidRequestError(
            f"prompt_logprobs is not supported by the model '{body.model}': its engine "
            "reports no prompt logprobs",
            param="prompt_logprobs",
            code="unsupported_parameter",
        )
    if body.stream:
        raise InvalidRequestError(
            "prompt_logprobs are not streamed: send the request without stream",
            param="prompt_logprobs",
        )


def _check_unsupported(body: CompletionRequest, model: ServedModel) -> None:
    check_prompt_logprobs(body, model)
    if (
        body.echo
        and body.logprobs is not None
        and body.prompt_logprobs is None
        and not body.stream
        and engine_capability(model, SUPPORTS_PROMPT_LOGPROBS)
    ):
        # vLLM's rule: echoed logprobs cover the prompt, from its prompt logprobs.
        body.prompt_logprobs = body.logprobs
    if body.suffix is not None:
        raise InvalidRequestError("suffix is not supported by this server", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError("best_of must be equal to n when given", param="best_of")


def _check_batch_fits(prompts: list[list[int]], model: ServedModel) -> None:
    """Each prompt is one engine request: a batch the gate can never hold is a bad request,
    not an overload, since retrying it later would never help."""
    gate = model.host.admission
    if gate is not None and len(prompts) > gate.capacity:
        raise InvalidRequestError(
            f"prompt: {len(prompts)} prompts in one request, but this server holds at most "
            f"{gate.capacity} (max_concurrency {gate.max_active} + max_queue "
            f"{gate.max_queued}); send fewer prompts per request",
            param="prompt",
            code="invalid_value",
        )


def _echoes(
    body: CompletionRequest, model: ServedModel, generations: list[Generation]
) -> dict[int, str]:
    """Each choice's prompt text, decoded as a whole (special tokens shown)."""
    if not body.echo:
        return {}
    if model.preprocessor is None:
        raise InvalidRequestError(
            "echo needs a tokenizer to render the prompt; none is configured", param="echo"
        )
    echoes: dict[int, str] = {}
    for generation in generations:
        text = model.preprocessor.decode(generation.request["token_ids"], skip_special_tokens=False)
        echoes.update((choice.index, text) for choice in generation.choices)
    return echoes


async def completion_generations(
    gateway: Gateway,
    body: CompletionRequest,
    request: Request,
    deadline: Deadline | None,
    endpoint: str,
    uploader: MetadataUploader | None = None,
) -> tuple[ServedModel, list[Generation]]:
    """One :class:`Generation` per prompt of ``body``, every check passed; none started."""
    model = served_model(gateway, body, "completions", endpoint)
    _check_unsupported(body, model)
    guided_decoding = sampling_guided_decoding(body, model)
    prompts = await completion_prompts(gateway, body, model, deadline)
    _check_batch_fits(prompts, model)
    return model, [
        Generation(
            gateway,
            model,
            generate_request(
                body,
                model,
                ids,
                max_tokens=body.max_tokens,
                logprobs=body.logprobs,
                guided_decoding=guided_decoding,
                uploader=uploader,
                key_scope=key_cache_scope(request),
            ),
            engine_context(request, i if len(prompts) > 1 else None, user=body.user),
            stops=body.stop_list,
            keep_text=not body.stream,
            want_logprobs=body.logprobs is not None,
            endpoint=endpoint,
            streaming=body.stream,
            index_offset=i * body.n,
            deadline=deadline,
        )
        for i, ids in enumerate(prompts)
    ]


async def create_completion(
    gateway: Gateway, body: CompletionRequest, request: Request
) -> Response:
    deadline = request_deadline(request, gateway.settings)
    uploader = metadata_uploader(body, gateway.settings)
    model, generations = await completion_generations(
        gateway, body, request, deadline, "completions", uploader
    )
    completion_format = CompletionFormat(
        model,
        _echoes(body, model, generations),
        return_token_ids=body.return_token_ids,
        tokens_as_ids=body.return_tokens_as_token_ids,
        echoed_prompt_ids={
            choice.index: generation.request["token_ids"]
            for generation in generations
            for choice in generation.choices
        }
        if body.echo
        else None,
    )
    plan = ResponsePlan(completion_format, generations, body, uploader, deadline)
    return await respond(request, plan)

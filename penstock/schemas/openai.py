"""Request models of the OpenAI chat and completions APIs, validated at the edge.

Unknown fields are kept at every depth (``extra="allow"``) so the serving layer can
reject them by their full path, or ignore them when the operator allows it
(:mod:`penstock.schemas.fields`). Responses are plain dicts built on the hot path, not
models.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from penstock.errors import FieldValueError
from penstock.schemas.unicode import JSONValue, RequestModel

NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]

MAX_STOP_LENGTH = 1024
"""Characters per stop string. Real stop strings are a few dozen characters at most; the
limit keeps the stop matcher's memory, which grows with their total length, small."""


class _Nested(RequestModel):
    """A nested object: its undeclared fields are kept for the unknown-field check."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)


class TextPart(_Nested):
    type: Literal["text"]
    text: str


class ImageURL(_Nested):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Nested):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Nested):
    # Base64 audio bytes, as OpenAI's input_audio part sends them.
    data: str
    # The container: wav and mp3 in OpenAI's API; any PyAV can open is accepted.
    format: Annotated[str, Field(pattern=r"^[A-Za-z0-9.+-]{1,32}$")]


class InputAudioPart(_Nested):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURL(_Nested):
    url: str


class AudioURLPart(_Nested):
    """vLLM's audio reference part, for audio at a URL."""

    type: Literal["audio_url"]
    audio_url: AudioURL


ContentPart = Annotated[
    TextPart | ImagePart | InputAudioPart | AudioURLPart, Field(discriminator="type")
]


def _list_or_str(value: Any) -> str:
    return "list" if isinstance(value, list) else "str"


# Only the member that fits the value's JSON type is tried: otherwise pydantic reports both
# members' errors, and the first ("Input should be a valid string") hides the real problem
# inside a content part.
MessageContent = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[ContentPart], Tag("list")],
    Discriminator(_list_or_str),
]


class FunctionCall(_Nested):
    name: str
    arguments: str


class ToolCall(_Nested):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Nested):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    # An earlier answer's reasoning, as chat answers carry it; templates read the first.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _role_rules(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs 'tool_call_id'")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a message with role '{self.role}' needs 'content'")
        if isinstance(self.content, list) and self.role != "user":
            if any(part.type != "text" for part in self.content):
                raise ValueError(f"role '{self.role}' accepts only text content parts")
        return self


class StreamOptions(_Nested):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JSONSchemaFormat(_Nested):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Nested):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs 'json_schema'")
        return self


class FunctionDefinition(_Nested):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Nested):
    type: Literal["function"]
    function: FunctionDefinition


# vLLM's extra sampling fields this server cannot honour, each with the value that asks for
# nothing (accepted as such; any other value is a 400 naming the field).
VLLM_UNSUPPORTED: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "truncate_prompt_tokens": None,
    "allowed_token_ids": None,
    "bad_words": [],
    "guided_whitespace_pattern": None,
    "logits_processors": None,
    "request_id": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "mm_processor_kwargs": None,
}


class SamplingFields(RequestModel):
    """Fields shared by chat and completions."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)
    # Upstream fields refused unless they ask for nothing (see ``VLLM_UNSUPPORTED``).
    unsupported: ClassVar[dict[str, Any]] = VLLM_UNSUPPORTED

    # Left out or empty: the served model, as in vLLM (``serving.limits.served_model``).
    model: str = ""
    n: PositiveInt = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    # OpenAI's fields that ask this server for nothing it would do differently: a caller's
    # identity and cache routing hint, stored-completion bookkeeping, a tier. Accepted,
    # so clients written for OpenAI need no change.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # vLLM's output options: special tokens in the text, and the matched stop string kept.
    skip_special_tokens: bool = True
    # Penstock's tokenizers decode as a fast tokenizer does, which places special tokens
    # the same way whichever value is asked for.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Logprob tokens named ``token_id:N`` instead of their text.
    return_tokens_as_token_ids: bool = False
    # Keeps requests from reusing cached KV: a cached prefix only saves work here (every
    # weight update clears it), so the output is the same with or without it.
    cache_salt: str | None = None
    # vLLM's scheduling priority (lower runs first), for engines that order by it.
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    nvext: dict[str, Any] | None = None
    # vLLM's output constraints (see ``serving.guided``): its ``structured_outputs`` and
    # the older one-field spellings.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # OpenAI's output constraint, on completions too as in vLLM (``serving.guided``).
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if any(not item for item in items):
            raise ValueError("stop sequences must be non-empty strings")
        longest = max(map(len, items), default=0)
        if longest > MAX_STOP_LENGTH:
            raise ValueError(
                f"each stop sequence may be at most {MAX_STOP_LENGTH} characters long; "
                f"got one of {longest}"
            )
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise FieldValueError(
                "stream_options", "'stream_options' is only allowed when 'stream' is true"
            )
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Passed to the chat template as vLLM passes it: ``reasoning_effort``, and
    # ``enable_thinking`` unless ``chat_template_kwargs`` sets it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    # Only text comes out of this server; "audio" asks for what it cannot give.
    modalities: list[Literal["text"]] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # The tokenizer's special tokens around the rendered conversation too (its template
    # writes its own, hence off by default, as in vLLM).
    add_special_tokens: bool = False
    # vLLM's: each prompt token's logprob, its rank and this many most likely others.
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    unsupported: ClassVar[dict[str, Any]] = {
        **VLLM_UNSUPPORTED,
        "continue_final_message": False,
        "echo": False,
        "documents": None,
        "chat_template": None,
    }

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldValueError("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs`` with ``reasoning_effort`` added as vLLM adds it."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        given = self.chat_template_kwargs or {}
        added = {"reasoning_effort": self.reasoning_effort}
        if "enable_thinking" not in given:
            added["enable_thinking"] = self.reasoning_effort != "none"
        return {**added, **given}


PromptInput = str | list[str] | list[int] | list[list[int]]


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# The shapes ``_prompt_shape`` accepts, stated in the OpenAPI document for clients.
_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        _TOKEN_IDS_SCHEMA,
        {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1},
    ]
}


class CompletionRequest(SamplingFields):
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]
    max_tokens: PositiveInt | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's: each prompt token's logprob, its rank and this many most likely others.
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: PositiveInt | None = None
    suffix: str | None = None
    # Text prompts: the special tokens the tokenizer puts around an input (a BOS for
    # Llama 3, none for SmolLM2), as vLLM and Hugging Face add them.
    add_special_tokens: bool = True
    unsupported: ClassVar[dict[str, Any]] = {
        **VLLM_UNSUPPORTED,
        "prompt_embeds": None,
    }

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, value: Any) -> PromptInput:
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids or a list of lists "
                "of token ids, and not empty"
            )
        if all(isinstance(item, str) for item in value):
            return value
        if _is_token_ids(value):
            return value
        if all(_is_token_ids(item) for item in value):
            return value
        raise ValueError(
            "must be a string, a list of strings, a list of non-negative token ids or a list "
            "of non-empty lists of non-negative token ids"
        )

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a batch: strings or token-id lists."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]
        return self.prompt

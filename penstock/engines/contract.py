"""The engine contract: the types an engine implements and the guarantees the host gives.

Lifecycle, driven by :class:`penstock.engines.host.EngineHost`:

1. ``from_args(argv)`` parses the engine's own CLI and returns ``(engine, WorkerConfig)``;
   the engine is not started.
2. ``start(worker_id)`` loads the model and returns :class:`EngineConfig`. After it returns,
   ``generate`` must accept concurrent calls. ``worker_id`` is opaque, unique per process
   and stable for its lifetime.
3. ``generate(request, context)`` runs once per request, concurrently.
4. ``abort(context)`` runs at most once per request, only when the request was cancelled
   or the client went away, never on natural completion.
5. ``cleanup()`` runs once on shutdown after ``start`` (also after a failed ``start``, on
   partial state), never if ``start`` was not called, never concurrently with ``start``.

An engine derives from :class:`LLMEngine` (token ids in, token ids out) or :class:`RawEngine`
(the request body in, response objects out); :func:`model_input_of` tells which.

Every method besides ``from_args``, ``start``, ``generate`` and ``cleanup`` is optional:
:func:`fill_optional_hooks` gives an engine that lacks one (a duck-typed engine, or one
written against an older ``dynamo.common.backend``) the documented default.

``n`` > 1: an engine that yields several choices itself advertises it with
``EngineConfig.runtime_data[MULTI_CHOICE_RUNTIME_KEY] = True``; the host fans any other
engine's ``n`` out into n single-choice requests.

Cancellation: the host runs each ``generate`` in a task of its own, so a consumer going away
never reaches the engine as ``CancelledError``; the engine sees the context's mark and ends
the stream itself. An engine whose ``generate`` may be cancelled at any ``await`` and closed
at any ``yield`` (its ``finally`` releasing what the request held) advertises
``runtime_data[CANCEL_SAFE_RUNTIME_KEY] = True``: the host then drives it from the
consumer's task, which saves a task and a hand-off per chunk.

Media input: an engine that takes images (audio) in chat requests advertises
``runtime_data[SUPPORTS_IMAGE_INPUT] = True`` (``SUPPORTS_AUDIO_INPUT``); the gateway refuses
media parts for any other engine. It fetches and decodes the media itself and hands them
over in ``request["multi_modal_data"]``, Dynamo's item shape: ``{"image_url": [{"Decoded":
<RGB PIL.Image>}, ...], "audio_url": [{"Decoded": (<mono float32 ndarray>, <sample rate>)},
...]}``, in the order of the parts; ``ImageLoader.load_image_batch`` and
``AudioLoader.load_audio_batch`` accept these items as they are.

Priority: an engine that orders its queue by vLLM's ``priority`` (lower runs first)
advertises ``runtime_data[SUPPORTS_PRIORITY] = True`` and finds a non-zero priority in
``request["priority"]``; the gateway refuses a non-zero priority for any other engine.

Controls (pause, sleep, wake, abort, flush, weight checks): an engine that offers one
takes the body and gives the answer :mod:`penstock.engines.controls` defines, re-exported
here: its vocabulary (``PAUSE_MODES``, ``SLEEP_TAGS``), the one refusal
(:class:`ControlRejected`) and :class:`ControlTable`, which builds ``supported_controls``,
``engine_control`` and their update twins from an engine's handler tables.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypedDict

from penstock.engines.constants import DisaggregationMode, ModelInput
from penstock.engines.context import Context
from penstock.engines.controls import PAUSE_MODES as PAUSE_MODES
from penstock.engines.controls import SLEEP_TAGS as SLEEP_TAGS
from penstock.engines.controls import ControlRejected as ControlRejected
from penstock.engines.controls import ControlTable as ControlTable
from penstock.engines.health import parse_health_check_payload_cli
from penstock.errors import EngineLoadError

MULTI_CHOICE_RUNTIME_KEY = "multi_choice"
CANCEL_SAFE_RUNTIME_KEY = "cancel_safe"
SUPPORTS_IMAGE_INPUT = "supports_image_input"
SUPPORTS_AUDIO_INPUT = "supports_audio_input"
SUPPORTS_PRIORITY = "supports_priority"
# An engine that constrains its output to ``sampling_options.guided_decoding`` (the kinds
# of ``penstock.engines.transformers.features.constraints``); the gateway refuses every output
# constraint for any other engine.
SUPPORTS_GUIDED_DECODING = "supports_guided_decoding"
# An engine that reports vLLM's ``output_options.prompt_logprobs`` on its first chunk
# (``chunk["prompt_logprobs"]``: None, then per prompt token a list of ``{"token_id",
# "logprob", "rank"}``, the prompt token first), of ``softmax(logits / T)`` with
# ``output_options.prompt_logprobs_temperature`` T (1 unless given); the gateway refuses
# the field elsewhere.
SUPPORTS_PROMPT_LOGPROBS = "supports_prompt_logprobs"
# An engine that reports, on a choice's last chunk, the experts a mixture-of-experts model
# routed each of its tokens to when ``output_options.return_routed_experts`` asks
# (``chunk["routed_experts"]``: per token of the prompt and output that went through the
# model, per MoE layer, the ``top_k`` expert indices); the gateway refuses it elsewhere.
SUPPORTS_ROUTED_EXPERTS = "supports_routed_experts"
# An engine whose output for a request does not depend on the requests beside it, with
# logprobs equal to a trainer's forward pass (``--deterministic``).
SUPPORTS_DETERMINISTIC = "deterministic"


class GenerateRequest(TypedDict, total=False):
    """Inbound request of :meth:`LLMEngine.generate`.

    ``token_ids`` is always set by the gateway's preprocessor; every other group is
    optional and should be read defensively (``request.get("sampling_options", {})``).
    """

    token_ids: list[int]
    model: str
    sampling_options: dict[str, Any]
    stop_conditions: dict[str, Any]
    output_options: dict[str, Any]
    require_reasoning: bool
    prefill_result: dict[str, Any]
    bootstrap_info: dict[str, Any]
    multi_modal_data: dict[str, Any]
    mm_processor_kwargs: dict[str, Any]
    mm_routing_info: dict[str, Any]
    encoder_result: dict[str, Any]
    extra_args: dict[str, Any]
    routing: dict[str, Any]


class GenerateChunk(TypedDict, total=False):
    """One item yielded by :meth:`LLMEngine.generate`.

    Every chunk carries ``token_ids`` (possibly empty) and ``index`` (the choice, 0 for a
    single choice). The last chunk of each choice carries ``finish_reason``; exactly one
    terminal per choice and nothing after it.
    """

    token_ids: list[int]
    index: int
    finish_reason: str
    completion_usage: dict[str, Any]
    disaggregated_params: dict[str, Any]
    encoder_result: dict[str, Any]
    log_probs: list[float]
    top_logprobs: list[list[dict[str, Any]]]
    engine_data: dict[str, Any]


RawRequest = dict[str, Any]
RawResponseChunk = dict[str, Any]


@dataclass
class LlmRegistration:
    """Token-pipeline metadata an LLM engine advertises; a None field is not advertised."""

    context_length: int | None = None
    kv_cache_block_size: int | None = None
    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    data_parallel_size: int | None = None
    data_parallel_start_rank: int | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    enable_eagle: bool = False
    max_gpu_lora_count: int | None = None


@dataclass
class EngineConfig:
    """Registration metadata returned by :meth:`BaseEngine.start`.

    Served-name precedence: ``WorkerConfig.served_model_name`` >
    ``EngineConfig.served_model_name`` > ``EngineConfig.model``.
    """

    model: str
    served_model_name: str | None = None
    runtime_data: dict[str, Any] | None = None
    llm: LlmRegistration | None = None
    model_aliases: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PushSource:
    """A KV event source (:meth:`LLMEngine.kv_event_sources`): the gateway calls
    ``on_ready(publisher)`` once with the rank's publisher; the engine calls
    ``publisher.publish_stored(token_ids, num_block_tokens, block_hashes, parent_hash=None)``
    and ``publisher.publish_removed(block_hashes)`` from any thread, and stops doing so in
    ``cleanup``."""

    on_ready: Callable[[Any], None]
    dp_rank: int = 0


@dataclass(frozen=True)
class ZmqSource:
    """Dynamo's other KV event source (the engine's ZMQ PUB socket). The gateway logs and
    ignores it: only :class:`PushSource` events are taken in-process."""

    endpoint: str
    topic: str = ""
    dp_rank: int = 0


KvEventSource = PushSource | ZmqSource


def _coerce_disaggregation_mode(value: Any) -> DisaggregationMode:
    if value is None:
        return DisaggregationMode.AGGREGATED
    if isinstance(value, DisaggregationMode):
        return value
    if isinstance(value, Enum):
        try:
            return DisaggregationMode[value.name]
        except KeyError as exc:
            raise TypeError(f"unknown disaggregation mode {value!r}") from exc
    raise TypeError(f"disaggregation_mode must be a DisaggregationMode, got {type(value).__name__}")


@dataclass
class WorkerConfig:
    """How the host serves an engine; what ``from_args`` returns next to the engine.

    ``model_name`` is a local folder holding the tokenizer and chat template the gateway
    uses for this engine; empty for raw engines and name-only engines (then the gateway
    needs ``--tokenizer`` to accept text prompts).
    """

    namespace: str
    component: str = "backend"
    endpoint: str = "generate"
    model_name: str = ""
    served_model_name: str | None = None
    model_input: ModelInput = ModelInput.Tokens
    endpoint_types: str = "chat,completions"
    discovery_backend: str = "etcd"
    request_plane: str = "tcp"
    event_plane: str | None = None
    use_kv_events: bool = False
    custom_jinja_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = True
    enable_local_indexer: bool = True
    enable_kv_routing: bool = True
    metrics_labels: list[tuple[str, str]] = field(default_factory=list)
    disaggregation_mode: DisaggregationMode = DisaggregationMode.AGGREGATED
    health_check_payload: dict[str, Any] | None = None
    structural_tag: str | None = None
    route_to_encoder: bool = False
    media_decoder: Any = None
    media_fetcher: Any = None
    kv_state_endpoint: str | None = None
    default_thinking_mode: str | None = None
    response_plane: str = "tcp"

    def __post_init__(self) -> None:
        self.disaggregation_mode = _coerce_disaggregation_mode(self.disaggregation_mode)

    @classmethod
    def from_runtime_config(
        cls,
        runtime_cfg: Any,
        model_name: str,
        served_model_name: str | None = None,
        model_input: ModelInput | None = None,
        **overrides: Any,
    ) -> WorkerConfig:
        """Build a config from any object carrying runtime settings as attributes."""

        def attr(name: str, default: Any = None) -> Any:
            return getattr(runtime_cfg, name, default)

        values: dict[str, Any] = {
            "namespace": attr("namespace", "penstock") or "penstock",
            "component": attr("component") or "backend",
            "endpoint": attr("endpoint") or "generate",
            "model_name": model_name,
            "served_model_name": served_model_name,
            "model_input": model_input or ModelInput.Tokens,
            "endpoint_types": attr("endpoint_types") or "chat,completions",
            "discovery_backend": attr("discovery_backend") or "etcd",
            "request_plane": attr("request_plane") or "tcp",
            "response_plane": attr("response_plane") or "tcp",
            "event_plane": attr("event_plane"),
            "use_kv_events": bool(attr("use_kv_events", False)),
            "custom_jinja_template": attr("custom_jinja_template"),
            "tool_call_parser": attr("dyn_tool_call_parser"),
            "reasoning_parser": attr("dyn_reasoning_parser"),
            "default_thinking_mode": attr("dyn_default_thinking_mode"),
            "exclude_tools_when_tool_choice_none": attr(
                "exclude_tools_when_tool_choice_none", True
            ),
            "enable_local_indexer": attr("enable_local_indexer", True),
            "enable_kv_routing": attr("enable_kv_routing", True),
            "structural_tag": attr("structural_tag"),
            "route_to_encoder": bool(attr("route_to_encoder", False)),
            "kv_state_endpoint": attr("kv_state_endpoint"),
        }
        if "disaggregation_mode" not in overrides:
            mode = attr("disaggregation_mode") or attr("serving_mode")
            if mode is not None:
                values["disaggregation_mode"] = mode
        raw_payload = attr("health_check_payload")
        if isinstance(raw_payload, str):
            values["health_check_payload"] = parse_health_check_payload_cli(raw_payload)
        elif isinstance(raw_payload, dict):
            values["health_check_payload"] = raw_payload
        values.update(overrides)
        return cls(**values)

    def endpoint_type_set(self) -> set[str]:
        """The parsed ``endpoint_types`` (canonical plural names)."""
        return parse_endpoint_types(self.endpoint_types)


_ENDPOINT_TYPE_ALIASES = {
    "chat": "chat",
    "completions": "completions",
    "embedding": "embeddings",
    "embeddings": "embeddings",
    "tensor": "tensor",
    "image": "images",
    "images": "images",
    "video": "videos",
    "videos": "videos",
    "audio": "audios",
    "audios": "audios",
}


def parse_endpoint_types(value: str) -> set[str]:
    """Comma split, trim, lowercase, skip empties; unknown or empty -> ``ValueError``."""
    result: set[str] = set()
    for raw in value.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name not in _ENDPOINT_TYPE_ALIASES:
            raise ValueError(f"unknown endpoint type '{name}'")
        result.add(_ENDPOINT_TYPE_ALIASES[name])
    if not result:
        raise ValueError("endpoint_types cannot be empty")
    return result


def _unsupported(kind: str, name: str) -> dict[str, Any]:
    return {"status": "error", "message": f"unsupported engine {kind}: {name}"}


class BaseEngine(abc.ABC):
    """The modality-agnostic engine lifecycle (see the module docstring)."""

    @classmethod
    @abc.abstractmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[BaseEngine, WorkerConfig]:
        """Parse CLI args (``None`` means ``sys.argv[1:]``) and build the engine, not started."""

    @abc.abstractmethod
    async def start(self, worker_id: int) -> EngineConfig:
        """Start the engine; afterwards ``generate`` must accept calls."""

    async def abort(self, context: Context) -> None:  # noqa: B027 - optional hook
        """Release resources of a cancelled request. Default: nothing to release."""

    async def is_quiescent(self) -> bool | None:
        """Whether in-flight KV transfers are done; None means no introspection."""
        return None

    @abc.abstractmethod
    async def cleanup(self) -> None:
        """Release every resource; null-safe over partial state; a second call is a no-op."""

    async def register_prometheus(self, metrics: Any) -> None:  # noqa: B027
        """Bridge an engine-owned Prometheus registry into ``/metrics``. Default: none."""

    def component_metrics_dp_ranks(self) -> list[int]:
        """Data-parallel ranks this engine publishes snapshots for; empty opts out."""
        return []

    def attach_snapshot_publisher(self, publisher: Any) -> None:  # noqa: B027
        """Receive the snapshot publisher once (only when ranks are non-empty)."""

    async def health_check_payload(self) -> dict[str, Any] | None:
        """Canary request sent through ``generate`` when idle; None disables probing."""
        return None

    def supported_controls(self) -> set[str]:
        """Names of the serving-lifecycle controls this engine implements."""
        return set()

    async def engine_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        return _unsupported("control", control)

    def supported_updates(self) -> set[str]:
        """Names of the asset-mutation updates this engine implements."""
        return set()

    async def engine_update(self, update: str, body: dict[str, Any]) -> dict[str, Any]:
        return _unsupported("update", update)

    async def on_endpoint_ready(self, endpoint: Any) -> None:  # noqa: B027
        """Called exactly once before serving begins; raising aborts startup."""


class LLMEngine(BaseEngine):
    """Token-in, token-out engines (chat and completions)."""

    @abc.abstractmethod
    def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Yield chunks for one request; called concurrently."""

    async def kv_event_sources(self) -> list[KvEventSource]:
        """KV event sources, one per data-parallel rank, asked once after ``start``."""
        return []

    async def logits_processor_spec(self) -> Any:
        return None


class RawEngine(BaseEngine):
    """Engines for raw media generation: the JSON body in, response object(s) out.

    Yield exactly one terminal object, or progress objects followed by a terminal one.
    """

    @abc.abstractmethod
    def generate(
        self, request: RawRequest, context: Context
    ) -> AsyncGenerator[RawResponseChunk, None]:
        """Yield response object(s) for one raw-media request."""


class DiffusionEngine(RawEngine):
    """A :class:`RawEngine` for diffusion-family image and video generation."""


_OPTIONAL_HOOKS: tuple[tuple[type, str], ...] = (
    *(
        (BaseEngine, name)
        for name in (
            "abort",
            "is_quiescent",
            "register_prometheus",
            "component_metrics_dp_ranks",
            "attach_snapshot_publisher",
            "health_check_payload",
            "supported_controls",
            "engine_control",
            "supported_updates",
            "engine_update",
            "on_endpoint_ready",
        )
    ),
    (LLMEngine, "kv_event_sources"),
    (LLMEngine, "logits_processor_spec"),
)


def fill_optional_hooks(engine: object) -> list[str]:
    """Give ``engine`` the documented default of every optional method it lacks.

    The defaults are bound on the instance, so every caller (host, metrics bridge, admin
    routes, RL plane) sees one engine surface. Returns the names that were filled.
    """
    filled: list[str] = []
    for base, name in _OPTIONAL_HOOKS:
        if callable(getattr(engine, name, None)):
            continue
        try:
            setattr(engine, name, getattr(base, name).__get__(engine))
        except AttributeError as exc:
            raise EngineLoadError(
                f"engine '{type(engine).__qualname__}' has no '{name}' and does not accept "
                f"the default one ({exc})"
            ) from exc
        filled.append(name)
    return filled


# Dynamo's ``dynamo.common.backend`` bases, by class name: an engine written for Dynamo
# derives from these, and the gateway must serve it without importing Dynamo.
_DYNAMO_BACKEND_MODULE = "dynamo.common.backend"
_DYNAMO_BASES: dict[str, ModelInput] = {
    "LLMEngine": ModelInput.Tokens,
    "RawEngine": ModelInput.Text,
}


def model_input_of(engine: object) -> ModelInput:
    """What the gateway hands ``engine`` (an instance or a class), decided by its base class.

    :class:`LLMEngine` subclasses get ``ModelInput.Tokens``: the gateway renders the chat
    template and tokenizes, and checks one terminal per choice. :class:`RawEngine`
    subclasses (:class:`DiffusionEngine` included) get ``ModelInput.Text``: the request body
    as it came, and every object the engine yields goes back. The same holds for Dynamo's
    own ``LLMEngine`` / ``RawEngine`` from ``dynamo.common.backend``, matched by module and
    name in the class's MRO. The nearest such base wins.

    Raises :class:`~penstock.errors.EngineLoadError` when the engine derives from neither.
    """
    cls = engine if isinstance(engine, type) else type(engine)
    for base in cls.__mro__:
        if base is LLMEngine:
            return ModelInput.Tokens
        if base is RawEngine:
            return ModelInput.Text
        if base.__module__.startswith(_DYNAMO_BACKEND_MODULE) and base.__name__ in _DYNAMO_BASES:
            return _DYNAMO_BASES[base.__name__]
    raise EngineLoadError(
        f"'{cls.__module__}.{cls.__qualname__}' is not an engine: it must derive from "
        "LLMEngine or RawEngine (penstock.engines.contract, or dynamo.common.backend)"
    )

"""The ``transformers`` engine: any local Hugging Face causal LM behind the token contract.

Forward passes run on the scheduler's thread (see :mod:`.scheduler`); ``generate`` only
validates, submits, and relays the chunks the thread hands over through the event loop,
so the HTTP server keeps serving while the model computes.

LoRA adapters (``load_lora`` / ``unload_lora``) are injected with peft (see :mod:`.lora`);
a request whose ``model`` names a loaded adapter runs with it, in the same batch as
requests for the base model and for other adapters.

A vision-language checkpoint (LLaVA-style, see :mod:`.vision`) advertises image input:
its requests' images become features once per distinct image, and their prefill runs
from ``inputs_embeds``; they decode in the same batch as text-only requests.

The controls are split by concern: pause, sleep, wake and abort in :mod:`.controls`;
weight updates, checks, versions and the snapshot a Ray fleet rolls back to
(``weights_snapshot`` / ``restore_weights_snapshot``) in :mod:`.weight_controls`; forward
passes, snapshots and gauges in :mod:`.telemetry`. Their bodies and answers are those of
:mod:`penstock.engines.controls`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from penstock.engines.context import API_KEY_METADATA, Context
from penstock.engines.contract import (
    CANCEL_SAFE_RUNTIME_KEY,
    MULTI_CHOICE_RUNTIME_KEY,
    SUPPORTS_DETERMINISTIC,
    SUPPORTS_GUIDED_DECODING,
    SUPPORTS_IMAGE_INPUT,
    SUPPORTS_PRIORITY,
    SUPPORTS_PROMPT_LOGPROBS,
    SUPPORTS_ROUTED_EXPERTS,
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
    PushSource,
    WorkerConfig,
)
from penstock.engines.controls import Body, ControlRejected, ControlTable, Handler, rejection
from penstock.engines.health import (
    build_health_check_payload,
    is_probe,
    parse_health_check_payload_cli,
)
from penstock.engines.transformers.args import EngineArgs, context_length, parse_args
from penstock.engines.transformers.controls import TransformersControls
from penstock.engines.transformers.core.block_manager import BLOCK_SIZE, pool_tokens
from penstock.engines.transformers.core.llama_decode import LlamaDecoder
from penstock.engines.transformers.core.sampling import SamplingDefaults, parse_sampling_params
from penstock.engines.transformers.core.scheduler import (
    BatchScheduler,
    StepFailure,
    Submission,
)
from penstock.engines.transformers.core.sequence import request_cache_salt, request_priority
from penstock.engines.transformers.default_model import DEFAULT_MODEL_NAME, prepare_default_model
from penstock.engines.transformers.features.grammar_compiles import CompileQueue
from penstock.engines.transformers.features.lora import AdapterSet
from penstock.engines.transformers.features.vision import (
    VisionEncoder,
    check_vision_config,
    is_vision_config,
    load_vision_model,
)
from penstock.engines.transformers.generation_config import load_sampling_defaults
from penstock.engines.transformers.kernels.loader import run_cancellable
from penstock.engines.transformers.kernels.paged_attention import load_attention_kernel
from penstock.engines.transformers.lora_controls import TransformersLoraControls
from penstock.engines.transformers.telemetry import TransformersTelemetry
from penstock.engines.transformers.weights.checkpoint import (
    CheckpointError,
    check_checkpoint_folder,
    load_model,
)
from penstock.engines.transformers.weights.cpu_weights import kernel_for_weights, pack_model
from penstock.engines.transformers.weights.gguf_weights import (
    decode_from_gguf_blocks,
    restore_gguf_blocks,
)
from penstock.engines.transformers.weights.sync import WeightSync
from penstock.engines.transformers.weights.weight_controls import TransformersWeightControls

logger = logging.getLogger(__name__)

# Operations that move or replace weights or KV run one at a time.
_MEMORY_OPERATIONS = frozenset(
    {
        "sleep",
        "wake_up",
        "update_weights_from_disk",
        "update_weights_from_distributed",
        "update_weights_from_tensor",
        "update_weights_from_nixl",
        "reset_weights",
        "load_lora",
        "unload_lora",
    }
)


def _resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but no CUDA device is available")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def _resolve_dtype(choice: str, device: torch.device, config: Any) -> torch.dtype:
    if choice != "auto":
        return getattr(torch, choice)
    if device.type == "cpu":
        return torch.float32
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16


def _token_ids(value: Any, vocab_size: int) -> list[int]:
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if len(raw) % 4:
            raise ValueError("token_ids: packed token ids must be a multiple of 4 bytes")
        ids = torch.frombuffer(bytearray(raw), dtype=torch.int32).tolist()
    elif isinstance(value, list):
        ids = value
    else:
        raise ValueError("token_ids is required and must be a list of token ids")
    if not ids:
        raise ValueError("token_ids must not be empty")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(f"token_ids: {token!r} is not a token id in [0, {vocab_size})")
    return ids


def _eos_ids(*sources: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


class TransformersEngine(
    TransformersControls,
    TransformersLoraControls,
    TransformersWeightControls,
    TransformersTelemetry,
    ControlTable,
    LLMEngine,
):
    """Continuous-batching engine over ``transformers`` models (CPU or CUDA)."""

    def __init__(
        self,
        args: EngineArgs,
        model_path: Path,
        served_model_name: str,
        sampling_defaults: SamplingDefaults,
    ) -> None:
        self.args = args
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.sampling_defaults = sampling_defaults
        self.model: Any = None
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.context_length = 0
        self.vocab_size = 0
        self.scheduler: BatchScheduler | None = None
        self.weight_version: str | None = None
        self._weights_source: Path | None = None
        TransformersControls.__init__(self)
        TransformersTelemetry.__init__(self)
        self._memory_lock = asyncio.Lock()
        self._bos_or_eos = 0
        # Linear and embedding weights kept in bfloat16, computed in float32 (see cpu_weights).
        self.bf16_weights = False
        # On top, linear layers decode from an int8 copy or GGUF blocks (see gguf_weights).
        self.int8_weights = False
        self.gguf_weights = False
        TransformersLoraControls.__init__(self)
        self.weight_sync = WeightSync()
        # Set for vision-language checkpoints: encodes images, expands their placeholders.
        self.vision: VisionEncoder | None = None
        # Compiles the grammars of constrained requests (see :mod:`.grammar_compiles`).
        self.grammars: CompileQueue | None = None
        self._load_model: Callable[..., Any] = load_model

    # -- lifecycle ------------------------------------------------------------------------

    @classmethod
    async def from_args(
        cls, argv: list[str] | None = None
    ) -> tuple[TransformersEngine, WorkerConfig]:
        args = parse_args(sys.argv[1:] if argv is None else list(argv))
        if args.model is None:
            model_path = await prepare_default_model(args.model_cache_dir)
            default_name = DEFAULT_MODEL_NAME
        else:
            model_path = check_checkpoint_folder(args.model)
            default_name = str(args.model)
        served = args.served_model_name or default_name
        defaults = load_sampling_defaults(args.generation_config, model_path)
        engine = cls(args, model_path, served, defaults)
        worker = WorkerConfig(
            namespace="penstock",
            component="backend",
            model_name=str(model_path),
            served_model_name=served,
            endpoint_types="chat,completions",
            health_check_payload=parse_health_check_payload_cli(args.health_check_payload),
        )
        return engine, worker

    async def start(self, worker_id: int) -> EngineConfig:
        try:
            config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        except Exception as exc:
            raise CheckpointError(f"cannot read the config of {self.model_path}: {exc}") from exc
        self.device = _resolve_device(self.args.device)
        if self.args.cpu_threads is not None:
            torch.set_num_threads(self.args.cpu_threads)
        self.dtype = _resolve_dtype(self.args.dtype, self.device, config)
        if is_vision_config(config):
            check_vision_config(config)
            self._load_model = load_vision_model
        self.model = await asyncio.to_thread(
            self._load_model, self.model_path, dtype=self.dtype, device=self.device
        )
        await run_cancellable(self._choose_cpu_weights, config)
        text_config = self.model.config.get_text_config(decoder=True)
        self.context_length = context_length(
            self.args.max_model_len, getattr(text_config, "max_position_embeddings", None)
        )
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        eos = _eos_ids(self.model.generation_config, text_config)
        bos = getattr(self.model.generation_config, "bos_token_id", None)
        self._bos_or_eos = bos if isinstance(bos, int) else min(eos, default=0)
        timeout = self.args.grammar_compile_timeout
        self.grammars = CompileQueue(self.model_path, self.vocab_size, eos, timeout)
        assert self.dtype is not None and self.device is not None
        kv_tokens = pool_tokens(
            self.args, text_config, self.dtype, self.device, self.context_length
        )
        scheduler = self._start_scheduler(worker_id, eos, kv_tokens)
        logger.info(
            "transformers engine ready: %s on %s (%s%s), context %d, %d sequences, %d KV tokens",
            self.model_path,
            self.device,
            str(self.dtype).removeprefix("torch."),
            ", int8 weights"
            if self.int8_weights
            else ", bfloat16 weights from GGUF blocks"
            if self.gguf_weights
            else ", bfloat16 weights"
            if self.bf16_weights
            else "",
            self.context_length,
            self.args.max_num_seqs,
            kv_tokens,
        )
        return EngineConfig(
            model=self.served_model_name,
            served_model_name=self.served_model_name,
            runtime_data={
                MULTI_CHOICE_RUNTIME_KEY: True,
                # generate ends cleanly when cancelled at an await or closed at a yield.
                CANCEL_SAFE_RUNTIME_KEY: True,
                SUPPORTS_IMAGE_INPUT: self.vision is not None,
                SUPPORTS_PRIORITY: True,
                SUPPORTS_GUIDED_DECODING: True,
                SUPPORTS_PROMPT_LOGPROBS: True,
                SUPPORTS_DETERMINISTIC: self.args.deterministic,
                SUPPORTS_ROUTED_EXPERTS: scheduler.runner.records_experts,
            },
            llm=LlmRegistration(
                context_length=self.context_length,
                kv_cache_block_size=BLOCK_SIZE,
                total_kv_blocks=scheduler.kv_total_blocks,
                max_num_seqs=self.args.max_num_seqs,
                max_num_batched_tokens=self.context_length,
            ),
        )

    def _start_scheduler(
        self, worker_id: int, eos: frozenset[int], kv_tokens: int
    ) -> BatchScheduler:
        """The batch scheduler over the loaded model (and its vision encoder), running."""
        device, dtype = self._placement()
        scheduler = BatchScheduler(
            self.model,
            device=device,
            eos_token_ids=eos,
            vocab_size=self.vocab_size,
            max_num_seqs=self.args.max_num_seqs,
            kv_capacity_tokens=kv_tokens,
            seed=self.args.seed,
            engine_data=self._engine_data,
            on_forward_pass=self._on_forward_pass,
            worker_id=str(worker_id),
            # A cached prefix's KV was computed inside another prompt.
            prefix_caching=self.args.enable_prefix_caching and not self.args.deterministic,
            step_tokens=self.args.max_num_batched_tokens,
            decode_gap_ratio=self.args.decode_gap_ratio,
            deterministic=self.args.deterministic,
            kv_dtype=dtype,
        )
        scheduler.decoder = LlamaDecoder.for_model(self.model, max_rows=self.args.max_num_seqs)
        if self._load_model is load_vision_model:
            self.vision = VisionEncoder(
                self.model_path,
                self.model.config,
                model=lambda: self.model,
                step_lock=scheduler.step_lock,
                device=device,
                dtype=dtype,
                cache_bytes=self.args.encoder_cache_bytes,
            )
        self.scheduler = scheduler
        scheduler.start()
        return scheduler

    def _choose_cpu_weights(self, config: Any) -> None:
        choice = self.args.cpu_weight_dtype
        if self.device is None or self.device.type != "cpu" or self.dtype != torch.float32:
            return
        load_attention_kernel(self.args.model_cache_dir)
        if self.args.deterministic:
            # The trainer's forward pass runs on the checkpoint's modules, not packed copies.
            return
        if choice == "auto":
            stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            choice = "bfloat16" if str(stored).removeprefix("torch.") == "bfloat16" else "float32"
        if choice not in ("bfloat16", "int8", "gguf"):
            return
        if not kernel_for_weights(self.args.model_cache_dir):
            return
        pack_model(self.model, int8=choice == "int8", activations=self.args.cpu_activation_dtype)
        self.bf16_weights = True
        self.int8_weights = choice == "int8"
        if choice == "gguf" or (choice == "bfloat16" and self.args.cpu_weight_dtype == "auto"):
            self.gguf_weights = decode_from_gguf_blocks(self.model, self.model_path, choice)

    async def cleanup(self) -> None:
        scheduler, self.scheduler = self.scheduler, None
        if scheduler is not None:
            await asyncio.to_thread(scheduler.stop)
        self.weight_sync.close()
        self.model = None
        self.lora = AdapterSet()
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- requests ------------------------------------------------------------------------

    def _engine_data(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version}

    def _require_scheduler(self) -> BatchScheduler:
        if self.scheduler is None:
            raise RuntimeError("the transformers engine is not started")
        return self.scheduler

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        scheduler = self._require_scheduler()
        adapter = self._adapter_for(request.get("model"))
        prompt = _token_ids(request.get("token_ids"), self.vocab_size)

        def sampling_params() -> Any:
            return parse_sampling_params(
                dict(request),
                prompt_len=len(prompt),
                context_length=self.context_length,
                vocab_size=self.vocab_size,
                max_num_seqs=self.args.max_num_seqs,
                defaults=self.sampling_defaults,
            )

        params = sampling_params()
        embed = None
        if self.vision is not None:
            # Expanded image placeholders lengthen the prompt: its limits are checked again.
            prompt, embed = await self.vision.prepare(prompt, request.get("multi_modal_data"))
            if embed is not None:
                params = sampling_params()
        elif request.get("multi_modal_data"):
            raise ValueError("multi_modal_data: this model takes text only")
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[list[Any]] = asyncio.Queue()

        def deliver(items: list[Any]) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, items)
            except RuntimeError:
                logger.debug("request %s: event loop closed before delivery", context.id())

        # Compiled off the loop (cached by spec): a bad grammar fails before any token.
        grammar = None
        if params.guided is not None and self.grammars is not None:
            owner = context.metadata.get(API_KEY_METADATA)
            grammar = await self.grammars.compile(params.guided, owner)
        submission = Submission(
            context.id(),
            context,
            prompt,
            params,
            deliver,
            adapter,
            embed=embed,
            cache_salt=request_cache_salt(request),
            priority=request_priority(request),
            grammar=grammar,
        )
        scheduler.submit(submission)
        # Canaries probe that the engine runs: an abort of every request leaves them be.
        tracked = not is_probe(request)
        if tracked:
            self._in_flight.add(submission)
        remaining = params.n
        try:
            while remaining:
                for item in await inbox.get():
                    if isinstance(item, StepFailure):
                        raise RuntimeError(str(item))
                    if "finish_reason" in item:
                        remaining -= 1
                    yield item
        finally:
            self._in_flight.discard(submission)
            if remaining:
                scheduler.cancel(submission)

    async def abort(self, context: Context) -> None:
        if self.scheduler is not None:
            self.scheduler.cancel_request_id(context.id())

    async def kv_event_sources(self) -> list[Any]:
        return [PushSource(on_ready=self._require_scheduler().attach_kv_events, dp_rank=0)]

    async def health_check_payload(self) -> dict[str, Any] | None:
        return build_health_check_payload(self._bos_or_eos)

    # -- controls and updates ---------------------------------------------------------------

    def control_handlers(self) -> dict[str, Handler]:
        return {**self.lifecycle_controls(), **self.weight_controls()}

    def update_handlers(self) -> dict[str, Handler]:
        return {
            **self.weight_updates(),
            "load_lora": self._load_lora,
            "unload_lora": self._unload_lora,
        }

    async def around_handler(self, name: str, handler: Handler, body: Body) -> Body:
        if self.scheduler is None:
            return rejection("the engine is not running")
        try:
            if name in _MEMORY_OPERATIONS:
                async with self._memory_lock:
                    return await handler(body)
            return await handler(body)
        except ControlRejected:
            raise
        except Exception as exc:
            logger.exception("engine call %s failed", name)
            return rejection(str(exc) or type(exc).__name__)

    def _install_forward_module(self, scheduler: BatchScheduler) -> None:
        """Point the scheduler at the module to call (call with ``step_lock`` held)."""
        activations = self.args.cpu_activation_dtype
        if self.bf16_weights:
            # A model reloaded after deep sleep comes back float32.
            pack_model(self.model, int8=self.int8_weights, activations=activations)
            if self.gguf_weights:
                restore_gguf_blocks(self.model, self.model_path)
        scheduler.model = self.lora.forward_module(self.model)
        scheduler.adapters_loaded = bool(self.lora)
        scheduler.decoder = LlamaDecoder.for_model(self.model, max_rows=self.args.max_num_seqs)

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

``weights_snapshot`` / ``restore_weights_snapshot`` keep a CPU copy of the weights and put
it back: a Ray fleet rolls back an update one of its replicas failed (:mod:`penstock.ray`).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import sys
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from penstock.engines.context import Context
from penstock.engines.contract import (
    CANCEL_SAFE_RUNTIME_KEY,
    MULTI_CHOICE_RUNTIME_KEY,
    SUPPORTS_GUIDED_DECODING,
    SUPPORTS_IMAGE_INPUT,
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
    WorkerConfig,
)
from penstock.engines.health import build_health_check_payload, parse_health_check_payload_cli
from penstock.engines.transformers.args import EngineArgs, parse_args
from penstock.engines.transformers.constraints import GrammarCompiler
from penstock.engines.transformers.cpu_weights import load_kernel, pack_model, requantize
from penstock.engines.transformers.default_model import DEFAULT_MODEL_NAME, prepare_default_model
from penstock.engines.transformers.generation_config import load_sampling_defaults
from penstock.engines.transformers.llama_decode import LlamaDecoder
from penstock.engines.transformers.lora import (
    BASE_ROW,
    AdapterSet,
    LoraAdapter,
    LoraError,
    read_adapter,
)
from penstock.engines.transformers.sampling import SamplingDefaults, parse_sampling_params
from penstock.engines.transformers.scheduler import (
    KV_BLOCK_SIZE,
    BatchScheduler,
    KvUsage,
    StepFailure,
    Submission,
)
from penstock.engines.transformers.sync import WeightSync, checksum_control, weights_by_name
from penstock.engines.transformers.vision import (
    VisionEncoder,
    check_vision_config,
    is_vision_config,
    load_vision_model,
)
from penstock.engines.transformers.weights import (
    CheckpointError,
    apply_weight_update,
    check_checkpoint_folder,
    load_model,
    plan_weight_update,
    read_safetensors,
)
from penstock.engines.weight_sync import WeightSyncError
from penstock.metrics.forward_pass import ComponentSnapshot, ForwardPassMetrics
from penstock.nixl_agent import nixl_installed

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_TAGS = frozenset({"weights", "kv_cache"})
RECENT_FORWARD_PASSES = 256
# Operations that move or replace weights or KV run one at a time.
_MEMORY_OPERATIONS = frozenset(
    {
        "sleep",
        "wake_up",
        "update_weights_from_disk",
        "update_weights_from_distributed",
        "update_weights_from_tensor",
        "update_weights_from_nixl",
        "load_lora",
        "unload_lora",
    }
)

Body = dict[str, Any]


def _error(message: str) -> Body:
    return {"status": "error", "message": message}


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


class TransformersEngine(LLMEngine):
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
        self.forward_pass_metrics: collections.deque[ForwardPassMetrics] = collections.deque(
            maxlen=RECENT_FORWARD_PASSES
        )
        self.latest_forward_pass_metrics: ForwardPassMetrics | None = None
        self._weights_source: Path | None = None
        self._snapshot_publisher: Any = None
        self._publish_forward_pass: Callable[[ForwardPassMetrics], None] | None = None
        self._sleeping: set[str] = set()
        self._paused_by_sleep = False
        self._memory_lock = asyncio.Lock()
        self._bos_or_eos = 0
        # Linear and embedding weights kept in bfloat16, computed in float32 (see cpu_weights).
        self.bf16_weights = False
        # On top, linear layers decode from an int8 copy of their weight (see cpu_weights).
        self.int8_weights = False
        self.lora = AdapterSet()
        # Adapters being unloaded, and unloaded ones: their names are refused, never served
        # by the base model in their place.
        self._unloading: set[str] = set()
        self._retired: set[str] = set()
        self.weight_sync = WeightSync()
        # Set for vision-language checkpoints: encodes images, expands their placeholders.
        self.vision: VisionEncoder | None = None
        # Compiles the grammars of constrained requests (see :mod:`.constraints`).
        self.grammars: GrammarCompiler | None = None
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
        await asyncio.to_thread(self._choose_cpu_weights, config)
        text_config = self.model.config.get_text_config(decoder=True)
        model_limit = getattr(text_config, "max_position_embeddings", None)
        if self.args.max_model_len is not None:
            if model_limit is not None and self.args.max_model_len > model_limit:
                raise ValueError(
                    f"--max-model-len {self.args.max_model_len} exceeds the model's "
                    f"max_position_embeddings of {model_limit}"
                )
            self.context_length = self.args.max_model_len
        elif model_limit is not None:
            self.context_length = int(model_limit)
        else:
            raise ValueError(
                "the model config has no max_position_embeddings; pass --max-model-len"
            )
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        eos = _eos_ids(self.model.generation_config, text_config)
        bos = getattr(self.model.generation_config, "bos_token_id", None)
        self._bos_or_eos = bos if isinstance(bos, int) else min(eos, default=0)
        self.grammars = GrammarCompiler(self.model_path, self.vocab_size, eos)
        kv_tokens = self.args.kv_cache_tokens or self.args.max_num_seqs * self.context_length
        self.scheduler = BatchScheduler(
            self.model,
            device=self.device,
            eos_token_ids=eos,
            vocab_size=self.vocab_size,
            max_num_seqs=self.args.max_num_seqs,
            kv_capacity_tokens=kv_tokens,
            seed=self.args.seed,
            engine_data=self._engine_data,
            on_forward_pass=self._on_forward_pass,
            worker_id=str(worker_id),
        )
        self.scheduler.decoder = LlamaDecoder.for_model(self.model, max_rows=self.args.max_num_seqs)
        if self._load_model is load_vision_model:
            self.vision = VisionEncoder(
                self.model_path,
                self.model.config,
                model=lambda: self.model,
                step_lock=self.scheduler.step_lock,
                device=self.device,
                dtype=self.dtype,
                cache_bytes=self.args.encoder_cache_bytes,
            )
        self.scheduler.start()
        logger.info(
            "transformers engine ready: %s on %s (%s%s), context %d, %d sequences, %d KV tokens",
            self.model_path,
            self.device,
            str(self.dtype).removeprefix("torch."),
            ", int8 weights"
            if self.int8_weights
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
                SUPPORTS_GUIDED_DECODING: True,
            },
            llm=LlmRegistration(
                context_length=self.context_length,
                kv_cache_block_size=KV_BLOCK_SIZE,
                total_kv_blocks=self.scheduler.kv_total_blocks,
                max_num_seqs=self.args.max_num_seqs,
                max_num_batched_tokens=self.context_length,
            ),
        )

    def _choose_cpu_weights(self, config: Any) -> None:
        choice = self.args.cpu_weight_dtype
        if self.device is None or self.device.type != "cpu" or self.dtype != torch.float32:
            return
        if choice == "auto":
            stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            choice = "bfloat16" if str(stored).removeprefix("torch.") == "bfloat16" else "float32"
        if choice not in ("bfloat16", "int8"):
            return
        failure = load_kernel(self.args.model_cache_dir)
        if failure is not None:
            logger.warning("weights stay float32 (--cpu-weight-dtype): %s", failure)
            return
        pack_model(self.model, int8=choice == "int8")
        self.bf16_weights = True
        self.int8_weights = choice == "int8"

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
            grammar = await asyncio.to_thread(self.grammars.compile, params.guided)
        submission = Submission(
            context.id(), context, prompt, params, deliver, adapter, embed=embed, grammar=grammar
        )
        scheduler.submit(submission)
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
            if remaining:
                scheduler.cancel(submission)

    def _adapter_for(self, model: Any) -> str | None:
        """peft's key of the adapter ``model`` names; None for the base model."""
        if model is None or model == self.served_model_name:
            return None
        if not isinstance(model, str):
            raise ValueError(f"model: must be a string, got {type(model).__name__}")
        if model in self.lora and model not in self._unloading:
            return self.lora.adapters[model].key
        if model in self._unloading or model in self._retired:
            loaded = ", ".join(sorted(set(self.lora.adapters) - self._unloading)) or "none"
            raise ValueError(f"model: LoRA adapter {model!r} is not loaded (loaded: {loaded})")
        # The gateway has resolved every other name to the base model: it may serve the base
        # under names of its own (--served-model-name, aliases), and 404s unknown names.
        return None

    async def abort(self, context: Context) -> None:
        if self.scheduler is not None:
            self.scheduler.cancel_request_id(context.id())

    async def health_check_payload(self) -> dict[str, Any] | None:
        return build_health_check_payload(self._bos_or_eos)

    # -- metrics -------------------------------------------------------------------------

    def _on_forward_pass(self, metrics: ForwardPassMetrics, usage: KvUsage) -> None:
        """Runs on the scheduler thread after every forward pass and on going idle."""
        self.forward_pass_metrics.append(metrics)
        self.latest_forward_pass_metrics = metrics
        publisher = self._snapshot_publisher
        if publisher is None:
            return
        publish_forward_pass = self._publish_forward_pass
        if publish_forward_pass is not None:
            try:
                publish_forward_pass(metrics)
            except Exception:
                logger.exception("forward-pass publisher failed")
        snapshot = ComponentSnapshot(
            kv_used_blocks=usage.used_blocks,
            kv_total_blocks=usage.total_blocks,
            gpu_cache_usage=usage.used_blocks / usage.total_blocks if usage.total_blocks else 0.0,
            dp_rank=0,
        )
        try:
            publisher.publish(0, snapshot)
        except Exception:
            logger.exception("snapshot publisher failed")

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        # Forward passes go to Penstock's publisher only; Dynamo's has no such method.
        self._publish_forward_pass = getattr(publisher, "publish_forward_pass", None)
        self._snapshot_publisher = publisher

    async def register_prometheus(self, metrics: Any) -> None:
        add_callback = getattr(metrics, "add_expfmt_callback", None)
        if callable(add_callback):
            add_callback(self.prometheus_text)

    def prometheus_text(self) -> str:
        """The engine's gauges in the Prometheus text format."""
        scheduler = self.scheduler
        usage = scheduler.usage() if scheduler is not None else KvUsage(0, 0, 0, 0)
        label = self.served_model_name.replace("\\", "\\\\").replace('"', '\\"')
        gauges = (
            ("penstock_engine_kv_used_blocks", "KV cache blocks in use", usage.used_blocks),
            ("penstock_engine_kv_total_blocks", "KV cache blocks in total", usage.total_blocks),
            ("penstock_engine_num_running", "Sequences being decoded", usage.running),
            ("penstock_engine_num_waiting", "Requests waiting to start", usage.waiting),
        )
        lines = []
        for name, help_text, value in gauges:
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} gauge",
                f'{name}{{model="{label}"}} {value}',
            ]
        lines += [
            "# HELP penstock_engine_memory_bytes Memory the engine holds, by kind",
            "# TYPE penstock_engine_memory_bytes gauge",
        ]
        for kind, value in self.memory_bytes().items():
            lines.append(f'penstock_engine_memory_bytes{{model="{label}",kind="{kind}"}} {value}')
        if self.vision is not None:
            lines += self.vision.prometheus_lines(label)
        return "\n".join(lines) + "\n"

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the loaded weights (on the host while asleep, 0 once a sleep dropped them);
        on CUDA also what the allocator holds on the device."""
        model = self.model
        weights = 0
        if model is not None:
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
        found = {"weights": weights}
        device = self.device
        if device is not None and device.type == "cuda":
            found["device_allocated"] = torch.cuda.memory_allocated(device)
            found["device_reserved"] = torch.cuda.memory_reserved(device)
        return found

    # -- controls and updates ---------------------------------------------------------------

    def supported_controls(self) -> set[str]:
        return set(self._controls())

    def supported_updates(self) -> set[str]:
        return set(self._updates())

    def _controls(self) -> dict[str, Callable[[Body], Awaitable[Body]]]:
        return {
            "pause_generation": self._pause_generation,
            "resume_generation": self._resume_generation,
            "is_paused": self._is_paused,
            "is_sleeping": self._is_sleeping,
            "sleep": self._sleep,
            "wake_up": self._wake_up,
            "get_weight_version": self._get_weight_version,
            "flush_cache": self._flush_cache,
            "abort_request": self._abort_request,
            "weights_checksum": self._weights_checksum,
            "get_weights_by_name": self._get_weights_by_name,
        }

    def _updates(self) -> dict[str, Callable[[Body], Awaitable[Body]]]:
        updates: dict[str, Callable[[Body], Awaitable[Body]]] = {
            "update_weights_from_disk": self._update_weights_from_disk,
            "init_weights_update_group": self._init_weights_update_group,
            "update_weights_from_distributed": self._update_weights_from_distributed,
            "update_weights_from_tensor": self._update_weights_from_tensor,
            "destroy_weights_update_group": self._destroy_weights_update_group,
            "update_weight_version": self._update_weight_version,
            "set_weight_version": self._set_weight_version,
            "load_lora": self._load_lora,
            "unload_lora": self._unload_lora,
        }
        if nixl_installed():
            updates["update_weights_from_nixl"] = self._update_weights_from_nixl
        return updates

    async def engine_control(self, control: str, body: Body) -> Body:
        return await self._dispatch("control", self._controls(), control, body)

    async def engine_update(self, update: str, body: Body) -> Body:
        return await self._dispatch("update", self._updates(), update, body)

    async def _dispatch(
        self,
        kind: str,
        handlers: dict[str, Callable[[Body], Awaitable[Body]]],
        name: str,
        body: Any,
    ) -> Body:
        handler = handlers.get(name)
        if handler is None:
            return _error(f"unsupported engine {kind}: {name}")
        if body is None:
            body = {}
        if not isinstance(body, dict):
            return _error("request body must be a JSON object")
        if self.scheduler is None:
            return _error("the engine is not running")
        try:
            if name in _MEMORY_OPERATIONS:
                async with self._memory_lock:
                    return await handler(body)
            return await handler(body)
        except Exception as exc:
            logger.exception("engine %s %s failed", kind, name)
            return _error(str(exc) or type(exc).__name__)

    @staticmethod
    def _mode(body: Body, operation: str) -> str | Body:
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _error(f"Invalid mode '{mode}' for {operation}; expected abort|wait|keep")
        return str(mode)

    async def _pause(self, mode: str) -> list[str]:
        """Pause in ``mode``; the ids of the requests an ``abort`` pause ended."""
        scheduler = self._require_scheduler()
        in_flight = await asyncio.to_thread(
            scheduler.pause, abort=mode == "abort", freeze=mode == "keep"
        )
        if mode != "keep":
            await asyncio.to_thread(scheduler.wait_until_done, in_flight)
        return sorted(s.request_id for s in in_flight) if mode == "abort" else []

    async def _pause_generation(self, body: Body) -> Body:
        mode = self._mode(body, "pause_generation")
        if isinstance(mode, dict):
            return mode
        clear_cache = body.get("clear_cache", False)
        if not isinstance(clear_cache, bool):
            return _error("`clear_cache` must be a boolean")
        aborted = await self._pause(mode)
        if clear_cache:
            await self._flush_cache({})
        return {
            "status": "ok",
            "message": "Engine paused",
            "mode": mode,
            "clear_cache": clear_cache,
            "aborted": aborted,
        }

    async def _resume_generation(self, body: Body) -> Body:
        self._require_scheduler().resume()
        self._paused_by_sleep = False
        response: Body = {"status": "ok", "message": "Engine resumed"}
        if self._sleeping:
            response["is_sleeping"] = True
        return response

    async def _is_paused(self, body: Body) -> Body:
        return {"status": "ok", "is_paused": self._require_scheduler().paused}

    async def _is_sleeping(self, body: Body) -> Body:
        return {"status": "ok", "is_sleeping": bool(self._sleeping)}

    async def _sleep(self, body: Body) -> Body:
        level = body.get("level", 1)
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 2:
            return _error("`level` must be 0, 1 or 2")
        mode = self._mode(body, "sleep")
        if isinstance(mode, dict):
            return mode
        if self._sleeping:
            return {"status": "sleeping", "message": "Engine already sleeping", "is_sleeping": True}
        scheduler = self._require_scheduler()
        was_paused = scheduler.paused
        aborted = await self._pause(mode)
        self._paused_by_sleep = not was_paused
        await asyncio.to_thread(scheduler.set_sleeping, True)
        await asyncio.to_thread(self._release_memory, level)
        self._sleeping = set(SLEEP_TAGS)
        return {
            "status": "sleeping",
            "message": f"Engine slept (level={level})",
            "level": level,
            "is_sleeping": True,
            "aborted": aborted,
        }

    def _release_memory(self, level: int) -> None:
        """Level 1 moves weights and held KV to the CPU; level 2 drops the weights."""
        scheduler = self._require_scheduler()
        with scheduler.step_lock:
            if level >= 1:
                scheduler.move_kv(torch.device("cpu"))
            if level == 1 and self.model is not None:
                self.model.to("cpu")
            elif level == 2:
                self.model = None
                self.lora.forget_model()
                scheduler.model = None
                scheduler.decoder = None
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _restore_weights(self) -> None:
        scheduler = self._require_scheduler()
        device, dtype = self._placement()
        if self.model is None:
            model = self._load_model(self.model_path, dtype=dtype, device=device)
            if self._weights_source is not None:
                apply_weight_update(
                    plan_weight_update(model, read_safetensors(self._weights_source))
                )
            self.lora.reattach(model)
            self.model = model
        else:
            self.model.to(device)
        with scheduler.step_lock:
            self._install_forward_module(scheduler)

    def _install_forward_module(self, scheduler: BatchScheduler) -> None:
        """Point the scheduler at the module to call (call with ``step_lock`` held)."""
        if self.bf16_weights:
            # A model reloaded after deep sleep comes back float32.
            pack_model(self.model, int8=self.int8_weights)
        scheduler.model = self.lora.forward_module(self.model)
        scheduler.adapters_loaded = bool(self.lora)
        scheduler.decoder = LlamaDecoder.for_model(self.model, max_rows=self.args.max_num_seqs)

    def _restore_kv(self) -> None:
        scheduler = self._require_scheduler()
        device, _ = self._placement()
        with scheduler.step_lock:
            scheduler.move_kv(device)

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        if self.device is None or self.dtype is None:
            raise RuntimeError("the transformers engine is not started")
        return self.device, self.dtype

    async def _wake_up(self, body: Body) -> Body:
        tags = body.get("tags")
        if tags is None:
            wanted = set(SLEEP_TAGS)
        elif isinstance(tags, list) and all(isinstance(t, str) for t in tags):
            unknown = sorted(set(tags) - SLEEP_TAGS)
            if unknown:
                return _error(
                    f"unknown wake_up tags {unknown}; expected a subset of {sorted(SLEEP_TAGS)}"
                )
            wanted = set(tags)
        else:
            return _error("`tags` must be a list of strings")
        if not self._sleeping:
            return {"status": "awake", "message": "Engine already awake", "is_sleeping": False}
        if "weights" in wanted & self._sleeping:
            await asyncio.to_thread(self._restore_weights)
            self._sleeping.discard("weights")
        if "kv_cache" in wanted & self._sleeping:
            await asyncio.to_thread(self._restore_kv)
            self._sleeping.discard("kv_cache")
        if self._sleeping:
            return {
                "status": "partially_awake",
                "is_sleeping": True,
                "sleeping": sorted(self._sleeping),
            }
        scheduler = self._require_scheduler()
        scheduler.set_sleeping(False)
        if self._paused_by_sleep:
            scheduler.resume()
            self._paused_by_sleep = False
        return {"status": "awake", "message": "Engine woke", "is_sleeping": False}

    async def _get_weight_version(self, body: Body) -> Body:
        version = self.weight_version
        return {
            "status": "ok",
            "version": version,
            "version_declared": version is not None,
            "weight_version": version,
        }

    async def _flush_cache(self, body: Body) -> Body:
        # There is no prefix cache: KV lives only as long as its sequence. Flushing returns
        # the allocator's idle blocks to the device.
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"status": "ok", "message": "Cache flushed"}

    async def _abort_request(self, body: Body) -> Body:
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            return _error("Missing 'request_id' in body")
        found = self._require_scheduler().cancel_request_id(request_id)
        return {"status": "ok", "request_id": request_id, "found": found > 0}

    async def _update_weights_from_disk(self, body: Body) -> Body:
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            return _error("missing non-empty `model_path` string")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            return _error("`weight_version` must be a string")
        scheduler = self._require_scheduler()
        if not scheduler.paused:
            return _error(
                "update_weights_from_disk needs paused generation: "
                "call pause_generation first, then resume_generation after the update"
            )
        if self.model is None or "weights" in self._sleeping:
            return _error("the weights are asleep: call wake_up before updating them")
        source = Path(model_path)
        try:
            await asyncio.to_thread(self._load_weights, source)
        except CheckpointError as exc:
            return _error(f"weight update failed, the previous weights keep serving: {exc}")
        await self._weights_changed()
        self._weights_source = source
        if version is not None:
            self.weight_version = version
        summed = await asyncio.to_thread(checksum_control, self.model, {})
        return {
            "status": "ok",
            "checksum": summed["checksum"],
            "message": f"Weights updated from {source}",
            "version": self.weight_version,
            "version_declared": version is not None,
        }

    def _load_weights(self, source: Path) -> None:
        scheduler = self._require_scheduler()
        plan = plan_weight_update(self.model, read_safetensors(source))
        with scheduler.step_lock:
            apply_weight_update(plan)

    async def _weights_changed(self) -> None:
        # Cached image features came from the old vision tower.
        if self.vision is not None:
            self.vision.forget()
        if self.int8_weights:
            await asyncio.to_thread(self._requantize)

    def _requantize(self) -> None:
        with self._require_scheduler().step_lock:
            requantize(self.model)

    def _pushable_model(self, update: str, body: Body) -> Any:
        """The live model, if ``update`` may write into it now; else a refusal to return."""
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            return _error("`weight_version` must be a string")
        if not self._require_scheduler().paused:
            return _error(
                f"{update} needs paused generation: call pause_generation first, then "
                "resume_generation after the update"
            )
        if self.model is None or "weights" in self._sleeping:
            return _error("the weights are asleep: call wake_up before updating them")
        return self.model

    async def _push(self, update: str, body: Body, run: Callable[[Any], Body]) -> Body:
        model = self._pushable_model(update, body)
        if isinstance(model, dict):
            return model
        try:
            result = await asyncio.to_thread(run, model)
        except WeightSyncError as exc:
            return _error(f"{update} refused, the previous weights keep serving: {exc}")
        await self._weights_changed()
        version = body.get("weight_version")
        if version is not None:
            self.weight_version = version
        return {**result, "weight_version": self.weight_version}

    async def _init_weights_update_group(self, body: Body) -> Body:
        device, _ = self._placement()
        try:
            return await asyncio.to_thread(self.weight_sync.init_group, body, device)
        except WeightSyncError as exc:
            return _error(str(exc))

    async def _destroy_weights_update_group(self, body: Body) -> Body:
        try:
            return self.weight_sync.destroy_group(body)
        except WeightSyncError as exc:
            return _error(str(exc))

    async def _update_weights_from_distributed(self, body: Body) -> Body:
        device, _ = self._placement()
        lock = self._require_scheduler().step_lock
        return await self._push(
            "update_weights_from_distributed",
            body,
            lambda model: self.weight_sync.receive(model, body, device, lock),
        )

    async def _update_weights_from_tensor(self, body: Body) -> Body:
        trusted = body.get("trust_weight_payloads") is True
        lock = self._require_scheduler().step_lock
        return await self._push(
            "update_weights_from_tensor",
            body,
            lambda model: self.weight_sync.load_tensors(model, body, trusted=trusted, lock=lock),
        )

    async def _update_weights_from_nixl(self, body: Body) -> Body:
        lock = self._require_scheduler().step_lock
        return await self._push(
            "update_weights_from_nixl",
            body,
            lambda model: self.weight_sync.pull_nixl(model, body, lock=lock),
        )

    async def _weights_checksum(self, body: Body) -> Body:
        if self.model is None or "weights" in self._sleeping:
            return _error("the weights are asleep: call wake_up before checking them")
        try:
            return await asyncio.to_thread(checksum_control, self.model, body)
        except WeightSyncError as exc:
            return _error(str(exc))

    async def _get_weights_by_name(self, body: Body) -> Body:
        if self.model is None or "weights" in self._sleeping:
            return _error("the weights are asleep: call wake_up before reading them")
        try:
            return await asyncio.to_thread(weights_by_name, self.model, body)
        except WeightSyncError as exc:
            return _error(str(exc))

    async def weights_snapshot(self) -> tuple[dict[str, torch.Tensor], str | None, Path | None]:
        """A CPU copy of every tensor with the version and source: what
        :meth:`restore_weights_snapshot` puts back (a Ray fleet's rollback of an update
        another replica failed). It costs the model's size in host memory while held."""
        if self.model is None or "weights" in self._sleeping:
            raise RuntimeError("the weights are asleep: call wake_up before updating them")
        model, lock = self.model, self._require_scheduler().step_lock

        def copy() -> dict[str, torch.Tensor]:
            with lock:
                return {
                    name: tensor.detach().to("cpu", copy=True)
                    for name, tensor in model.state_dict().items()
                }

        return await asyncio.to_thread(copy), self.weight_version, self._weights_source

    async def restore_weights_snapshot(
        self, snapshot: tuple[dict[str, torch.Tensor], str | None, Path | None]
    ) -> None:
        saved, version, source = snapshot
        model, lock = self.model, self._require_scheduler().step_lock

        def put_back() -> None:
            live = model.state_dict()
            with lock, torch.no_grad():
                for name, tensor in saved.items():
                    live[name].copy_(tensor)

        await asyncio.to_thread(put_back)
        await self._weights_changed()
        self.weight_version, self._weights_source = version, source

    async def _update_weight_version(self, body: Body) -> Body:
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            return _error("missing non-empty `new_version` string")
        self.weight_version = version
        return {"status": "ok", "success": True, "new_version": version}

    async def _set_weight_version(self, body: Body) -> Body:
        version = body.get("weight_version")
        if not isinstance(version, str) or not version:
            return _error("Missing 'weight_version' in body")
        self.weight_version = version
        return {"status": "ok", "version": version}

    # -- LoRA adapters -----------------------------------------------------------------------

    async def _load_lora(self, body: Body) -> Body:
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return _error("missing non-empty `lora_name` string")
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            return _error("missing non-empty `lora_path` string")
        if name in (self.served_model_name, BASE_ROW):
            return _error(f"`lora_name` {name!r} is reserved for the base model")
        if name in self.lora:
            loaded_from = self.lora.adapters[name].path
            return _error(
                f"LoRA adapter '{name}' is already loaded from {loaded_from}; unload it first"
            )
        if self.model is None:
            return _error("the weights are asleep: call wake_up before loading a LoRA adapter")
        try:
            adapter = await asyncio.to_thread(read_adapter, name, self.lora.next_key(), Path(path))
            await asyncio.to_thread(self._attach, adapter)
        except LoraError as exc:
            return _error(f"LoRA adapter '{name}' not loaded: {exc}")
        self._retired.discard(name)
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return {
            "status": "ok",
            "message": f"LoRA adapter '{name}' loaded",
            "lora_name": name,
            "lora_path": path,
        }

    def _attach(self, adapter: LoraAdapter) -> None:
        scheduler = self._require_scheduler()
        with scheduler.step_lock:
            self.lora.attach(self.model, adapter)
            self._install_forward_module(scheduler)

    async def _unload_lora(self, body: Body) -> Body:
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return _error("missing non-empty `lora_name` string")
        if name not in self.lora or name in self._unloading:
            loaded = ", ".join(sorted(self.lora.adapters)) or "none"
            return _error(f"LoRA adapter '{name}' is not loaded (loaded: {loaded})")
        scheduler = self._require_scheduler()
        key = self.lora.adapters[name].key
        self._unloading.add(name)
        try:
            in_flight = scheduler.unfinished_with_adapter(key)
            # Requests that can't move while generation is paused or asleep would hold the
            # unload forever; cancelled ones end at the next scheduler pass regardless.
            stuck = [s for s in in_flight if not s.should_stop()]
            if stuck and (scheduler.paused or self._sleeping):
                return _error(
                    f"LoRA adapter '{name}' has {len(stuck)} request(s) in flight while "
                    "generation is paused; resume generation or abort them, then unload it"
                )
            # Requests already running with the adapter finish with it.
            await asyncio.to_thread(scheduler.wait_until_done, in_flight)
            await asyncio.to_thread(self._detach, name)
            self._retired.add(name)
        finally:
            self._unloading.discard(name)
        logger.info("LoRA adapter %r unloaded", name)
        return {"status": "ok", "message": f"LoRA adapter '{name}' unloaded", "lora_name": name}

    def _detach(self, name: str) -> None:
        scheduler = self._require_scheduler()
        with scheduler.step_lock:
            self.lora.detach(name)
            self._install_forward_module(scheduler)

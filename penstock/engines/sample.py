"""``sample``: a token engine that needs no model, for trying the gateway and testing it.

It emits a deterministic rotation of ordinary (non-special) token ids of a real tokenizer,
so the whole token pipeline (detokenization, stop strings, logprobs, usage) runs for real.

It also implements the RL admin controls in a simulated but observable way:

* **weights** are one safetensors tensor, ``token_shift`` (int64, shape ``[1]``), that
  shifts the rotation; ``update_weights_from_disk {model_path}`` loads it from a
  ``.safetensors`` file or a folder holding ``model.safetensors`` (see
  :func:`write_sample_weights`). A missing file, a missing/extra tensor or a wrong shape
  is an error and the old weights keep serving. Updates need generation paused.
* **pause** ``{mode}``: ``abort`` ends in-flight requests at once (``finish_reason``
  ``"abort"``), ``wait`` returns once they have finished, ``keep`` freezes them in place
  until resume. Requests that arrive while paused or asleep wait and run after resume.
* **sleep** ``{level, mode, tags}`` / **wake_up** ``{tags}`` hold generation like a pause
  until every released tag (``weights``, ``kv_cache``) is awake again.
* **flush_cache** empties a simulated prefix cache (one entry per distinct prompt);
  **abort_request** ends requests by ``context.id()``.
* **tensor pushes**: ``update_weights_from_tensor`` takes ``serialized_named_tensors``
  (base64 safetensors, see :mod:`penstock.engines.weight_sync`) or ``named_tensors``
  (``{"token_shift": [n]}``); it answers with the checksum of what it wrote, and
  ``weights_checksum`` / ``get_weights_by_name`` read the weights back, computed as the
  transformers engine computes them. ``update_weights_from_nixl`` (when NIXL is
  installed) READs ``token_shift`` from the trainer's registered memory for real, with
  the body of :mod:`penstock.engines.weight_sync`, and answers with the same checksum.
* **weight versions**: every chunk carries ``engine_data: {"weight_version": v}``.
* **rollback**: ``weights_snapshot()`` / ``restore_weights_snapshot(snapshot)`` put back the
  weights and version of before an update (what a Ray fleet's failed update does).
* **metrics**: while requests run it publishes one simulated forward pass (and a KV
  snapshot: 16-token blocks out of 1000) every ``max(--delay, 10 ms)``: the requests that
  got their first token are the prefills, those that advanced the decodes, those held by a
  pause the queued ones; then one idle heartbeat. Each new prompt is a cached prefix
  (a KV stored event); prefixes fill at most those 1000 blocks, the least recently used
  leaving with a removed event, and a weight update, flush or KV sleep clears them.
  ``--token-budget N`` advertises a ``TokenBudget`` of ``N`` tokens that the gateway
  enforces.
* **LoRA**: an adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``
  holding ``token_shift``) adds its shift for requests whose ``model`` names it.
* **media input**: ``--image-input`` / ``--audio-input`` advertise ``supports_image_input``
  / ``supports_audio_input``; the reply then starts with what the gateway handed over,
  ``[image WxH]`` per image and ``[audio S.SSs RATEHz]`` per clip (one token per step,
  within ``max_tokens``), before the usual rotation.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import math
import types
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Generator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from penstock.engines.context import Context
from penstock.engines.contract import (
    CANCEL_SAFE_RUNTIME_KEY,
    MULTI_CHOICE_RUNTIME_KEY,
    SUPPORTS_AUDIO_INPUT,
    SUPPORTS_IMAGE_INPUT,
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
    PushSource,
    WorkerConfig,
)
from penstock.engines.health import (
    bos_token_id_or,
    build_health_check_payload,
    is_probe,
    parse_health_check_payload_cli,
)
from penstock.engines.token_budget import TOKEN_BUDGET_RUNTIME_KEY, TokenBudget
from penstock.engines.weight_sync import (
    NixlPuller,
    WeightSyncError,
    check_against,
    combine_digests,
    parse_nixl_pull,
)
from penstock.metrics.forward_pass import (
    ComponentSnapshot,
    ForwardPassMetrics,
    WelfordAccumulator,
    forward_pass_from,
)
from penstock.nixl_agent import nixl_installed

if TYPE_CHECKING:
    import numpy as np

SAMPLE_TOKENIZER_DIR = Path(__file__).parent / "assets" / "sample-tokenizer"
MAX_TOP_LOGPROBS = 20

WEIGHTS_FILE = "model.safetensors"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
WEIGHT_SHAPES: dict[str, tuple[int, ...]] = {"token_shift": (1,)}
PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_TAGS = ("kv_cache", "weights")
ADMIN_ABORT_REASON = "abort"
KV_BLOCK_SIZE = 16
TOTAL_KV_BLOCKS = 1000
MIN_PASS_INTERVAL_S = 0.01


class PrefixCache:
    """The prompts whose blocks the engine holds, by the prompt's hash: the least recently
    used leave once they would fill more than ``total_blocks`` (as a real engine's KV
    cache is bounded, and so that distinct prompts don't grow the process)."""

    __slots__ = ("_blocks", "_held", "total_blocks")

    def __init__(self, total_blocks: int) -> None:
        self.total_blocks = total_blocks
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self._held = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    @property
    def held_blocks(self) -> int:
        return self._held

    def touch(self, key: int) -> bool:
        """Whether ``key`` is cached (a hit makes it the most recently used)."""
        if key not in self._blocks:
            return False
        self._blocks.move_to_end(key)
        return True

    def add(self, key: int, blocks: int) -> list[tuple[int, int]]:
        """Cache ``key``'s ``blocks``; returns the (key, blocks) that left for room."""
        evicted: list[tuple[int, int]] = []
        while self._blocks and self._held + blocks > self.total_blocks:
            old = self._blocks.popitem(last=False)
            self._held -= old[1]
            evicted.append(old)
        self._blocks[key] = blocks
        self._held += blocks
        return evicted

    def clear(self) -> None:
        self._blocks.clear()
        self._held = 0


@dataclass(frozen=True)
class SampleWeights:
    """The sample engine's whole "model": how far the token rotation is shifted."""

    token_shift: int = 0
    source: str | None = None


def write_sample_weights(path: Path, token_shift: int) -> Path:
    """Write a weights file the engine loads (``path`` is a file or a folder)."""
    # NumPy only when weights are written or loaded: a served sample engine idles without.
    import numpy as np
    import safetensors.numpy

    target = path / WEIGHTS_FILE if path.is_dir() else path
    safetensors.numpy.save_file({"token_shift": np.array([token_shift], dtype=np.int64)}, target)
    return target


def _check_tensors(tensors: dict[str, np.ndarray], where: str) -> int:
    missing = sorted(set(WEIGHT_SHAPES) - set(tensors))
    if missing:
        raise ValueError(f"{where}: missing tensor(s) {', '.join(missing)}")
    unexpected = sorted(set(tensors) - set(WEIGHT_SHAPES))
    if unexpected:
        raise ValueError(f"{where}: unexpected tensor(s) {', '.join(unexpected)}")
    for name, expected in WEIGHT_SHAPES.items():
        actual = tuple(tensors[name].shape)
        if actual != expected:
            raise ValueError(
                f"{where}: shape mismatch for '{name}': got {list(actual)}, "
                f"the model has {list(expected)}"
            )
        if tensors[name].dtype.kind not in "iu":
            raise ValueError(f"{where}: '{name}' must be an integer tensor")
    return int(tensors["token_shift"][0])


def load_sample_weights(path: Path, file_name: str = WEIGHTS_FILE) -> SampleWeights:
    """Read and validate weights; raises ValueError saying what is wrong."""
    file = path / file_name if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no weights at {path}: expected a .safetensors file or {file_name}")
    import safetensors.numpy

    try:
        tensors = safetensors.numpy.load_file(file)
    except Exception as exc:
        raise ValueError(f"{file} is not a readable safetensors file: {exc}") from exc
    return SampleWeights(_check_tensors(tensors, str(file)), str(file))


@types.coroutine
def _next_loop_turn() -> Generator[None, None, None]:
    """Give the event loop one turn, as ``asyncio.sleep(0)`` does, without a coroutine of
    its own: a token at ``--delay 0`` costs one call fewer."""
    yield


@dataclass(eq=False)
class _Flight:
    """One request inside ``generate``, as the admin controls see it."""

    context: Context
    prompt_tokens: int = 0
    admitted: bool = False
    abort_reason: str | None = None
    generated: int = 0
    # ``generated`` at the latest simulated forward pass.
    reported: int = 0


@dataclass
class _Hold:
    """Why generation is held (a pause or a sleep) and what happens to in-flight work."""

    mode: str
    tags: set[str] = field(default_factory=set)
    level: int | None = None


def _error(message: str) -> dict[str, Any]:
    return {"status": "error", "message": message}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="penstock serve --engine sample --",
        description="Sample token engine: rotating token ids, no model weights.",
    )
    parser.add_argument("--model", "--model-name", dest="model", default="sample-model")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--tokenizer",
        default=str(SAMPLE_TOKENIZER_DIR),
        help="folder with tokenizer.json and a chat template (default: the shipped one)",
    )
    parser.add_argument("--delay", type=float, default=0.01, help="seconds before each token")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens when none asked")
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="advertise a TokenBudget of this many tokens (prompt + completion)",
    )
    parser.add_argument("--endpoint-types", default="chat,completions")
    parser.add_argument("--health-check-payload", default=None)
    parser.add_argument(
        "--image-input",
        action="store_true",
        help="accept image parts and start each reply with the size of every image",
    )
    parser.add_argument(
        "--audio-input",
        action="store_true",
        help="accept audio parts and start each reply with the length of every clip",
    )
    return parser


class SampleLLMEngine(LLMEngine):
    """Emits ``max_tokens`` tokens per choice, ``delay`` seconds apart."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer_dir: Path,
        delay: float = 0.01,
        max_tokens: int = 16,
        context_length: int = 2048,
        token_budget: int | None = None,
        image_input: bool = False,
        audio_input: bool = False,
    ) -> None:
        if delay < 0:
            raise ValueError("--delay must be >= 0")
        if max_tokens < 1:
            raise ValueError("--max-tokens must be >= 1")
        self.model = model
        self.tokenizer_dir = tokenizer_dir
        self.delay = delay
        self.max_tokens = max_tokens
        self.context_length = context_length
        self.token_budget = (
            TokenBudget(token_budget, True, True) if token_budget is not None else None
        )
        self.image_input = image_input
        self.audio_input = audio_input
        self.tokenizer: Tokenizer | None = None
        self.vocab_size = 0
        self.ordinary_ids: list[int] = []
        self.bos_token_id = 1
        self.started = False
        self.aborted: list[str] = []
        self.weights = SampleWeights()
        self._engine_data: dict[str, Any] = {"weight_version": None}
        self.adapters: dict[str, SampleWeights] = {}
        self.prefix_cache = PrefixCache(TOTAL_KV_BLOCKS)
        self._holds: dict[str, _Hold] = {}
        self._flights: set[_Flight] = set()
        self._changed = asyncio.Event()
        self._publisher: Any = None
        self._kv_events: Any = None
        self._passes: asyncio.Task[None] | None = None
        self._active = asyncio.Event()
        self._pass_counter = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._puller: NixlPuller | None = None

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[SampleLLMEngine, WorkerConfig]:
        args = _parser().parse_args(argv)
        tokenizer_dir = Path(args.tokenizer)
        if not (tokenizer_dir / "tokenizer.json").is_file():
            _parser().error(f"--tokenizer {tokenizer_dir}: no tokenizer.json there")
        engine = cls(
            args.model,
            tokenizer_dir=tokenizer_dir,
            delay=args.delay,
            max_tokens=args.max_tokens,
            context_length=args.context_length,
            token_budget=args.token_budget,
            image_input=args.image_input,
            audio_input=args.audio_input,
        )
        config = WorkerConfig(
            namespace="penstock",
            component="sample",
            model_name=str(tokenizer_dir),
            served_model_name=args.served_model_name or args.model,
            endpoint_types=args.endpoint_types,
            health_check_payload=parse_health_check_payload_cli(args.health_check_payload),
        )
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        tokenizer = Tokenizer.from_file(str(self.tokenizer_dir / "tokenizer.json"))
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        # Only ids that decode to whole characters on their own, so every emitted token is
        # visible text (raw byte tokens of a byte-level BPE are UTF-8 fragments).
        self.ordinary_ids = [
            i
            for i in range(self.vocab_size)
            if i not in special_ids and "\ufffd" not in (text := tokenizer.decode([i])) and text
        ]
        self.bos_token_id = bos_token_id_or(tokenizer, default=min(special_ids, default=0))
        self.started = True
        self._passes = asyncio.get_running_loop().create_task(
            self._report_passes(), name="sample-forward-passes"
        )
        return EngineConfig(
            model=self.model,
            served_model_name=self.model,
            runtime_data={
                MULTI_CHOICE_RUNTIME_KEY: True,
                # generate ends cleanly when cancelled at an await or closed at a yield.
                CANCEL_SAFE_RUNTIME_KEY: True,
                SUPPORTS_IMAGE_INPUT: self.image_input,
                SUPPORTS_AUDIO_INPUT: self.audio_input,
                **(
                    {TOKEN_BUDGET_RUNTIME_KEY: self.token_budget.as_runtime_data()}
                    if self.token_budget is not None
                    else {}
                ),
            },
            llm=LlmRegistration(
                context_length=self.context_length,
                kv_cache_block_size=KV_BLOCK_SIZE,
                total_kv_blocks=TOTAL_KV_BLOCKS,
                max_num_seqs=64,
                max_num_batched_tokens=self.context_length,
            ),
        )

    def token_at(self, step: int, choice: int, shift: int = 0) -> int:
        return self.ordinary_ids[(step + choice + shift) % len(self.ordinary_ids)]

    def _media_report(self, request: GenerateRequest) -> list[int]:
        """The token ids of ``[image WxH]`` / ``[audio S.SSs RATEHz]`` per media item."""
        data = request.get("multi_modal_data") or {}
        if not data or self.tokenizer is None:
            return []
        words = []
        for item in data.get("image_url", []):
            width, height = item["Decoded"].size
            words.append(f"[image {width}x{height}]")
        for item in data.get("audio_url", []):
            waveform, rate = item["Decoded"]
            words.append(f"[audio {len(waveform) / rate:.2f}s {rate:g}Hz]")
        ids: list[int] = self.tokenizer.encode(" ".join(words), add_special_tokens=False).ids
        return ids

    @property
    def weight_version(self) -> str | None:
        return self._engine_data["weight_version"]

    @weight_version.setter
    def weight_version(self, version: str | None) -> None:
        # One dict per version, shared by every chunk stamped with it (chunks are read, not
        # changed, downstream): a chunk costs no dict of its own.
        self._engine_data = {"weight_version": version}

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        prompt = request.get("token_ids") or []
        prompt_len = len(prompt)
        stop = request.get("stop_conditions") or {}
        sampling = request.get("sampling_options") or {}
        output = request.get("output_options") or {}
        max_new = stop.get("max_tokens") or self.max_tokens
        n = sampling.get("n") or 1
        logprobs = output.get("logprobs")
        top_k = min(int(logprobs), MAX_TOP_LOGPROBS) if logprobs is not None else None
        lead = self._media_report(request)
        # Canaries probe that the engine runs; a pause must not make it look dead.
        held = not is_probe(request)
        flight = _Flight(context, prompt_len)
        if held:
            self._flights.add(flight)
            self._active.set()
            key = hash(tuple(prompt))
            self._prefix_queries += 1
            if self.prefix_cache.touch(key):
                self._prefix_hits += 1
            else:
                blocks = max(1, prompt_len // KV_BLOCK_SIZE)
                self._publish_stored(key, blocks)
                for old_key, old_blocks in self.prefix_cache.add(key, blocks):
                    self._publish_removed(old_key, old_blocks)
        try:
            if held:
                await self._hold_while_blocked(flight)
            flight.admitted = True
            token_at = self.token_at
            # An adapter is the request's for its whole run; the base weights may change
            # under it (a weight update between two tokens shows from the next one).
            adapter = self.adapters.get(request.get("model") or "")
            adapter_shift = adapter.token_shift if adapter else 0
            for step in range(max_new):
                if self.delay:
                    await asyncio.sleep(self.delay)
                else:
                    await _next_loop_turn()
                # Checked here first: a call per token costs more than the test.
                if held and self._holds:
                    await self._hold_while_blocked(flight)
                if flight.abort_reason is not None or context.is_stopped():
                    reason = flight.abort_reason or "cancelled"
                    for choice in range(n):
                        yield self._terminal(choice, [], reason, prompt_len, step)
                    return
                flight.generated += 1
                shift = self.weights.token_shift + adapter_shift
                for choice in range(n):
                    token = lead[step] if step < len(lead) else token_at(step, choice, shift)
                    chunk: GenerateChunk = {
                        "token_ids": [token],
                        "index": choice,
                        "engine_data": self._engine_data,
                    }
                    if top_k is not None:
                        self._add_logprobs(chunk, token, top_k)
                    if step == max_new - 1:
                        chunk["finish_reason"] = "length"
                        chunk["completion_usage"] = _usage(prompt_len, max_new)
                    yield chunk
        finally:
            if held:
                self._flights.discard(flight)
                self._notify()

    # -- metrics -------------------------------------------------------------------------

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        self._publisher = publisher

    async def kv_event_sources(self) -> list[Any]:
        return [PushSource(on_ready=self._kv_ready, dp_rank=0)]

    def _kv_ready(self, publisher: Any) -> None:
        self._kv_events = publisher

    def _publish_stored(self, key: int, blocks: int) -> None:
        """A new prompt prefix is cached: one stored event for its whole blocks."""
        if self._kv_events is None:
            return
        self._kv_events.publish_stored(
            token_ids=[],
            num_block_tokens=[KV_BLOCK_SIZE] * blocks,
            block_hashes=[hash((key, i)) for i in range(blocks)],
        )

    def _publish_removed(self, key: int, blocks: int) -> None:
        """A prompt prefix left the cache: one removed event for its blocks."""
        if self._kv_events is not None:
            self._kv_events.publish_removed([hash((key, i)) for i in range(blocks)])

    def _publish_cleared(self) -> None:
        if self._kv_events is not None:
            self._kv_events.clear_all()

    async def _report_passes(self) -> None:
        """One simulated forward pass per interval while requests run, then a heartbeat."""
        loop = asyncio.get_running_loop()
        interval = max(self.delay, MIN_PASS_INTERVAL_S)
        was_active = False
        while True:
            if not self._flights:
                if was_active:
                    self._publish_pass(0.0)
                    was_active = False
                self._active.clear()
                await self._active.wait()
            was_active = True
            started = loop.time()
            await asyncio.sleep(interval)
            self._publish_pass(loop.time() - started)

    def _publish_pass(self, wall_time: float) -> None:
        """Publish what ran since the previous pass; ``wall_time`` 0 is the heartbeat."""
        publisher = self._publisher
        if publisher is None:
            return
        prefill, decode, waiting = WelfordAccumulator(), WelfordAccumulator(), WelfordAccumulator()
        preempted, used_blocks = 0, 0
        for flight in self._flights:
            if not flight.admitted:
                waiting.add(flight.prompt_tokens)
                continue
            kv_tokens = flight.prompt_tokens + flight.generated
            used_blocks += math.ceil(kv_tokens / KV_BLOCK_SIZE)
            if flight.generated == flight.reported:
                preempted += flight.generated > 0
            elif flight.reported == 0:
                prefill.add(flight.prompt_tokens)
            else:
                decode.add(kv_tokens)
            flight.reported = flight.generated
        self._pass_counter += 1
        if wall_time == 0.0:
            metrics = ForwardPassMetrics(worker_id="sample", counter_id=self._pass_counter)
        else:
            metrics = forward_pass_from(
                "sample", self._pass_counter, wall_time, prefill, decode, waiting, preempted
            )
        publish_forward_pass = getattr(publisher, "publish_forward_pass", None)
        if publish_forward_pass is not None:
            publish_forward_pass(metrics)
        publisher.publish(
            0,
            ComponentSnapshot(
                kv_used_blocks=used_blocks,
                kv_total_blocks=TOTAL_KV_BLOCKS,
                gpu_cache_usage=used_blocks / TOTAL_KV_BLOCKS,
                dp_rank=0,
                kv_cache_hit_rate=(
                    self._prefix_hits / self._prefix_queries if self._prefix_queries else None
                ),
            ),
        )

    # -- admin controls ----------------------------------------------------------------

    def _notify(self) -> None:
        """Wake everything waiting on the hold state or the set of in-flight requests."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _blocked(self, flight: _Flight) -> bool:
        if not self._holds:
            return False
        if not flight.admitted:
            return True
        return any(hold.mode == "keep" for hold in self._holds.values())

    async def _hold_while_blocked(self, flight: _Flight) -> None:
        while (
            self._blocked(flight)
            and flight.abort_reason is None
            and not flight.context.is_stopped()
        ):
            changed = asyncio.ensure_future(self._changed.wait())
            stopped = asyncio.ensure_future(flight.context.async_killed_or_stopped())
            try:
                await asyncio.wait({changed, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                stopped.cancel()

    async def _wait_until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    def _abort_where(self, matches: Callable[[_Flight], bool]) -> list[str]:
        aborted = []
        for flight in self._flights:
            if flight.abort_reason is None and matches(flight):
                flight.abort_reason = ADMIN_ABORT_REASON
                aborted.append(flight.context.id())
        self._notify()
        return sorted(aborted)

    async def _apply_hold(self, key: str, hold: _Hold) -> list[str]:
        """Hold new requests; abort, drain or freeze the in-flight ones per ``hold.mode``."""
        self._holds[key] = hold
        aborted = self._abort_where(lambda f: f.admitted) if hold.mode == "abort" else []
        self._notify()
        if hold.mode == "wait":
            await self._wait_until(lambda: not any(f.admitted for f in self._flights))
        return aborted

    def supported_controls(self) -> set[str]:
        return set(self._controls())

    def supported_updates(self) -> set[str]:
        return set(self._updates())

    def _controls(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        return {
            "pause_generation": self._pause,
            "resume_generation": self._resume,
            "is_paused": self._is_paused,
            "sleep": self._sleep,
            "wake_up": self._wake_up,
            "is_sleeping": self._is_sleeping,
            "flush_cache": self._flush_cache,
            "abort_request": self._abort_request,
            "get_weight_version": self._get_weight_version,
            "weights_checksum": self._weights_checksum,
            "get_weights_by_name": self._get_weights_by_name,
        }

    def _updates(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        updates: dict[str, Callable[[dict[str, Any]], Any]] = {
            "update_weights_from_disk": self._update_from_disk,
            "update_weights_from_tensor": self._update_from_tensor,
            "update_weight_version": self._update_weight_version,
            "load_lora": self._load_lora,
            "unload_lora": self._unload_lora,
        }
        if nixl_installed():
            updates["update_weights_from_nixl"] = self._update_from_nixl
        return updates

    async def engine_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        handler = self._controls().get(control)
        if handler is None:
            return await super().engine_control(control, body)
        return await _run_handler(handler, body)

    async def engine_update(self, update: str, body: dict[str, Any]) -> dict[str, Any]:
        handler = self._updates().get(update)
        if handler is None:
            return await super().engine_update(update, body)
        return await _run_handler(handler, body)

    async def _pause(self, body: dict[str, Any]) -> dict[str, Any]:
        mode = _mode(body, "pause_generation")
        clear_cache = _bool(body, "clear_cache", False)
        aborted = await self._apply_hold("pause", _Hold(mode))
        if clear_cache:
            self.prefix_cache.clear()
            self._publish_cleared()
        return {"status": "paused", "mode": mode, "aborted": aborted}

    async def _resume(self, body: dict[str, Any]) -> dict[str, Any]:
        self._holds.pop("pause", None)
        self._notify()
        response: dict[str, Any] = {"status": "resumed"}
        if "sleep" in self._holds:
            response["is_sleeping"] = True
        return response

    async def _is_paused(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"is_paused": "pause" in self._holds}

    async def _sleep(self, body: dict[str, Any]) -> dict[str, Any]:
        level = body.get("level", 1)
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 2:
            raise _BadBody("`level` must be 0, 1 or 2")
        mode = _mode(body, "sleep")
        default_tags = ("kv_cache",) if level == 0 else SLEEP_TAGS
        tags = _tags(body, default_tags)
        current = self._holds.get("sleep")
        if current is not None:
            current.tags |= tags
            aborted: list[str] = []
        else:
            aborted = await self._apply_hold("sleep", _Hold(mode, set(tags), level))
        if "kv_cache" in tags:
            self.prefix_cache.clear()
            self._publish_cleared()
        hold = self._holds["sleep"]
        return {
            "status": "sleeping",
            "level": hold.level,
            "tags": sorted(hold.tags),
            "aborted": aborted,
        }

    async def _wake_up(self, body: dict[str, Any]) -> dict[str, Any]:
        tags = _tags(body, SLEEP_TAGS)
        hold = self._holds.get("sleep")
        if hold is None:
            return {"status": "awake"}
        hold.tags -= tags
        if hold.tags:
            return {"status": "partially_awake", "is_sleeping": True, "tags": sorted(hold.tags)}
        del self._holds["sleep"]
        self._notify()
        return {"status": "awake"}

    async def _is_sleeping(self, body: dict[str, Any]) -> dict[str, Any]:
        hold = self._holds.get("sleep")
        return {"is_sleeping": hold is not None, "tags": sorted(hold.tags) if hold else []}

    async def _flush_cache(self, body: dict[str, Any]) -> dict[str, Any]:
        flushed = len(self.prefix_cache)
        self.prefix_cache.clear()
        self._publish_cleared()
        return {"status": "ok", "flushed_entries": flushed}

    async def _abort_request(self, body: dict[str, Any]) -> dict[str, Any]:
        if _bool(body, "abort_all", False):
            return {"status": "ok", "aborted": self._abort_where(lambda f: True)}
        ids = body.get("request_ids")
        if ids is None and body.get("request_id") is not None:
            ids = [body["request_id"]]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            raise _BadBody("Missing 'request_id' in body (a string; or 'request_ids', a list)")
        wanted = set(ids)
        return {"status": "ok", "aborted": self._abort_where(lambda f: f.context.id() in wanted)}

    async def _get_weight_version(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"weight_version": self.weight_version}

    def _require_held_for_update(self) -> None:
        if "pause" not in self._holds and "sleep" not in self._holds:
            raise _BadBody("pause generation before updating weights (pause_generation)")
        sleep = self._holds.get("sleep")
        if sleep is not None and "weights" in sleep.tags:
            raise _BadBody("the weights are asleep: wake_up with tags ['weights'] first")

    def _install(self, weights: SampleWeights, version: str | None) -> None:
        self.weights = weights
        if version is not None:
            self.weight_version = version
        # Cached prefixes were computed by the old weights.
        self.prefix_cache.clear()
        self._publish_cleared()

    async def _update_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        self._require_held_for_update()
        model_path = _nonempty_str(body, "model_path")
        version = _optional_str(body, "weight_version")
        try:
            weights = await asyncio.to_thread(load_sample_weights, Path(model_path))
        except ValueError as exc:
            raise _BadBody(str(exc)) from exc
        self._install(weights, version)
        return {
            "status": "ok",
            "model_path": model_path,
            "weight_version": self.weight_version,
            "checksum": self._checksum()[0],
        }

    async def _update_from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        self._require_held_for_update()
        version = _optional_str(body, "weight_version")
        import numpy as np

        if "serialized_named_tensors" in body:
            tensors = _decode_serialized(body["serialized_named_tensors"])
        else:
            named = body.get("named_tensors")
            if not isinstance(named, dict):
                raise _BadBody("`named_tensors` must be an object of name -> nested list")
            try:
                tensors = {name: np.asarray(value) for name, value in named.items()}
            except (TypeError, ValueError) as exc:
                raise _BadBody(
                    f"`named_tensors` holds a value that is not a tensor: {exc}"
                ) from exc
        shift = _check_tensors(tensors, "named_tensors")
        self._install(SampleWeights(shift, "tensor"), version)
        return {
            "status": "ok",
            "weight_version": self.weight_version,
            "checksum": self._checksum()[0],
        }

    async def _update_from_nixl(self, body: dict[str, Any]) -> dict[str, Any]:
        self._require_held_for_update()
        version = _optional_str(body, "weight_version")
        try:
            shift = await asyncio.to_thread(self._pull_shift, body)
        except WeightSyncError as exc:
            raise _BadBody(str(exc)) from exc
        self._install(SampleWeights(shift, "nixl"), version)
        return {
            "status": "ok",
            "weight_version": self.weight_version,
            "checksum": self._checksum()[0],
        }

    def _pull_shift(self, body: dict[str, Any]) -> int:
        import torch

        pull = parse_nixl_pull(body)
        live = {"token_shift": torch.tensor([self.weights.token_shift], dtype=torch.int64)}
        check_against(pull.specs, live)
        if {spec.name for spec in pull.specs} != set(WEIGHT_SHAPES):
            raise WeightSyncError("the sample model's one tensor is token_shift: send it")
        if self._puller is None:
            self._puller = NixlPuller()
        landed = torch.zeros(1, dtype=torch.int64)
        self._puller.read(pull, [0], [landed], last=True)
        return int(landed[0])

    def _checksum(self) -> tuple[str, dict[str, str]]:
        import numpy as np

        raw = np.array([self.weights.token_shift], dtype=np.int64).tobytes()
        digest = hashlib.sha256(raw).hexdigest()
        return combine_digests([("token_shift", "int64", (1,), digest)]), {"token_shift": digest}

    async def _weights_checksum(self, body: dict[str, Any]) -> dict[str, Any]:
        checksum, digests = self._checksum()
        return {"status": "ok", "checksum": checksum, "tensors": digests}

    async def _get_weights_by_name(self, body: dict[str, Any]) -> dict[str, Any]:
        name = _nonempty_str(body, "name")
        if name != "token_shift":
            raise _BadBody(f"'name': {name} is not a tensor of this model")
        return {
            "status": "ok",
            "name": name,
            "dtype": "int64",
            "shape": [1],
            "values": [self.weights.token_shift],
        }

    async def weights_snapshot(self) -> tuple[SampleWeights, str | None]:
        """What :meth:`restore_weights_snapshot` puts back: a fleet's rollback."""
        return self.weights, self.weight_version

    async def restore_weights_snapshot(self, snapshot: tuple[SampleWeights, str | None]) -> None:
        weights, version = snapshot
        self._install(weights, None)
        self.weight_version = version

    async def _update_weight_version(self, body: dict[str, Any]) -> dict[str, Any]:
        self.weight_version = _nonempty_str(body, "new_version")
        return {"success": True, "new_version": self.weight_version}

    async def _load_lora(self, body: dict[str, Any]) -> dict[str, Any]:
        name = _nonempty_str(body, "lora_name")
        folder = Path(_nonempty_str(body, "lora_path"))
        if not (folder / ADAPTER_CONFIG_FILE).is_file():
            raise _BadBody(f"{folder} has no {ADAPTER_CONFIG_FILE}")
        try:
            weights = await asyncio.to_thread(load_sample_weights, folder, ADAPTER_WEIGHTS_FILE)
        except ValueError as exc:
            raise _BadBody(str(exc)) from exc
        self.adapters[name] = weights
        return {"status": "ok", "lora_name": name}

    async def _unload_lora(self, body: dict[str, Any]) -> dict[str, Any]:
        name = _nonempty_str(body, "lora_name")
        if self.adapters.pop(name, None) is None:
            raise _BadBody(f"LoRA adapter '{name}' is not loaded")
        return {"status": "ok", "lora_name": name}

    def _add_logprobs(self, chunk: GenerateChunk, token: int, top_k: int) -> None:
        selected = -0.1 * (token % 10)
        chunk["log_probs"] = [selected]
        if top_k:
            alternatives = [{"rank": 1, "token_id": token, "logprob": selected}]
            for rank in range(2, top_k + 1):
                alternatives.append(
                    {
                        "rank": rank,
                        "token_id": (token + rank) % self.vocab_size,
                        "logprob": selected - 0.1 * rank,
                    }
                )
            chunk["top_logprobs"] = [alternatives]

    @staticmethod
    def _terminal(
        index: int, tokens: list[int], reason: str, prompt_len: int, produced: int
    ) -> GenerateChunk:
        return {
            "token_ids": tokens,
            "index": index,
            "finish_reason": reason,
            "completion_usage": _usage(prompt_len, produced),
        }

    async def abort(self, context: Context) -> None:
        self.aborted.append(context.id())

    async def health_check_payload(self) -> dict[str, Any] | None:
        return build_health_check_payload(self.bos_token_id)

    async def cleanup(self) -> None:
        self.started = False
        puller, self._puller = self._puller, None
        if puller is not None:
            puller.close()
        passes, self._passes = self._passes, None
        if passes is not None:
            passes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await passes


def _decode_serialized(payloads: Any) -> dict[str, np.ndarray]:
    if not isinstance(payloads, list) or len(payloads) != 1 or not isinstance(payloads[0], str):
        raise _BadBody("`serialized_named_tensors` must be a list of one base64 string")
    import safetensors.numpy

    try:
        return dict(safetensors.numpy.load(base64.b64decode(payloads[0], validate=True)))
    except Exception as exc:
        raise _BadBody(f"`serialized_named_tensors` is not base64 safetensors: {exc}") from exc


class _BadBody(ValueError):
    """A control or update body the engine refuses; the message goes back to the caller."""


async def _run_handler(
    handler: Callable[[dict[str, Any]], Any], body: dict[str, Any]
) -> dict[str, Any]:
    try:
        return await handler(body)
    except _BadBody as exc:
        return _error(str(exc))


def _mode(body: dict[str, Any], operation: str) -> str:
    mode = body.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise _BadBody(f"{operation} mode must be abort, wait, or keep; got `{mode}`")
    return mode


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise _BadBody(f"`{name}` must be a boolean")
    return value


def _nonempty_str(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise _BadBody(f"missing non-empty `{name}` string")
    return value


def _optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise _BadBody(f"`{name}` must be a non-empty string")
    return value


def _tags(body: dict[str, Any], default: Iterable[str]) -> set[str]:
    tags = body.get("tags")
    if tags is None:
        return set(default)
    if not isinstance(tags, list) or not all(t in SLEEP_TAGS for t in tags):
        raise _BadBody(f"`tags` must be a list of {', '.join(SLEEP_TAGS)}")
    return set(tags)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }

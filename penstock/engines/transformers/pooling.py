"""The ``transformers-pooling`` engine: embeddings and sequence scores from local checkpoints.

``penstock serve --engine transformers-pooling -- --model DIR`` serves an encoder (BERT-like)
or decoder checkpoint as an embedding model (``AutoModel``, pooled as
:mod:`~penstock.engines.transformers.pooling_config` decides, then L2-normalised), or a
``*ForSequenceClassification`` checkpoint (a reward model) for scoring, per the contract of
:mod:`penstock.engines.pooling`.

Forward passes of at most ``--max-batch-tokens`` padded tokens run one at a time on a
worker thread, so the event loop keeps serving while the model computes. The requests
waiting take turns: each pass starts with the next inputs (shortest first) of the request
whose turn it is and fills up with those of the others, so a small request waits for one
pass of a large batch, not for all of them, and small requests still share passes. A
request whose client left (its context stopped, or its caller gone) runs no further pass.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

from penstock.engines.builtin_options import TRANSFORMERS_POOLING
from penstock.engines.context import Context
from penstock.engines.contract import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from penstock.engines.engine_options import engine_parser
from penstock.engines.pooling import POOLING_RUNTIME_KEY, PoolingCapabilities, PoolingChunk
from penstock.engines.transformers.args import context_length
from penstock.engines.transformers.pooling_config import Pooling, choose_pooling
from penstock.engines.transformers.weights.checkpoint import (
    CheckpointError,
    check_checkpoint_folder,
)
from penstock.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PoolingArgs:
    model: Path
    served_model_name: str | None
    task: str
    pooling: str
    device: str
    dtype: str
    max_model_len: int | None
    max_batch_tokens: int
    cpu_threads: int | None


def parse_pooling_args(argv: list[str]) -> PoolingArgs:
    """Parse ``argv``; bad options print usage and raise ``SystemExit(2)``."""
    parser = engine_parser(TRANSFORMERS_POOLING)
    options = vars(parser.parse_args(argv))
    return PoolingArgs(**{**options, "model": options["model"].expanduser()})


def _checkpoint_config(folder: Path) -> Any:
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read the config of {folder}: {exc}") from exc


def _device(asked: str) -> torch.device:
    if asked == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if asked == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(asked)


def _dtype(asked: str, device: torch.device, config: Any) -> torch.dtype:
    if asked != "auto":
        return _DTYPES[asked]
    if device.type == "cpu":
        return torch.float32
    stored = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
    return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16


def _task_of(asked: str, config: Any) -> str:
    if asked != "auto":
        return asked
    architectures = getattr(config, "architectures", None) or []
    classifies = any(name.endswith("ForSequenceClassification") for name in architectures)
    return "classify" if classifies else "embed"


def pool(
    hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, how: Pooling
) -> torch.Tensor:
    """One vector per row of right-padded ``hidden`` (``[rows, tokens, width]``)."""
    if how == "cls":
        return hidden[:, 0]
    if how == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    keep = mask.unsqueeze(-1).to(hidden.dtype)
    if how == "mean":
        return (hidden * keep).sum(dim=1) / keep.sum(dim=1)
    return hidden.masked_fill(keep == 0, float("-inf")).amax(dim=1)


@dataclass
class _Waiting:
    """One request's inputs, the future its vectors arrive on, and its inputs not run
    yet (shortest first)."""

    inputs: list[list[int]]
    vectors: asyncio.Future[list[list[float]]]
    context: Context
    rows: list[list[float]] = field(default_factory=list)
    left: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rows = [[] for _ in self.inputs]
        self.left = sorted(range(len(self.inputs)), key=lambda i: len(self.inputs[i]))

    @property
    def abandoned(self) -> bool:
        return self.vectors.done() or self.context.is_stopped()


def next_pass(waiting: list[_Waiting], max_tokens: int) -> list[tuple[_Waiting, int]]:
    """The inputs of the next pass: the first request's next ones, then the others', in
    turn, within ``max_tokens`` padded tokens (one input longer than that runs alone)."""
    picked: list[tuple[_Waiting, int]] = []
    longest = 0
    for request in waiting:
        while request.left:
            length = len(request.inputs[request.left[0]])
            if picked and max(longest, length) * (len(picked) + 1) > max_tokens:
                break
            picked.append((request, request.left.pop(0)))
            longest = max(longest, length)
    return picked


class TransformersPoolingEngine(LLMEngine):
    """Embeddings (``embed``) or class logits (``classify``) of whole inputs, batched."""

    def __init__(self, args: PoolingArgs, model_path: Path, served_model_name: str) -> None:
        self.args = args
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.model: Any = None
        self.device = torch.device("cpu")
        self.task = args.task
        self.pooling: Pooling = "cls"
        self.context_length = 0
        self.vocab_size = 0
        self.pad_token_id: int | None = None
        # Requests with inputs to run, in turn, and the task running their passes: one
        # pass at a time, since concurrent passes would only contend for the same cores.
        self._waiting: list[_Waiting] = []
        self._runner: asyncio.Task[None] | None = None

    @classmethod
    async def from_args(
        cls, argv: list[str] | None = None
    ) -> tuple[TransformersPoolingEngine, WorkerConfig]:
        args = parse_pooling_args(sys.argv[1:] if argv is None else list(argv))
        model_path = check_checkpoint_folder(args.model)
        served = args.served_model_name or str(args.model)
        worker = WorkerConfig(
            namespace="penstock",
            component="backend",
            model_name=str(model_path),
            served_model_name=served,
            endpoint_types="embeddings",
        )
        return cls(args, model_path, served), worker

    async def start(self, worker_id: int) -> EngineConfig:
        config = _checkpoint_config(self.model_path)
        self.task = _task_of(self.args.task, config)
        if self.task == "embed":
            self.pooling = choose_pooling(self.model_path, config, self.args.pooling)
        self.device = _device(self.args.device)
        if self.args.cpu_threads is not None:
            torch.set_num_threads(self.args.cpu_threads)
        self.model = await asyncio.to_thread(
            self._load, _dtype(self.args.dtype, self.device, config)
        )
        self.context_length = context_length(
            self.args.max_model_len, getattr(self.model.config, "max_position_embeddings", None)
        )
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.pad_token_id = getattr(self.model.config, "pad_token_id", None)
        logger.info(
            "transformers pooling engine ready: %s on %s, task %s%s, context %d",
            self.model_path,
            self.device,
            self.task,
            f", {self.pooling} pooling" if self.task == "embed" else "",
            self.context_length,
        )
        return EngineConfig(
            model=str(self.model_path),
            served_model_name=self.served_model_name,
            runtime_data={POOLING_RUNTIME_KEY: self._capabilities().advertise()},
            llm=LlmRegistration(context_length=self.context_length),
        )

    def _load(self, dtype: torch.dtype) -> Any:
        loader = AutoModel if self.task == "embed" else AutoModelForSequenceClassification
        try:
            model = loader.from_pretrained(self.model_path, dtype=dtype, local_files_only=True)
        except Exception as exc:
            raise CheckpointError(f"cannot load {self.model_path} for {self.task}: {exc}") from exc
        return model.to(self.device).eval()

    def _capabilities(self) -> PoolingCapabilities:
        config = self.model.config
        if self.task == "embed":
            return PoolingCapabilities(
                tasks=frozenset({"embed"}), dimensions=int(config.hidden_size)
            )
        labels = getattr(config, "id2label", None) or {}
        count = int(config.num_labels)
        return PoolingCapabilities(
            tasks=frozenset({"classify"}),
            dimensions=count,
            labels=tuple(str(labels.get(i, f"LABEL_{i}")) for i in range(count)),
        )

    async def generate(
        self, request: dict[str, Any], context: Context
    ) -> AsyncGenerator[PoolingChunk, None]:
        inputs = self._checked_inputs(request)
        loop = asyncio.get_running_loop()
        waiting = _Waiting(inputs, loop.create_future(), context)
        self._waiting.append(waiting)
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run_waiting())
        vectors = await waiting.vectors
        if context.is_stopped():
            yield {"token_ids": [], "index": 0, "finish_reason": "cancelled"}
            return
        yield {
            "token_ids": [],
            "index": 0,
            "finish_reason": "stop",
            "embeddings": vectors,
            "prompt_tokens": sum(len(ids) for ids in inputs),
        }

    async def _run_waiting(self) -> None:
        """One pass at a time while requests wait, each starting with the next request's
        inputs in turn; a request whose client left is dropped before the next pass."""
        while self._waiting:
            for request in self._waiting:
                if request.abandoned and not request.vectors.done():
                    request.vectors.set_result([])
            self._waiting = [request for request in self._waiting if not request.abandoned]
            if not self._waiting:
                return
            picked = next_pass(self._waiting, self._batch_tokens())
            # The request whose turn it was goes last: the next pass starts with another's.
            self._waiting.append(self._waiting.pop(0))
            try:
                rows = await asyncio.to_thread(self._forward, [r.inputs[i] for r, i in picked])
            except Exception as exc:
                for request, _ in picked:
                    if not request.vectors.done():
                        request.vectors.set_exception(exc)
                continue
            for (request, index), row in zip(picked, rows, strict=True):
                request.rows[index] = row
            for request in {id(request): request for request, _ in picked}.values():
                if not request.left and not request.vectors.done():
                    request.vectors.set_result(request.rows)

    def _batch_tokens(self) -> int:
        # Without a pad token a classifier cannot find each row's last token in a padded
        # batch (transformers refuses), so its inputs run one per pass.
        if self.task == "classify" and self.pad_token_id is None:
            return 1
        return self.args.max_batch_tokens

    def _checked_inputs(self, request: dict[str, Any]) -> list[list[int]]:
        task = request.get("pooling_task", self.task)
        if task != self.task:
            raise InvalidRequestError(
                f"this model serves the {self.task} task, not {task}", param="model"
            )
        inputs = request.get("token_ids")
        if not isinstance(inputs, list) or not inputs:
            raise InvalidRequestError("token_ids must be a non-empty list of inputs", param="input")
        for number, ids in enumerate(inputs):
            if not isinstance(ids, list) or not ids or len(ids) > self.context_length:
                raise InvalidRequestError(
                    f"input {number} must hold 1 to {self.context_length} token ids",
                    param="input",
                )
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(
                    f"input {number} has a token id outside the vocabulary "
                    f"(size {self.vocab_size})",
                    param="input",
                )
        return inputs

    @torch.inference_mode()
    def _forward(self, inputs: list[list[int]]) -> list[list[float]]:
        """Pooled, normalised vectors (``embed``) or class logits (``classify``) of one pass."""
        width = max(len(ids) for ids in inputs)
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        ids = torch.full((len(inputs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(inputs), width), dtype=torch.long)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        output = self.model(input_ids=ids, attention_mask=mask)
        if self.task == "classify":
            return output.logits.float().cpu().tolist()
        lengths = mask.sum(dim=1)
        vectors = pool(output.last_hidden_state, mask, lengths, self.pooling).float()
        return torch.nn.functional.normalize(vectors, p=2, dim=-1).cpu().tolist()

    async def cleanup(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
        self.model = None

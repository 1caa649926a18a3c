"""The state of one request in the batch scheduler: a :class:`Submission` (one
``generate`` call, ``n`` choices) and its :class:`Sequence` s (one choice each, one row of
the decode batch).

The scheduler (:mod:`.scheduler`) admits and retires submissions; the model runner
(:mod:`.model_runner`) reads and advances their sequences' KV lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from penstock.engines.context import Context
from penstock.engines.transformers.core.block_manager import BLOCK_SIZE, Block
from penstock.engines.transformers.core.prompt_logprobs import PromptLogprobs
from penstock.engines.transformers.core.sampling import (
    PenaltyState,
    RowSampling,
    SamplingParams,
    TokenChoice,
)
from penstock.engines.transformers.features.constraints import SequenceConstraint

Deliver = Callable[[list[Any]], None]


@dataclass(eq=False)
class Submission:
    """One ``generate`` call: a prompt and ``n`` choices decoded as separate sequences."""

    request_id: str
    context: Context
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Deliver
    # peft's name of the LoRA adapter the request runs with; None runs the base model.
    adapter: str | None = None
    # vLLM's ``cache_salt``: only requests with the same salt share cached KV blocks.
    cache_salt: str | None = None
    # Builds the prompt's ``inputs_embeds`` from (model, prompt ids) at prefill, for
    # prompts whose placeholder tokens stand for image features; None feeds the ids.
    embed: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    # The compiled grammar every choice follows (see :mod:`.constraints`); None: free.
    grammar: Any = None
    cancelled: bool = False
    # Arrived before a pause in "wait" mode: still runs, the pause waits for it.
    drain: bool = False
    done: bool = False
    unfinished: int = 0
    # vLLM's ``priority``: lower runs first; equal priorities run in arrival order.
    priority: int = 0
    arrival: int = 0
    # Requests of a lower priority admitted while it waited, though they arrived later.
    passed_over: int = 0
    # Its choices once prefilled; kept through a preemption, which recomputes their KV.
    sequences: list[Sequence] = field(default_factory=list)
    # Prompt tokens whose KV came from the prefix cache at the first prefill.
    cached_tokens: int | None = None
    # vLLM's ``prompt_logprobs``, gathered as the prompt's chunks are computed; None when
    # not asked for (or, in ``--deterministic`` mode, recomputed by the trainer's pass).
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether its prefill keeps every prompt token's logits (see :mod:`.prompt_logprobs`)."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs.complete

    @property
    def kv_salt(self) -> tuple[str | None, str | None]:
        """What its KV blocks are hashed with besides their tokens: the adapter the KV is
        computed with and the client's ``cache_salt``."""
        return (self.adapter, self.cache_salt)

    @property
    def order(self) -> tuple[int, int]:
        """Admission order; the largest runs last and is preempted first."""
        return (self.priority, self.arrival)

    @property
    def most_blocks(self) -> int:
        """Blocks its choices hold at most: the prompt's full blocks shared, the rest each."""
        shared = len(self.prompt_ids) // BLOCK_SIZE
        longest = len(self.prompt_ids) + self.params.max_tokens
        return shared + self.params.n * (-(-longest // BLOCK_SIZE) - shared)

    def blocks_to_start(self) -> int:
        """Blocks its (next) prefill takes at most, before any prefix cache hit."""
        if not self.sequences:
            full = len(self.prompt_ids) // BLOCK_SIZE
            return full + self.params.n * (1 if len(self.prompt_ids) % BLOCK_SIZE else 0)
        return sum(seq.blocks_for(seq.kv_tokens) for seq in self.sequences if not seq.finished)

    def should_stop(self) -> bool:
        return self.cancelled or self.context.is_stopped()


@dataclass(eq=False)
class Sequence:
    """One choice of a submission: one row of the decode batch."""

    submission: Submission
    index: int
    generator: torch.Generator | None
    penalties: PenaltyState | None
    constraint: SequenceConstraint | None = None
    output_ids: list[int] = field(default_factory=list)
    kv_length: int = 0
    next_token: int = 0
    finished: bool = False
    # Set from its preemption until its KV is recomputed: it holds no row and no block.
    preempted: bool = False
    # The pool blocks its KV occupies, in token order (full prompt blocks may be shared).
    blocks: list[Block] = field(default_factory=list)
    # The prefix cache's epoch when its blocks were claimed: the weights its KV is from.
    kv_epoch: int = 0

    @property
    def in_batch(self) -> bool:
        return not (self.finished or self.preempted)

    @property
    def kv_tokens(self) -> list[int]:
        """The tokens whose KV it holds once every token it produced is fed back."""
        return self.submission.prompt_ids + self.output_ids

    @property
    def cacheable_tokens(self) -> list[int]:
        """The tokens whose KV it holds, where the prefix cache may name its blocks by
        them: none when image features stand in for some of their embeddings."""
        if self.submission.embed is not None:
            return []
        return self.kv_tokens[: self.kv_length]

    @staticmethod
    def blocks_for(tokens: list[int] | int) -> int:
        count = tokens if isinstance(tokens, int) else len(tokens)
        return -(-count // BLOCK_SIZE)

    @classmethod
    def start(
        cls, submission: Submission, index: int, *, device: torch.device, vocab_size: int
    ) -> Sequence:
        """Choice ``index`` of ``submission``, seeded ``seed + index`` when seeded."""
        params = submission.params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed + index)
        penalties = None
        if params.has_penalties:
            penalties = PenaltyState(submission.prompt_ids, vocab_size, device)
        constraint = None
        if submission.grammar is not None:
            constraint = SequenceConstraint(submission.grammar)
        return cls(submission, index, generator, penalties, constraint)

    def take(self, choice: TokenChoice) -> dict[str, Any]:
        """Append the token ``choice`` picked; its chunk (ids, index, logprobs)."""
        token = choice.token_id
        self.output_ids.append(token)
        self.next_token = token
        if self.penalties is not None:
            self.penalties.record(token)
        chunk: dict[str, Any] = {"token_ids": [token], "index": self.index}
        if choice.logprob is not None:
            chunk["log_probs"] = [choice.logprob]
            if choice.top_logprobs is not None:
                chunk["top_logprobs"] = [choice.top_logprobs]
        return chunk

    def finish_reason(self, eos_token_ids: frozenset[int]) -> str | None:
        """Why the choice ends with the token it took last: ``"stop"`` (a stop or end
        token, a complete grammar), ``"length"`` (``max_tokens``), or None when it goes on."""
        params = self.submission.params
        token = self.output_ids[-1]
        if (
            token in params.stop_token_ids
            or (not params.ignore_eos and token in eos_token_ids)
            or (self.constraint is not None and self.constraint.complete)
        ):
            return "stop"
        if len(self.output_ids) >= params.max_tokens:
            return "length"
        return None

    @property
    def remaining_steps(self) -> int:
        """Decode steps the row may still take (its last token is never fed back)."""
        return max(self.submission.params.max_tokens - len(self.output_ids), 1)

    def sampling(self, eos_token_ids: frozenset[int]) -> RowSampling:
        """How this row's next token is chosen: end tokens banned until ``min_tokens``."""
        params = self.submission.params
        banned: list[int] = []
        if len(self.output_ids) < params.min_tokens:
            banned = sorted(params.stop_token_ids | eos_token_ids)
        return RowSampling(
            params, len(self.output_ids), banned, self.generator, self.penalties, self.constraint
        )


def completion_usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def request_priority(request: Mapping[str, Any]) -> int:
    """vLLM's ``priority`` of an engine request (lower runs first), 0 when absent."""
    priority = request.get("priority")
    if priority is None:
        return 0
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority: must be an integer, got {type(priority).__name__}")
    return priority


def request_cache_salt(request: Mapping[str, Any]) -> str | None:
    """vLLM's ``cache_salt`` of an engine request, None when absent."""
    salt = request.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ValueError("cache_salt: must be a non-empty string")
    return salt

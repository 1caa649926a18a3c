"""The state of one request in the batch scheduler: a :class:`Submission` (one
``generate`` call, ``n`` choices) and its :class:`Sequence` s (one choice each, one row of
the decode batch).

The scheduler (:mod:`.scheduler`) admits and retires submissions; the model runner
(:mod:`.model_runner`) reads and advances their sequences' KV lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from penstock.engines.context import Context
from penstock.engines.transformers.constraints import SequenceConstraint
from penstock.engines.transformers.sampling import PenaltyState, RowSampling, SamplingParams

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

    @property
    def reserved_tokens(self) -> int:
        return self.params.n * (len(self.prompt_ids) + self.params.max_tokens)

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


def completion_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }

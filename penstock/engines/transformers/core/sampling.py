"""Per-request sampling parameters and the batched next-token choice.

Every row of a decode batch carries its own parameters. Logits are processed in this
order: repetition/presence/frequency penalties, the ``min_tokens`` ban on stop tokens,
temperature, top-k, top-p, min-p; then greedy rows take the argmax and sampled rows draw
from their own generator, so a seeded request draws the same tokens whatever else shares
the batch. Reported logprobs are those of the model's raw distribution; prompt logprobs
come from a forward pass of their own (see :mod:`.deterministic`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from penstock.engines.guided_specs import GuidedSpec, parse_guided_decoding
from penstock.engines.transformers.core.prompt_logprobs import check_prompt_logprobs_cost
from penstock.engines.transformers.features.constraints import (
    SequenceConstraint,
    advance_constraints,
    apply_constraints,
)

MAX_TOP_LOGPROBS = 20

# Options a client may send that this engine can't honour, with the reason given back.
_UNSUPPORTED_SAMPLING = {
    "response_format": "response_format is not supported by the transformers engine",
    "logit_bias": "logit_bias is not supported by the transformers engine",
    "use_beam_search": "beam search is not supported by the transformers engine",
}


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and of the stop rules (already validated)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's ``prompt_logprobs``: each prompt token's logprob and this many others.
    prompt_logprobs: int | None = None
    # The prompt logprobs' distribution is ``softmax(logits / prompt_temperature)``, as
    # vLLM's ``processed_logprobs`` mode scores a teacher (TRL's sequence logprobs).
    prompt_temperature: float = 1.0
    # The experts a mixture-of-experts model routed each token to (see :mod:`.routing`).
    routed_experts: bool = False
    # The request's constraint (see :mod:`.constraints`); None decodes freely.
    guided: GuidedSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for the sampling options it leaves out.

    The field defaults are the engine's neutral ones; a model's generation config may
    replace them (see :mod:`.generation_config`). ``max_tokens`` None means "up to the
    context length".
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None

    @classmethod
    def from_generation_config(cls, values: dict[str, Any]) -> SamplingDefaults:
        """The defaults a ``generation_config.json`` sets (null or absent keys stay neutral);
        ``ValueError`` names a value a request could not have sent either."""
        where = "generation_config"
        neutral = cls()
        return cls(
            temperature=_number(values, "temperature", where, neutral.temperature, 0.0, 100.0),
            top_p=_number(values, "top_p", where, neutral.top_p, 1e-9, 1.0),
            top_k=_integer(values, "top_k", where, neutral.top_k, -1),
            min_p=_number(values, "min_p", where, neutral.min_p, 0.0, 1.0),
            repetition_penalty=_number(
                values, "repetition_penalty", where, neutral.repetition_penalty, 1e-6, 100.0
            ),
            max_tokens=_integer(values, "max_new_tokens", where, neutral.max_tokens, 1),
        )


def _number(
    group: dict[str, Any], key: str, where: str, default: float, low: float, high: float
) -> float:
    value = group.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}.{key} must be a number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{where}.{key} must be between {low:g} and {high:g}, got {value!r}")
    return float(value)


def _integer(group: dict[str, Any], key: str, where: str, default: int | None, low: int) -> Any:
    value = group.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{where}.{key} must be >= {low}, got {value}")
    return value


def _flag(output: dict[str, Any], key: str) -> bool:
    value = output.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"output_options.{key} must be a boolean, got {value!r}")
    return value


def _group(request: dict[str, Any], key: str) -> dict[str, Any]:
    value = request.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object")
    return value


def parse_sampling_params(
    request: dict[str, Any],
    *,
    prompt_len: int,
    context_length: int,
    vocab_size: int,
    max_num_seqs: int,
    defaults: SamplingDefaults,
) -> SamplingParams:
    """Validate a GenerateRequest's option groups; ``ValueError`` names the offending field.

    Sampling options and ``max_tokens`` the request leaves out come from ``defaults``.
    """
    sampling = _group(request, "sampling_options")
    stop = _group(request, "stop_conditions")
    output = _group(request, "output_options")
    _refuse_unsupported(sampling)
    n = _choice_count(sampling, max_num_seqs)
    top_k = _integer(sampling, "top_k", "sampling_options", defaults.top_k, -1)
    max_tokens, min_tokens = _token_bounds(stop, prompt_len, context_length, defaults)
    stop_ids = _stop_token_ids(stop, vocab_size)
    ignore_eos = stop.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise ValueError("stop_conditions.ignore_eos must be a boolean")
    logprobs = _top_count(output, "logprobs")
    prompt_logprobs = _top_count(output, "prompt_logprobs")
    if prompt_logprobs is not None:
        check_prompt_logprobs_cost(prompt_len, prompt_logprobs)
    seed = sampling.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"sampling_options.seed must be an integer, got {seed!r}")
    return SamplingParams(
        temperature=_number(
            sampling, "temperature", "sampling_options", defaults.temperature, 0.0, 100.0
        ),
        top_p=_number(sampling, "top_p", "sampling_options", defaults.top_p, 1e-9, 1.0),
        top_k=0 if top_k in (-1, 0) else min(top_k, vocab_size),
        min_p=_number(sampling, "min_p", "sampling_options", defaults.min_p, 0.0, 1.0),
        seed=seed,
        n=n,
        presence_penalty=_number(sampling, "presence_penalty", "sampling_options", 0.0, -2, 2),
        frequency_penalty=_number(sampling, "frequency_penalty", "sampling_options", 0.0, -2, 2),
        repetition_penalty=_number(
            sampling,
            "repetition_penalty",
            "sampling_options",
            defaults.repetition_penalty,
            1e-6,
            100.0,
        ),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=bool(ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        prompt_temperature=_number(
            output, "prompt_logprobs_temperature", "output_options", 1.0, 1e-6, 100.0
        ),
        routed_experts=_flag(output, "return_routed_experts"),
        guided=parse_guided_decoding(sampling.get("guided_decoding")),
    )


def _refuse_unsupported(sampling: dict[str, Any]) -> None:
    for key, reason in _UNSUPPORTED_SAMPLING.items():
        if sampling.get(key) not in (None, False, {}, []):
            raise ValueError(f"sampling_options.{key}: {reason}")


def _top_count(output: dict[str, Any], key: str) -> int | None:
    """``output_options.logprobs`` or ``.prompt_logprobs``: how many most likely tokens
    to report beside the chosen (or prompt) one."""
    count: int | None = _integer(output, key, "output_options", None, 0)
    if count is not None and count > MAX_TOP_LOGPROBS:
        raise ValueError(f"output_options.{key} must be <= {MAX_TOP_LOGPROBS}, got {count}")
    return count


def _choice_count(sampling: dict[str, Any], max_num_seqs: int) -> int:
    """``n``, each choice a row of the batch; ``best_of`` only as ``n``."""
    n: int = _integer(sampling, "n", "sampling_options", 1, 1)
    if n > max_num_seqs:
        raise ValueError(f"sampling_options.n must be <= {max_num_seqs} (--max-num-seqs), got {n}")
    best_of = _integer(sampling, "best_of", "sampling_options", None, 1)
    if best_of is not None and best_of != n:
        raise ValueError("sampling_options.best_of: only best_of == n is supported")
    return n


def _token_bounds(
    stop: dict[str, Any], prompt_len: int, context_length: int, defaults: SamplingDefaults
) -> tuple[int, int]:
    """``(max_tokens, min_tokens)``, the answer fitting in the context after the prompt."""
    if prompt_len >= context_length:
        raise ValueError(
            f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
            f"the context length of {context_length} tokens"
        )
    room = context_length - prompt_len
    max_tokens = _integer(stop, "max_tokens", "stop_conditions", None, 1)
    if max_tokens is None:
        # A default bounds the answer but must not refuse a prompt that leaves less room.
        max_tokens = room if defaults.max_tokens is None else min(defaults.max_tokens, room)
    elif max_tokens > room:
        raise ValueError(
            f"stop_conditions.max_tokens: the prompt ({prompt_len} tokens) plus max_tokens "
            f"({max_tokens}) exceeds the context length of {context_length} tokens"
        )
    min_tokens = _integer(stop, "min_tokens", "stop_conditions", 0, 0)
    if min_tokens > max_tokens:
        raise ValueError(
            f"stop_conditions.min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})"
        )
    return max_tokens, min_tokens


def _stop_token_ids(stop: dict[str, Any], vocab_size: int) -> frozenset[int]:
    stop_ids = stop.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in stop_ids
    ):
        raise ValueError(
            f"stop_conditions.stop_token_ids must be a list of token ids in [0, {vocab_size})"
        )
    return frozenset(stop_ids)


class PenaltyState:
    """Token statistics one sequence needs for its penalties (kept only when asked for)."""

    def __init__(self, prompt_ids: list[int], vocab_size: int, device: torch.device) -> None:
        # The seen ids, not a vocabulary-wide mask: the repetition penalty then touches only
        # those logits instead of rewriting every row's whole vocabulary each step.
        self._seen = set(prompt_ids)
        self.seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long, device=device)
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    def record(self, token_id: int) -> None:
        if token_id not in self._seen:
            self._seen.add(token_id)
            self.seen_ids = torch.cat([self.seen_ids, self.seen_ids.new_tensor([token_id])])
        self.output_counts[token_id] += 1

    def copy(self) -> PenaltyState:
        clone = PenaltyState.__new__(PenaltyState)
        clone._seen = set(self._seen)
        clone.seen_ids = self.seen_ids.clone()
        clone.output_counts = self.output_counts.clone()
        return clone


@dataclass
class RowSampling:
    """One batch row as the sampler sees it."""

    params: SamplingParams
    generated: int
    banned_until_min_tokens: list[int]
    generator: torch.Generator | None
    penalties: PenaltyState | None
    constraint: SequenceConstraint | None = None


@dataclass
class TokenChoice:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[dict[str, Any]] | None = None


def _apply_penalties(logits: torch.Tensor, rows: list[RowSampling]) -> None:
    for i, row in enumerate(rows):
        state, params = row.penalties, row.params
        if state is None:
            continue
        line = logits[i]
        if params.repetition_penalty != 1.0:
            seen = line.index_select(0, state.seen_ids)
            penalised = torch.where(
                seen > 0, seen / params.repetition_penalty, seen * params.repetition_penalty
            )
            line.index_copy_(0, state.seen_ids, penalised)
        if params.frequency_penalty != 0.0:
            line.sub_(params.frequency_penalty * state.output_counts)
        if params.presence_penalty != 0.0:
            line.sub_(params.presence_penalty * (state.output_counts > 0).float())


def _filter_sampled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p for the sampled rows; returns probabilities."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature.unsqueeze(1)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), -math.inf)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before > top_p.unsqueeze(1), -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)
        floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def choose_tokens(
    logits: torch.Tensor, rows: list[RowSampling], shared_generator: torch.Generator
) -> list[TokenChoice]:
    """Pick the next token of every row of ``logits`` (``[rows, vocab]``); a row's
    constraint, if any, forbids what its grammar does and advances past the choice."""
    constraints = [row.constraint for row in rows]
    if all(constraint is None for constraint in constraints):
        return _choose(logits, rows, shared_generator, None)
    choices = _choose(logits, rows, shared_generator, constraints)
    advance_constraints([choice.token_id for choice in choices], constraints)
    return choices


def _choose(
    logits: torch.Tensor,
    rows: list[RowSampling],
    shared_generator: torch.Generator,
    constraints: list[SequenceConstraint | None] | None,
) -> list[TokenChoice]:
    logits = logits.float()
    raw_logprobs: torch.Tensor | None = None
    if any(row.params.logprobs is not None for row in rows):
        raw_logprobs = logits.log_softmax(dim=-1)
    if any(row.penalties is not None for row in rows):
        logits = logits.clone()
        _apply_penalties(logits, rows)
    for i, row in enumerate(rows):
        # A grammar decides where a constrained row may end.
        if row.constraint is None and row.generated < row.params.min_tokens:
            if row.banned_until_min_tokens:
                logits[i, row.banned_until_min_tokens] = -math.inf
    if constraints is not None:
        # After the raw logprobs: those stay the model's own, as without a constraint.
        logits = logits.clone()
        apply_constraints(logits, constraints)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    if len(greedy) == len(rows):
        # An all-greedy batch needs no row selection (a copy of every row's logits).
        return _with_logprobs(logits.argmax(dim=-1).tolist(), rows, raw_logprobs)
    chosen = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        chosen[index] = logits[index].argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        probs = _filter_sampled(logits[index], [rows[i].params for i in sampled])
        # Exponential race (argmax of p / Exp(1)) draws from p with each row's own
        # generator, which a batched multinomial can't do.
        noise = torch.empty_like(probs)
        for j, i in enumerate(sampled):
            noise[j].exponential_(generator=rows[i].generator or shared_generator)
        chosen[index] = (probs / noise).argmax(dim=-1)
    return _with_logprobs(chosen.tolist(), rows, raw_logprobs)


def _with_logprobs(
    token_ids: list[int], rows: list[RowSampling], raw_logprobs: torch.Tensor | None
) -> list[TokenChoice]:
    choices = [TokenChoice(token_id) for token_id in token_ids]
    if raw_logprobs is not None:
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k is None:
                continue
            choices[i].logprob = float(raw_logprobs[i, token_ids[i]])
            if k > 0:
                values, ids = raw_logprobs[i].topk(k)
                choices[i].top_logprobs = [
                    {"rank": rank, "token_id": token_id, "logprob": logprob}
                    for rank, (token_id, logprob) in enumerate(
                        zip(ids.tolist(), values.tolist(), strict=True), start=1
                    )
                ]
    return choices

"""A Penstock engine request's options as vLLM's ``SamplingParams``.

The gateway has already rendered the chat template and tokenized; vLLM gets the token ids,
and Penstock detokenizes, matches stop strings and parses tools and reasoning, so vLLM is
asked for no text (``detokenize=False``) and streams token deltas. Options a request leaves
out come from the model's ``generation_config.json`` as vLLM's own server takes them
(``ModelConfig.get_diff_sampling_param``: ``AsyncLLM`` alone applies none of them). An
option vLLM cannot honour here is a ``ValueError`` naming the field, which the gateway
answers with a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

MAX_TOP_LOGPROBS = 20
WHITESPACE_REFUSAL = (
    "structured_outputs.disable_any_whitespace: false: vLLM applies one whitespace rule to "
    "every request, and this engine writes compact JSON; start it with "
    "--structured-outputs-config.backend auto for vLLM's own rule (any whitespace)"
)

# Sampling fields passed to vLLM under the same name, with the model's default where the
# request has none.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)

_UNSUPPORTED_SAMPLING = {
    "logit_bias": "logit_bias is not passed to the vllm engine",
    "use_beam_search": "beam search is not supported by the vllm engine",
}


def _group(request: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = request.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object")
    return value


def _optional_int(group: dict[str, Any], key: str, where: str, low: int) -> int | None:
    value = group.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{where}.{key} must be >= {low}, got {value}")
    return value


def _top_count(output: dict[str, Any], key: str) -> int | None:
    count = _optional_int(output, key, "output_options", 0)
    if count is not None and count > MAX_TOP_LOGPROBS:
        raise ValueError(f"output_options.{key} must be <= {MAX_TOP_LOGPROBS}, got {count}")
    return count


def _stop_token_ids(stop: dict[str, Any], vocab_size: int) -> list[int] | None:
    ids = stop.get("stop_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids
    ):
        raise ValueError(f"stop_conditions.stop_token_ids must be token ids in [0, {vocab_size})")
    return ids


def _max_tokens(
    stop: dict[str, Any], prompt_len: int, context_length: int, default: int | None
) -> int:
    """vLLM's server's rule: the request's ``max_tokens``, else the model's default, never
    past the context length."""
    room = context_length - prompt_len
    if room <= 0:
        raise ValueError(
            f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
            f"the context length of {context_length} tokens"
        )
    asked = _optional_int(stop, "max_tokens", "stop_conditions", 1)
    if asked is not None and asked > room:
        raise ValueError(
            f"stop_conditions.max_tokens: {asked} tokens asked, but the prompt's {prompt_len} "
            f"tokens leave {room} within the context length of {context_length}"
        )
    wanted = asked if asked is not None else default
    return room if wanted is None else min(wanted, room)


def structured_outputs(guided: Any, compact_json: bool) -> StructuredOutputsParams | None:
    """Penstock's ``guided_decoding`` (one of json, regex, choice, grammar, structural_tag;
    ``whitespace`` compact or any) as vLLM's structured outputs. vLLM applies the engine's
    whitespace rule (``compact_json``) to every request: one asking for any whitespace
    from a compact engine is refused."""
    if guided in (None, {}):
        return None
    if not isinstance(guided, dict):
        raise ValueError("sampling_options.guided_decoding must be an object")
    kinds = {"json", "regex", "choice", "grammar", "structural_tag"}
    unknown = sorted(set(guided) - {*kinds, "whitespace", "backend"})
    if unknown:
        raise ValueError(f"sampling_options.guided_decoding: unknown field(s) {', '.join(unknown)}")
    given = {kind: guided[kind] for kind in kinds if guided.get(kind) is not None}
    if compact_json and guided.get("whitespace") == "any":
        raise ValueError(WHITESPACE_REFUSAL)
    tag = given.get("structural_tag")
    if tag is not None and not isinstance(tag, str):
        given["structural_tag"] = json.dumps(tag)
    try:
        return StructuredOutputsParams(**given, disable_any_whitespace=compact_json)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"sampling_options.guided_decoding: {exc}") from exc


def sampling_params(
    request: Mapping[str, Any],
    *,
    prompt_len: int,
    context_length: int,
    vocab_size: int,
    defaults: Mapping[str, Any],
    compact_json: bool = True,
) -> SamplingParams:
    """The request's ``SamplingParams``; ``ValueError`` names a field vLLM cannot take."""
    sampling = _group(request, "sampling_options")
    stop = _group(request, "stop_conditions")
    output = _group(request, "output_options")
    for key, reason in _UNSUPPORTED_SAMPLING.items():
        if sampling.get(key) not in (None, False, {}, []):
            raise ValueError(f"sampling_options.{key}: {reason}")
    n = _optional_int(sampling, "n", "sampling_options", 1)
    if n not in (None, 1):
        raise ValueError("sampling_options.n: the vllm engine takes one choice a request")
    values = {
        key: sampling[key] if sampling.get(key) is not None else defaults[key]
        for key in _SAMPLING_FIELDS
        if sampling.get(key) is not None or key in defaults
    }
    seed = sampling.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"sampling_options.seed must be an integer, got {seed!r}")
    ignore_eos = stop.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ValueError("stop_conditions.ignore_eos must be a boolean")
    try:
        return SamplingParams(
            **values,
            seed=seed,
            max_tokens=_max_tokens(stop, prompt_len, context_length, defaults.get("max_tokens")),
            min_tokens=_optional_int(stop, "min_tokens", "stop_conditions", 0) or 0,
            stop_token_ids=_stop_token_ids(stop, vocab_size),
            ignore_eos=ignore_eos,
            logprobs=_top_count(output, "logprobs"),
            structured_outputs=structured_outputs(sampling.get("guided_decoding"), compact_json),
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )
    except ValueError as exc:
        raise ValueError(f"sampling_options: {exc}") from exc

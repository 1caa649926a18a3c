"""vLLM's ``prompt_logprobs``, gathered chunk by chunk as the prompt is prefilled.

A prompt asking for them is prefilled like any other, over several steps beside the
decoding rows (:mod:`.prefill_plan`, :mod:`.chunk_pacing`), with one difference: each
pass keeps the logits of every token of its chunk, not only the last. A chunk of such a
prompt computes :data:`PROMPT_LOGPROB_CHUNK` tokens at most, and its logits are reduced
right away to what the answer holds (the prompt token's logprob and rank, the ``k`` most
likely others), so the full-vocabulary logits of the whole prompt never exist at once:
on SmolLM2-135M they are ~200 KB a token in float32, ~1.6 GB for 8,000 tokens.

The answer itself is bounded: a prompt of ``T`` tokens asking for ``k`` others holds
``T x (k + 1)`` entries, at most :data:`MAX_PROMPT_LOGPROB_ENTRIES` (a request beyond is
refused before it runs, naming the bound).

Such a prompt matches no cached prefix: a cached block has no logits to report.
"""

from __future__ import annotations

from typing import Any

import torch

# Tokens of a prompt asking for its logprobs computed in one pass at most: the logits
# held at once ([tokens, vocab] in float32).
PROMPT_LOGPROB_CHUNK = 128
# Prompt tokens x (1 + the most likely others asked for) of one request at most.
MAX_PROMPT_LOGPROB_ENTRIES = 65_536


def check_prompt_logprobs_cost(prompt_len: int, top: int) -> None:
    """Refuse prompt logprobs whose answer would exceed :data:`MAX_PROMPT_LOGPROB_ENTRIES`."""
    entries = prompt_len * (top + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ValueError(
            f"output_options.prompt_logprobs: {prompt_len} prompt tokens x (1 + {top}) = "
            f"{entries} logprobs, more than this server answers "
            f"({MAX_PROMPT_LOGPROB_ENTRIES}); ask for fewer or send a shorter prompt"
        )


def _entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"token_id": token_id, "logprob": logprob, "rank": rank}


class PromptLogprobs:
    """One prompt's logprobs as its chunks are computed: ``entries`` is None for the first
    token, then per token its logprob and vocabulary rank, followed by the ``top`` most
    likely others (at ``temperature``), in the engine contract's shape."""

    def __init__(self, tokens: list[int], top: int, temperature: float) -> None:
        self.tokens, self.top, self.temperature = tokens, top, temperature
        self.entries: list[Any] = [None]

    @property
    def complete(self) -> bool:
        return len(self.entries) >= len(self.tokens)

    def add(self, start: int, logits: torch.Tensor) -> None:
        """Take the logits ``[tokens, vocab]`` of positions ``start`` on (each one's next
        token); positions already taken (a recomputed prompt) are skipped."""
        needed = len(self.entries) - 1
        first = max(needed - start, 0)
        end = min(logits.shape[0], len(self.tokens) - 1 - start)
        if start > needed or first >= end:
            return
        rows = logits[first:end].float()
        if self.temperature != 1.0:
            rows = rows / self.temperature
        rows = torch.log_softmax(rows, dim=-1)
        ids = torch.tensor(self.tokens[start + first + 1 : start + end + 1], device=rows.device)
        actual = rows.gather(1, ids.unsqueeze(1))
        ranks = ((rows > actual).sum(dim=1) + 1).tolist()
        top_values: list[list[float]] = [[] for _ in ranks]
        top_ids: list[list[int]] = [[] for _ in ranks]
        if self.top:
            best, best_ids = rows.topk(self.top)
            top_values, top_ids = best.tolist(), best_ids.tolist()
        for token, value, rank, values, others in zip(
            ids.tolist(), actual.squeeze(1).tolist(), ranks, top_values, top_ids, strict=True
        ):
            entries = [_entry(token, value, rank)]
            ranked = enumerate(zip(others, values, strict=True), start=1)
            entries += [_entry(other, lp, place) for place, (other, lp) in ranked if other != token]
            self.entries.append(entries)

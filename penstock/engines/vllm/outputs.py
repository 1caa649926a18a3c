"""vLLM's ``RequestOutput`` deltas as the engine contract's chunks.

Each delta carries the tokens sampled since the last one; the choice's last chunk carries
its ``finish_reason`` and usage (``cached_tokens`` from vLLM's prefix cache). vLLM ends an
aborted request with ``abort``: it is ``cancelled`` when the gateway cancelled it (a client
gone, a deadline), ``abort`` when an admin call ended it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.outputs import RequestOutput


@dataclass
class ChoiceStream:
    """One request's single choice as it streams: its prompt, how many tokens it
    produced, and the top logprobs it asked for (None: no logprobs)."""

    prompt_tokens: int
    top_logprobs: int | None
    produced: int = 0

    def chunk(self, output: RequestOutput, cancelled: bool) -> dict[str, Any]:
        (choice,) = output.outputs
        token_ids = list(choice.token_ids)
        self.produced += len(token_ids)
        chunk: dict[str, Any] = {"token_ids": token_ids, "index": 0}
        if self.top_logprobs is not None and choice.logprobs and token_ids:
            self._add_logprobs(chunk, token_ids, choice.logprobs)
        reason = choice.finish_reason
        if reason is not None:
            if reason == "abort" and cancelled:
                reason = "cancelled"
            chunk["finish_reason"] = reason
            chunk["completion_usage"] = self.usage(output.num_cached_tokens)
        return chunk

    def _add_logprobs(self, chunk: dict[str, Any], token_ids: list[int], logprobs: Any) -> None:
        positions = list(logprobs)[-len(token_ids) :]
        chunk["log_probs"] = [
            float(position[token].logprob)
            for token, position in zip(token_ids, positions, strict=True)
        ]
        k = self.top_logprobs or 0
        if k > 0:
            chunk["top_logprobs"] = [_top(position, k) for position in positions]

    def usage(self, cached_tokens: int | None) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.produced,
            "total_tokens": self.prompt_tokens + self.produced,
        }
        if cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage


def _top(position: dict[int, Any], k: int) -> list[dict[str, Any]]:
    """The k most likely tokens of one position (vLLM adds the sampled token when it is
    not among them, ranked past k)."""
    ranked = sorted(
        (entry.rank, token_id, float(entry.logprob))
        for token_id, entry in position.items()
        if entry.rank is not None and entry.rank <= k
    )
    return [
        {"rank": rank, "token_id": token_id, "logprob": logprob}
        for rank, token_id, logprob in ranked
    ]

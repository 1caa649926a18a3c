"""The KV of a prompt prefilled over several steps (chunked prefill), and one chunk of it.

Why not ``DynamicCache``: it appends each chunk with ``cat``, a copy of the prompt's whole
KV so far in every layer for every chunk, so a long prompt's later chunks cost more and
more to append. :class:`PromptKv` holds, per layer, one buffer as long as the prompt
(allocated at the first chunk, shaped after its keys) that each chunk writes into in
place; the model sees the view of the columns written so far. It is a ``Cache``, so the
transformers forward runs over it too.

:class:`PromptChunk` is a chunk computed inside a decode step of
:class:`.llama_decode.LlamaDecoder` (one pass reads every weight once for the batch's
rows and the chunk's tokens): its attention reads the prompt's KV per KV head, the query
heads sharing a head stacked as its queries, instead of repeating the KV for every query
head as transformers' attention does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


class PromptLayer(DynamicLayer):
    """One layer's keys and values of one prompt, written in place into buffers of
    ``capacity`` columns; ``keys``/``values`` are the views of the columns written."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.end = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        shape = (batch, heads, self.capacity, dim)
        self.key_buffer = key_states.new_empty(shape)
        self.value_buffer = value_states.new_empty((*shape[:3], value_states.shape[-1]))
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        added = key_states.shape[-2]
        end = self.end + added
        if end > self.capacity:
            raise RuntimeError(f"prompt KV holds {self.capacity} tokens, {end} written")
        self.key_buffer[:, :, self.end : end].copy_(key_states)
        self.value_buffer[:, :, self.end : end].copy_(value_states)
        self.end = end
        self.keys = self.key_buffer[:, :, :end]
        self.values = self.value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.end


class PromptKv(DynamicCache):
    """The ``Cache`` of one prompt of ``capacity`` tokens, every layer a :class:`PromptLayer`."""

    def __init__(self, layers: int, capacity: int) -> None:
        Cache.__init__(self, layers=[PromptLayer(capacity) for _ in range(layers)])  # type: ignore[arg-type]


@dataclass
class PromptChunk:
    """Prompt tokens ``token_ids`` at positions ``start`` on, computed over ``cache`` (which
    holds the ``start`` tokens before them); ``last``: they end the prompt;
    ``every_logit``: each token's logits are kept, not only the last one's (the prompt's
    logprobs are asked for)."""

    token_ids: torch.Tensor
    start: int
    cache: PromptKv
    last: bool
    every_logit: bool = False

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(
            self.start, self.start + self.token_ids.shape[0], device=self.token_ids.device
        )

    def mask(self, group: int) -> torch.Tensor:
        """``[1, 1, group * tokens, start + tokens]``: True where a query attends (the
        columns up to its own position), its rows repeated for the ``group`` query heads
        stacked per KV head."""
        tokens = self.token_ids.shape[0]
        device = self.token_ids.device
        columns = torch.arange(self.start + tokens, device=device)
        own = self.positions.repeat(group)
        return (columns.unsqueeze(0) <= own.unsqueeze(1))[None, None]

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Write the chunk's ``key``/``value`` (``[tokens, kv heads, dim]``, rotated) into
        layer ``layer``'s KV and attend over it: ``[tokens, heads * dim]`` from ``query``
        (``[tokens, heads, dim]``, rotated)."""
        tokens, heads, dim = query.shape
        kv_heads = key.shape[1]
        group = heads // kv_heads
        keys, values = self.cache.layers[layer].update(
            key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)
        )
        stacked = query.view(tokens, kv_heads, group, dim).permute(1, 2, 0, 3)
        stacked = stacked.reshape(1, kv_heads, group * tokens, dim)
        attended = F.scaled_dot_product_attention(
            stacked, keys, values, attn_mask=mask, scale=scale
        )
        attended = attended.view(kv_heads, group, tokens, dim).permute(2, 0, 1, 3)
        return attended.reshape(tokens, heads * dim)

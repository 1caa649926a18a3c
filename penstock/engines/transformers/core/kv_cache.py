"""The KV pool's memory: every block's keys and values, read in place by decode steps.

:class:`KvArena` holds, per layer, ``[slots, kv heads, head dim]`` keys and values; the
tokens of block ``b`` (:mod:`.block_manager`) are slots ``b * BLOCK_SIZE`` to ``(b + 1) *
BLOCK_SIZE - 1``. Its size is the pool's (``--kv-cache-tokens`` or ``--kv-cache-bytes``)
plus one block of zeros, allocated once: memory is touched only as blocks are written,
and never exceeds the pool however many requests come and however their lengths differ.
A running sequence's KV is in its blocks, a prompt's cached blocks are read by the
sequences that match them without a copy, and a sequence's blocks become cached ones
when it leaves by only naming them.

A prompt's KV is written into its blocks when it joins the batch (a prompt prefilled in
chunks writes each chunk's full blocks as it computes them). A decode step
(:class:`StepKv`) writes each row's new token into the slot after its last and attends
over the row's own slots: :mod:`.paged_attention` on the CPU, else the rows' slots
gathered into a padded batch, as is the transformers forward (:class:`GatheredCache`,
for models or adapters the lean decode step does not cover).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from penstock.engines.transformers.core.block_manager import BLOCK_SIZE, kv_shape
from penstock.engines.transformers.kernels.paged_attention import (
    gathered_attention,
    kernel_ready,
    paged_attention,
    rotary_decode_attention,
)

KvPair = tuple[torch.Tensor, torch.Tensor]


class KvArena:
    """Keys and values of every block of the pool, and one block of zeros after them
    (``pad_slot`` on) that pads gathered rows."""

    def __init__(
        self,
        *,
        layers: int,
        blocks: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (layers, (blocks + 1) * BLOCK_SIZE, kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.pad_slot = blocks * BLOCK_SIZE
        self.keys[:, self.pad_slot :].zero_()
        self.values[:, self.pad_slot :].zero_()

    @classmethod
    def for_model(
        cls, config: object, blocks: int, dtype: torch.dtype, device: torch.device
    ) -> KvArena:
        layers, kv_heads, head_dim = kv_shape(config)
        return cls(
            layers=layers,
            blocks=blocks,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def slots(self, block_ids: Sequence[int], start: int, stop: int) -> torch.Tensor:
        """The slots of tokens ``[start, stop)`` of a sequence holding ``block_ids``."""
        positions = torch.arange(start, stop, device=self.device)
        blocks = torch.tensor(block_ids, device=self.device)[positions // BLOCK_SIZE]
        return blocks * BLOCK_SIZE + positions % BLOCK_SIZE

    def write_prompt(self, slots: torch.Tensor, layers: Sequence[KvPair], start: int) -> None:
        """Write tokens ``start`` to ``start + len(slots)`` of a prompt's KV (``layers``:
        each ``[1, kv heads, tokens, head dim]``) into ``slots``."""
        stop = start + slots.shape[0]
        for index, (keys, values) in enumerate(layers):
            self.keys[index].index_copy_(0, slots, keys[0, :, start:stop].transpose(0, 1))
            self.values[index].index_copy_(0, slots, values[0, :, start:stop].transpose(0, 1))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV of ``slots``: ``[layers, 2, kv heads, tokens, head dim]``."""
        keys = self.keys[:, slots].transpose(1, 2)
        values = self.values[:, slots].transpose(1, 2)
        return torch.stack((keys, values), dim=1)

    def to(self, device: torch.device) -> None:
        self.keys = self.keys.to(device)
        self.values = self.values.to(device)


class StepKv:
    """One decode step's view of the arena: each row's slot for the token it feeds,
    its block table and its length (that token included)."""

    def __init__(self, arena: KvArena, rows: Sequence[tuple[Sequence[int], int]]) -> None:
        """``rows``: each row's block ids and the tokens it holds before this step."""
        self.arena = arena
        device = arena.device
        widest = max(len(blocks) for blocks, _ in rows)
        table = [list(blocks) + [0] * (widest - len(blocks)) for blocks, _ in rows]
        self.lengths = torch.tensor([length + 1 for _, length in rows], dtype=torch.int32)
        self.table = torch.tensor(table, dtype=torch.int32)
        self.slots = torch.tensor(
            [
                blocks[length // BLOCK_SIZE] * BLOCK_SIZE + length % BLOCK_SIZE
                for blocks, length in rows
            ],
            device=device,
        )
        self.in_place = (
            kernel_ready() and device.type == "cpu" and arena.keys.dtype == torch.float32
        )
        self._gathered: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if device.type != "cpu":
            self.lengths, self.table = self.lengths.to(device), self.table.to(device)

    @property
    def width(self) -> int:
        return int(self.lengths.max())

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every row's slots right-aligned in ``width`` columns (padding at the arena's
        zero slots), and the ``[rows, 1, 1, width]`` mask of real columns (None when no
        row is padded)."""
        if self._gathered is None:
            width = self.width
            columns = torch.arange(width, device=self.arena.device)
            lengths = self.lengths.to(self.arena.device).long()
            first = width - lengths
            position = columns.unsqueeze(0) - first.unsqueeze(1)
            table = self.table.to(self.arena.device).long()
            block = table.gather(1, (position.clamp(min=0) // BLOCK_SIZE))
            slots = block * BLOCK_SIZE + position.clamp(min=0) % BLOCK_SIZE
            real = position >= 0
            slots = torch.where(real, slots, self.arena.pad_slot)
            mask = None if bool(real.all()) else real[:, None, None, :]
            self._gathered = (slots, mask)
        return self._gathered

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """This step's keys and values of layer ``layer`` (``[rows, kv heads, dim]``)."""
        self.arena.keys[layer].index_copy_(0, self.slots, keys)
        self.arena.values[layer].index_copy_(0, self.slots, values)

    def attend(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Each row's attention in layer ``layer`` over its own tokens (this step's
        written): ``[rows, heads, dim]`` from ``query`` ``[rows, heads, dim]``."""
        keys, values = self.arena.keys[layer], self.arena.values[layer]
        if self.in_place:
            return paged_attention(
                query.contiguous(), keys, values, self.table, self.lengths, scale, BLOCK_SIZE
            )
        slots, mask = self.gathered()
        return gathered_attention(query, keys, values, slots, mask, scale)

    def rotate_write_attend(
        self,
        layer: int,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        rotation: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """:meth:`write` and :meth:`attend` in one kernel call, queries and keys rotated
        first: ``qkv`` the linear layers' float32 outputs, ``rotation`` ``cos`` and
        ``sin`` ``[rows, dim]``. Only where :attr:`in_place`. Returns ``[rows, heads * dim]``."""
        pool = (self.arena.keys, self.arena.values, layer)
        return rotary_decode_attention(
            *qkv, *rotation, pool, self.slots, self.table, self.lengths, scale, BLOCK_SIZE
        )


class GatheredLayer(DynamicLayer):
    """Layer ``index`` of a decode step through the transformers forward: the step's keys
    and values written into the arena, the rows' slots gathered back, padded."""

    def __init__(self, step: StepKv, index: int) -> None:
        super().__init__()
        self.step, self.index = step, index
        self.device = step.arena.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> KvPair:
        self.step.write(self.index, key_states[:, :, -1], value_states[:, :, -1])
        slots, _ = self.step.gathered()
        keys = self.step.arena.keys[self.index][slots].transpose(1, 2)
        values = self.step.arena.values[self.index][slots].transpose(1, 2)
        return keys, values

    def get_seq_length(self) -> int:
        return self.step.width - 1

    def get_max_length(self) -> int:
        return -1


class GatheredCache(DynamicCache):
    """The ``Cache`` of a decode step through the transformers forward."""

    def __init__(self, step: StepKv, layers: int) -> None:
        Cache.__init__(self, layers=[GatheredLayer(step, i) for i in range(layers)])  # type: ignore[arg-type]

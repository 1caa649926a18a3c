"""The decode batch's KV cache: one preallocated buffer per layer that grows in place.

Why not transformers' ``DynamicCache``: its layers append each step's keys and values
with ``cat``, a copy of every layer's whole cache per decode step (at 16 rows of ~100
tokens on SmolLM2-135M, ~70 MB a step: the main cost of a batched CPU step). Here each
layer holds ``[row capacity, kv heads, column capacity, head dim]`` buffers and the model
sees the view of the first ``rows`` rows and the columns ``[start, end)``: the
scheduler's right-aligned (left-padded) layout. A decode step writes one column in
place. Columns grow geometrically, never past what the running rows can still use, so
the whole cache is copied only when it grows. A leaving row is replaced by the last row
(only moved rows are copied), a joining row is written into a free slot, and padding no
row needs any more is dropped by moving ``start``. Once rows that leave make the cache
wasteful, it is reallocated tight a layer per decode step, the old buffers freed a few per
step. Padding columns always hold zeros, as ``DynamicCache``'s padded rows did, so masked
columns contribute exactly nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

# Columns added at least when the cache grows, so short rows do not regrow every step.
MIN_GROWTH = 32
# A cache holding more than this many times what its rows use is reallocated tight when
# rows leave: a long request that ended does not pin its memory until the batch empties.
_SHRINK_FACTOR = 4
# Layers reallocated tight per decode step: freeing the old buffers and mapping the new
# ones of every layer in one step stalled it (70-88 ms of CPU when an 8,000-token row left
# beside a 1,400-token one on SmolLM2-135M's shape, 129 ms in the engine).
_SHRINK_LAYERS_PER_STEP = 1
# Unused buffers freed per decode step: freeing is paid per mapped page (the prepared
# growth of an 8,000-token batch, 0.7 GB, took 40-60 ms of CPU to free in one step).
_FREED_PER_STEP = 4

KvPair = tuple[torch.Tensor, torch.Tensor]


class GrowingLayer(DynamicLayer):
    """One layer's keys and values, ``keys``/``values`` being views of the live region."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor) -> None:
        super().__init__()
        self.key_buffer = key_buffer
        self.value_buffer = value_buffer
        self.device = key_buffer.device
        self.is_initialized = True
        self.rows = 0
        self.start = 0
        self.end = 0
        self._refresh()

    def _refresh(self) -> None:
        self.keys = self.key_buffer[: self.rows, :, self.start : self.end]
        self.values = self.value_buffer[: self.rows, :, self.start : self.end]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> KvPair:
        added = key_states.shape[-2]
        if self.end + added > self.key_buffer.shape[-2]:
            # The scheduler reserves room before each step; this keeps a stray caller correct.
            width = self.end - self.start
            self.reallocate(self.row_capacity, 0, width + max(added, width, MIN_GROWTH))
        columns = slice(self.end, self.end + added)
        self.key_buffer[: self.rows, :, columns].copy_(key_states)
        self.value_buffer[: self.rows, :, columns].copy_(value_states)
        self.end += added
        self._refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.end - self.start

    def get_max_length(self) -> int:
        return -1

    @property
    def row_capacity(self) -> int:
        return self.key_buffer.shape[0]

    @property
    def column_capacity(self) -> int:
        return self.key_buffer.shape[-2]

    def reallocate(
        self, row_capacity: int, left: int, columns: int, zeroed: KvPair | None = None
    ) -> None:
        """Copy the live region into new zeroed buffers, starting at column ``left``;
        ``zeroed``: such buffers, allocated before (their shape wins)."""
        width = self.end - self.start
        shape = (row_capacity, self.key_buffer.shape[1], columns, self.key_buffer.shape[-1])
        if zeroed is None:
            keys = self.key_buffer.new_zeros(shape)
            values = self.value_buffer.new_zeros(shape)
        else:
            keys, values = zeroed
        keys[: self.rows, :, left : left + width] = self.keys
        values[: self.rows, :, left : left + width] = self.values
        self.key_buffer, self.value_buffer = keys, values
        self.start, self.end = left, left + width
        self._refresh()

    def move_to_front(self) -> None:
        """Move the live region to column 0 of the same buffers, for room on its right.

        The columns right of the live region need not be zero: a decode step writes its
        column for every row before reading it.
        """
        width = self.end - self.start
        for buffer in (self.key_buffer, self.value_buffer):
            live = buffer[: self.rows, :, self.start : self.end]
            buffer[: self.rows, :, :width] = live.clone() if self.start < width else live
        self.start, self.end = 0, width
        self._refresh()

    def to(self, device: torch.device) -> None:
        self.key_buffer = self.key_buffer.to(device)
        self.value_buffer = self.value_buffer.to(device)
        self.device = self.key_buffer.device
        self._refresh()


class BatchKv(DynamicCache):
    """The ``Cache`` of the decode batch: every layer a :class:`GrowingLayer` of one shape."""

    def __init__(self, prefilled: Sequence[KvPair], row_capacity: int) -> None:
        """Empty buffers shaped after one prefilled row's layers (``[1, heads, length, dim]``)."""
        layers = [
            GrowingLayer(
                keys.new_zeros((row_capacity, keys.shape[1], 0, keys.shape[-1])),
                values.new_zeros((row_capacity, values.shape[1], 0, values.shape[-1])),
            )
            for keys, values in prefilled
        ]
        Cache.__init__(self, layers=layers)  # type: ignore[arg-type]
        self.prepared: PreparedBuffers | None = None
        # The buffers the next growth of the columns takes (see :meth:`reserve`).
        self.grown: PreparedBuffers | None = None
        # The (rows, columns) layers are being reallocated to, the first ``_shrunk``
        # layers holding them already (see :meth:`_shrink_if_wasteful`).
        self._shrink_target: tuple[int, int] | None = None
        self._shrunk = 0
        # Buffers no layer uses any more, freed a few per :meth:`reserve`.
        self._unused: list[torch.Tensor] = []

    def reallocates(self, rows: int, width: int) -> bool:
        """Whether holding ``rows`` rows as wide as ``width`` reallocates the buffers."""
        first = self._growing[0]
        return rows > first.row_capacity or width > first.end

    @property
    def row_capacity(self) -> int:
        return self._growing[0].row_capacity

    @property
    def held_bytes(self) -> int:
        """Bytes of the layers' buffers and of those still waiting to be freed."""
        layers = sum(layer.key_buffer.nbytes + layer.value_buffer.nbytes for layer in self._growing)
        return layers + sum(buffer.nbytes for buffer in self._unused)

    def prepare(self, rows: int, columns: int, least: int) -> PreparedBuffers:
        """Buffers of ``rows`` x ``columns`` that the next widening or join of at most that
        size takes instead of allocating its own (see :class:`PreparedBuffers`); those
        prepared before are kept while they hold ``rows`` x ``least``."""
        prepared = self.prepared
        if prepared is None or prepared.rows < rows or prepared.columns < least:
            first = self._growing[0]
            shape = (rows, first.key_buffer.shape[1], columns, first.key_buffer.shape[-1])
            self.prepared = prepared = PreparedBuffers(first.key_buffer, shape, len(self.layers))
        return prepared

    def _zeroed(self, rows: int, columns: int) -> list[KvPair] | None:
        """The prepared buffers, wholly zeroed, when they hold ``rows`` x ``columns``."""
        prepared, self.prepared = self.prepared, None
        if prepared is None or prepared.rows < rows or prepared.columns < columns:
            return None
        return prepared.take()

    @property
    def _growing(self) -> list[GrowingLayer]:
        return self.layers  # type: ignore[return-value]

    @property
    def rows(self) -> int:
        return self._growing[0].rows

    @property
    def width(self) -> int:
        return self._growing[0].get_seq_length()

    def reserve(self, columns: int, limit: int) -> None:
        """Room for ``columns`` more decode columns; growth adds at most ``limit`` columns.

        Growing copies every row into new buffers, and mapping them stalled the step that
        grew (204 ms for a row of 4,700 tokens on SmolLM2-135M, one CPU thread, load ~3).
        Once the free columns are down to half the width, the next growth's buffers are
        prepared and zeroed a share per call, all of them by the time it takes them.
        """
        del self._unused[:_FREED_PER_STEP]
        self._shrink_layers(_SHRINK_LAYERS_PER_STEP)
        if self._shrink_target is not None:
            self._make_room_while_shrinking(columns)
        first = self._growing[0]
        free = first.column_capacity - first.end
        width = self.width
        if columns <= free:
            # Rows that end within the free columns never grow them.
            if 2 * free <= width and limit > free:
                self._prepare_growth(free, limit)
            return
        wanted = width + max(columns, growth(width, limit))
        grown, self.grown = self.grown, None
        zeroed = None
        if grown is not None and grown.rows == first.row_capacity and grown.columns >= wanted:
            zeroed = grown.take()
        for index, layer in enumerate(self._growing):
            buffers = None if zeroed is None else zeroed[index]
            layer.reallocate(layer.row_capacity, 0, wanted, buffers)

    def _make_room_while_shrinking(self, columns: int) -> None:
        """Room for ``columns`` in the layers not reallocated tight yet: their live region
        moves to the front of their buffers (a copy of what the rows use, where
        reallocating them all at once cost 31 ms of CPU beside a 1,400-token row)."""
        for layer in self._growing[self._shrunk :]:
            if layer.column_capacity - layer.end < columns:
                layer.move_to_front()
        if any(layer.column_capacity - layer.end < columns for layer in self._growing):
            self._shrink_layers(len(self.layers))

    def _prepare_growth(self, free: int, limit: int) -> None:
        """Zero a share of the buffers that growing takes once the ``free`` columns left
        are used, ``limit`` being the decode steps the rows may take."""
        first = self._growing[0]
        full = self.width + free
        columns = full + growth(full, limit - free)
        grown = self.grown
        if grown is None or grown.rows != first.row_capacity or grown.columns < columns:
            shape = (
                first.row_capacity,
                first.key_buffer.shape[1],
                columns,
                first.key_buffer.shape[-1],
            )
            self.grown = grown = PreparedBuffers(first.key_buffer, shape, len(self.layers))
        grown.zero(math.ceil(grown.left / max(free, 1)))

    def decode_column(
        self, index: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add one column to layer ``index``: its key and value slots ``[rows, heads, dim]``
        to write this step's keys and values into, and the layer's live keys and values
        with it. For a forward of its own; ``reserve`` must have made room."""
        layer = self._growing[index]
        end = layer.end
        if end >= layer.column_capacity:
            raise RuntimeError("no room for a decode column: call reserve first")
        layer.end = end + 1
        layer.keys = keys = layer.key_buffer[: layer.rows, :, layer.start : end + 1]
        layer.values = values = layer.value_buffer[: layer.rows, :, layer.start : end + 1]
        return keys[:, :, -1], values[:, :, -1], keys, values

    def row_kv(self, row: int, length: int, start: int, stop: int) -> torch.Tensor:
        """Tokens ``[start, stop)`` of row ``row`` (its last ``length`` columns are its
        tokens): ``[layers, 2, kv heads, stop - start, head dim]``, a copy."""
        pairs = []
        for layer in self._growing:
            first = layer.end - length
            columns = slice(first + start, first + stop)
            pairs.append(
                torch.stack(
                    (layer.key_buffer[row, :, columns], layer.value_buffer[row, :, columns])
                )
            )
        return torch.stack(pairs)

    def keep_rows(self, keep: Sequence[int]) -> list[int]:
        """Keep only the rows ``keep`` (ascending); returns the old row now in each slot.

        Kept rows past the new end move into the slots of dropped rows, so only they are
        copied; the others stay where they are.
        """
        first = self._growing[0]
        remaining = len(keep)
        order = list(range(first.rows))
        kept = set(keep)
        movers = [row for row in keep if row >= remaining]
        holes = [row for row in range(remaining) if row not in kept]
        if movers:
            source = torch.tensor(movers, device=first.device)
            target = torch.tensor(holes, device=first.device)
            for layer in self._growing:
                for buffer in (layer.key_buffer, layer.value_buffer):
                    live = buffer[:, :, layer.start : layer.end]
                    live.index_copy_(0, target, live.index_select(0, source))
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
        for layer in self._growing:
            layer.rows = remaining
            layer._refresh()
        return order[:remaining]

    def set_width(self, width: int, *, headroom: int) -> None:
        """Make the live region ``width`` columns wide, keeping its right edge.

        Narrowing drops padding columns no row needs. Widening (a joining row longer than
        the batch) zeroes the columns it uncovers, reallocating when there is no room on
        the left. ``headroom``: the decode steps the rows may still take, which bounds the
        free columns a reallocation leaves on the right.
        """
        first = self._growing[0]
        if width <= self.width:
            for layer in self._growing:
                layer.start = layer.end - width
                layer._refresh()
            self._shrink_if_wasteful(headroom)
            return
        self._shrink_layers(len(self.layers))
        if first.end - width < 0:
            left = width - self.width
            columns = width + growth(width, headroom)
            zeroed = self._zeroed(first.rows, width + 1)
            for index, layer in enumerate(self._growing):
                buffers = None if zeroed is None else zeroed[index]
                layer.reallocate(layer.row_capacity, left, columns, buffers)
        for layer in self._growing:
            uncovered = slice(layer.end - width, layer.start)
            layer.key_buffer[: layer.rows, :, uncovered].zero_()
            layer.value_buffer[: layer.rows, :, uncovered].zero_()
            layer.start = layer.end - width
            layer._refresh()

    def _shrink_if_wasteful(self, headroom: int) -> None:
        """Start reallocating the layers tight when they hold more than ``_SHRINK_FACTOR``
        times what the rows use. The first layer is reallocated now, so it always shows
        the shape every layer is headed for; the others follow a share per :meth:`reserve`.
        """
        first = self._growing[0]
        columns = self.width + growth(self.width, headroom)
        if first.row_capacity * first.column_capacity <= _SHRINK_FACTOR * first.rows * columns:
            return
        if self.grown is not None:
            self._unused += self.grown.buffers
            self.grown = None
        self._shrink_target = (first.rows, columns)
        self._shrunk = 0
        self._shrink_layers(_SHRINK_LAYERS_PER_STEP)

    def _shrink_layers(self, count: int) -> None:
        """Reallocate up to ``count`` more layers to the shrink's target shape."""
        if self._shrink_target is None:
            return
        rows, columns = self._shrink_target
        stop = min(self._shrunk + count, len(self.layers))
        for layer in self._growing[self._shrunk : stop]:
            self._unused += (layer.key_buffer, layer.value_buffer)
            layer.reallocate(rows, 0, columns)
        self._shrunk = stop
        if stop == len(self.layers):
            self._shrink_target = None

    def add_rows(self, prefilled: Sequence[Sequence[KvPair]], max_rows: int) -> None:
        """Append rows (each its layers' ``[1, heads, length, dim]`` KV), right-aligned.

        The live region must already be at least as wide as every new row.
        """
        self._shrink_layers(len(self.layers))
        first = self._growing[0]
        wanted = first.rows + len(prefilled)
        if wanted > first.row_capacity:
            capacity = row_growth(wanted, first.row_capacity, max_rows)
            zeroed = self._zeroed(wanted, first.column_capacity)
            for index, layer in enumerate(self._growing):
                buffers = None if zeroed is None else zeroed[index]
                layer.reallocate(capacity, layer.start, layer.column_capacity, buffers)
        for index, layer in enumerate(self._growing):
            for offset, row_layers in enumerate(prefilled):
                row = layer.rows + offset
                keys, values = row_layers[index]
                length = keys.shape[-2]
                padding = slice(layer.start, layer.end - length)
                layer.key_buffer[row, :, padding].zero_()
                layer.value_buffer[row, :, padding].zero_()
                layer.key_buffer[row, :, layer.end - length : layer.end] = keys[0]
                layer.value_buffer[row, :, layer.end - length : layer.end] = values[0]
            layer.rows = wanted
            layer._refresh()

    def to(self, device: torch.device) -> None:
        self._shrink_layers(len(self.layers))
        self._unused.clear()
        self.prepared = self.grown = None
        for layer in self._growing:
            layer.to(device)


class PreparedBuffers:
    """Zeroed key and value buffers of every layer, made ahead of a join that needs them.

    Why: a fresh buffer's pages are mapped on first write, and on the machines measured
    that costs ~0.5 s a GB, several times a copy into mapped memory. A long prompt joining
    the batch widens every row to its length; zeroing the widened buffers in that one step
    stalled every stream. Prepared while the prompt is still prefilled, they are zeroed
    a part per step (:meth:`zero`), and the join finds them mapped.
    """

    def __init__(self, like: torch.Tensor, shape: tuple[int, int, int, int], layers: int) -> None:
        self.rows, self.columns = shape[0], shape[2]
        self.buffers = [like.new_empty(shape) for _ in range(2 * layers)]
        self._flat = [buffer.view(-1) for buffer in self.buffers]
        self._done = 0

    @property
    def elements(self) -> int:
        return sum(flat.numel() for flat in self._flat)

    @property
    def left(self) -> int:
        """Elements not zeroed yet."""
        return self.elements - self._done

    def zero(self, elements: int) -> None:
        """Zero the next ``elements`` elements not zeroed yet."""
        size = self._flat[0].numel()
        end = min(self._done + elements, size * len(self._flat))
        while self._done < end:
            index, offset = divmod(self._done, size)
            stop = min(size, offset + end - self._done)
            self._flat[index][offset:stop].zero_()
            self._done += stop - offset

    def take(self) -> list[KvPair]:
        """Every layer's (keys, values), all zero."""
        self.zero(self.elements)
        pairs = zip(self.buffers[::2], self.buffers[1::2], strict=True)
        return list(pairs)


def row_growth(wanted: int, capacity: int, max_rows: int) -> int:
    """The row capacity that holds ``wanted`` rows: twice ``capacity`` at least, at most
    ``max_rows`` unless more are wanted."""
    return min(max(wanted, 2 * capacity), max(max_rows, wanted))


def growth(width: int, limit: int) -> int:
    """Free columns to add: the width again (at least ``MIN_GROWTH``), at most ``limit``."""
    return max(1, min(max(width, MIN_GROWTH), limit))

"""The forward passes of the batch scheduler (:mod:`.scheduler`) and the KV cache they
run over, with each row's next token chosen from their logits.

Layout: every running sequence is one row of a batched :class:`.kv_cache.BatchKv`,
right-aligned (left padding), so one decode step appends one column for all rows in
place. Each row's real tokens are selected by an attention mask and its own position
ids. The prompts admitted in a step are prefilled together, left-padded in one forward
pass (a prompt's padding is masked out, so its first token depends on its neighbours
only through the rounding of the matrix products, whose algorithm follows the batch's row
count), then each one's KV is written into a free row of the batch; a finished or
cancelled sequence's row is given to another, and padding columns no row needs any more
are trimmed. The buffers are released when the batch empties, or reallocated smaller, a
layer per step, when rows leave most of them unused.

With LoRA adapters loaded, each row names its adapter (or none) in the forward pass, so
requests for different adapters and for the base model share one batch. Decode steps of
Llama-architecture models run :mod:`.llama_decode` instead of the model's forward.

Every method runs on the scheduler's thread with its step lock held.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from penstock.engines.transformers.kv_cache import BatchKv, KvPair, growth, row_growth
from penstock.engines.transformers.llama_decode import LlamaDecoder, Spans, row_spans
from penstock.engines.transformers.lora import BASE_ROW
from penstock.engines.transformers.prompt_kv import PromptChunk, PromptKv
from penstock.engines.transformers.sampling import TokenChoice, choose_tokens
from penstock.engines.transformers.sequence import Sequence, Submission

# One prefilled row: the choices of its sequences' first tokens and its KV per layer.
Prefilled = tuple[list[TokenChoice], list[KvPair]]


@dataclass
class PrefillRow:
    """Tokens to prefill for ``sequences`` (the choices of a new prompt, or one preempted
    choice recomputing its prompt and output), the first ``prefix_length`` of them given
    as KV (``prefix_kv``: ``[layers, 2, kv heads, prefix_length, head dim]``)."""

    submission: Submission
    tokens: list[int]
    sequences: list[Sequence]
    prefix_kv: torch.Tensor | None = None
    # Prefilled over several steps: the KV computed so far, and how many tokens it holds.
    cache: PromptKv | None = None
    computed: int = 0
    # Leading blocks whose KV the prefix cache holds (matched, or stored chunk by chunk).
    stored_blocks: int = 0

    def __post_init__(self) -> None:
        self.computed = self.prefix_length

    @property
    def prefix_length(self) -> int:
        return 0 if self.prefix_kv is None else int(self.prefix_kv.shape[3])


class OnRunner:
    """An attribute of an object holding a model runner (``runner``) that is the runner's
    own: the engine sets the scheduler's model, adapters flag and decoder this way, with
    the step lock held, between two forward passes."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, holder: Any, owner: type | None = None) -> Any:
        return getattr(holder.runner, self.name)

    def __set__(self, holder: Any, value: Any) -> None:
        setattr(holder.runner, self.name, value)


class ModelRunner:
    """The model, its decode batch's KV cache, and the forward passes over them."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        *,
        seed: int,
        rows: int,
        vocab: int,
        ends: frozenset[int],
    ) -> None:
        """``rows``: the batch's most rows; ``vocab``: the vocabulary size; ``ends``: the
        end tokens, banned until a row's ``min_tokens``; ``seed``: of the generator that
        unseeded rows sample from."""
        self.model = model
        # True while ``model`` is a peft wrapper: every forward pass then names each
        # row's adapter.
        self.adapters_loaded = False
        # Decode steps run this instead of ``model``'s forward when set and no adapter is
        # loaded (see :mod:`.llama_decode`).
        self.decoder: LlamaDecoder | None = None
        self.device, self.max_num_seqs = device, rows
        self.vocab_size, self.eos_token_ids = vocab, ends
        self._shared_generator = torch.Generator(device=device)
        self._shared_generator.manual_seed(seed)
        self._cache: BatchKv | None = None
        self._width = 0
        text_config = model.config.get_text_config(decoder=True)
        self._layer_count = int(text_config.num_hidden_layers)

    def new_sequences(self, submission: Submission) -> list[Sequence]:
        return [
            Sequence.start(submission, i, device=self.device, vocab_size=self.vocab_size)
            for i in range(submission.params.n)
        ]

    @property
    def records_experts(self) -> bool:
        """Whether a request's routed experts are recorded (see :mod:`.routing`)."""
        return False

    @property
    def fuses_chunks(self) -> bool:
        """Whether a decode step can carry a prompt chunk (:meth:`decode`'s ``chunk``)."""
        return self.decoder is not None and not self.adapters_loaded

    def decode(
        self, rows: list[Sequence], chunk: tuple[PrefillRow, int] | None = None
    ) -> tuple[list[TokenChoice], Prefilled | None]:
        """One decode step of the whole batch (``rows``, in batch order): each row's
        next token. With ``chunk`` (a row prefilled over several steps and the end of its
        next chunk; only where :attr:`fuses_chunks`), the same pass computes that chunk
        too: the row's :data:`Prefilled` once the chunk ends its prompt, else None."""
        if chunk is not None:
            return self._decode_with_chunk(rows, *chunk)
        return self._decode_rows(rows), None

    def _decode_with_chunk(
        self, rows: list[Sequence], row: PrefillRow, end: int
    ) -> tuple[list[TokenChoice], Prefilled | None]:
        assert self.decoder is not None
        cache = self._prompt_cache(row)
        start = row.computed
        token_ids = torch.tensor(row.tokens[start:end], device=self.device)
        prompt_chunk = PromptChunk(token_ids, start, cache, end == len(row.tokens))
        batch_kv, lengths, tokens, mask = self._decode_inputs(rows)
        spans = self._spans(rows, mask)
        logits, last = self.decoder.step(tokens, lengths, batch_kv, mask, prompt_chunk, spans)
        choices = self._decoded(rows, logits)
        self._prepare_join(rows, row, (end - start) / (len(row.tokens) - start))
        row.computed = end
        if last is None:
            return choices, None
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        return choices, self._first_tokens(row, last, layers)

    def _prepare_join(self, rows: list[Sequence], row: PrefillRow, share: float) -> None:
        """Have the batch's buffers for ``row`` to join ready before its prompt ends, where
        its joining would reallocate them: prepared at its first chunk beside ``rows``,
        zeroed ``share`` x 2 of them per chunk (``share``: the part of the prompt left that
        this chunk computes)."""
        cache = self._cache
        assert cache is not None
        wanted, length = cache.rows + len(row.sequences), len(row.tokens)
        if not cache.reallocates(wanted, length):
            return
        rows_wanted = row_growth(wanted, cache.row_capacity, self.max_num_seqs)
        headroom = max(seq.remaining_steps for seq in rows + row.sequences)
        width = max(self._width, length)
        prepared = cache.prepare(rows_wanted, width + growth(width, headroom), width + 1)
        prepared.zero(math.ceil(prepared.elements * min(2 * share, 1.0)))

    def _decode_inputs(
        self, rows: list[Sequence]
    ) -> tuple[BatchKv, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The batch's cache (room made for this step's column), each row's position and
        token, and the mask when a row is shorter than the batch."""
        width = self._width
        kv_lengths = [seq.kv_length for seq in rows]
        lengths = torch.tensor(kv_lengths, device=self.device)
        token_ids = torch.tensor([seq.next_token for seq in rows], device=self.device)
        cache = self._cache
        assert cache is not None
        cache.reserve(1, limit=max(seq.remaining_steps for seq in rows))
        attention_mask = None
        if min(kv_lengths) < width:
            columns = torch.arange(width + 1, device=self.device)
            attention_mask = (columns >= (width - lengths).unsqueeze(1))[:, None, None, :]
        return cache, lengths, token_ids, attention_mask

    def _spans(self, rows: list[Sequence], mask: torch.Tensor | None) -> Spans | None:
        """Where rows of different lengths attend over their own columns (see
        :func:`.llama_decode.row_spans`); None without a mask (every row is as long)."""
        if mask is None:
            return None
        return row_spans([seq.kv_length + 1 for seq in rows], self._width + 1)

    def _decoded(self, rows: list[Sequence], logits: torch.Tensor | None) -> list[TokenChoice]:
        assert logits is not None
        self._width += 1
        for seq in rows:
            seq.kv_length += 1
        return choose_tokens(
            logits, [seq.sampling(self.eos_token_ids) for seq in rows], self._shared_generator
        )

    def _decode_rows(self, rows: list[Sequence]) -> list[TokenChoice]:
        width = self._width
        cache, lengths, token_ids, mask = self._decode_inputs(rows)
        if self.fuses_chunks:
            assert self.decoder is not None
            spans = self._spans(rows, mask)
            logits = self.decoder.decode(token_ids, lengths, cache, mask, spans)
            return self._decoded(rows, logits)
        columns = torch.arange(width + 1, device=self.device).unsqueeze(0)
        output = self.model(
            input_ids=token_ids.unsqueeze(1),
            attention_mask=(columns >= (width - lengths).unsqueeze(1)).long(),
            position_ids=lengths.unsqueeze(1),
            cache=cache,
            use_cache=True,
            **self._adapter_names(seq.submission for seq in rows),
        )
        return self._decoded(rows, output.logits[:, -1, :])

    def prefill(self, rows: list[PrefillRow]) -> list[Prefilled]:
        """Prefill ``rows`` in one forward pass: per row, its sequences' first tokens and
        its whole KV (its sequences' KV lengths set). A row with a cached prefix is
        prefilled alone, its prefix's KV given to the model as the cache."""
        longest = max(len(row.tokens) - row.prefix_length for row in rows)
        output = self.model(
            **self._prefill_inputs(rows, longest),
            cache=self._prefix_cache(rows[0]),
            use_cache=True,
            logits_to_keep=1,
            **self._adapter_names(row.submission for row in rows),
        )
        return [self._prefilled(output, index, row) for index, row in enumerate(rows)]

    def prefill_chunk(self, row: PrefillRow, end: int) -> Prefilled | None:
        """Compute the KV of ``row.tokens[row.computed:end]`` over the KV before them (a
        text row prefilled over several steps); the row's :data:`Prefilled` once ``end``
        reaches its last token, else None."""
        cache = self._prompt_cache(row)
        start = row.computed
        output = self.model(
            input_ids=torch.tensor([row.tokens[start:end]], device=self.device),
            position_ids=torch.arange(start, end, device=self.device).unsqueeze(0),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            **self._adapter_names([row.submission]),
        )
        row.computed = end
        if end < len(row.tokens):
            return None
        return self._prefilled(output, 0, row)

    def _prompt_cache(self, row: PrefillRow) -> PromptKv:
        """The KV ``row``'s chunks are computed over, as long as its prompt; its cached
        prefix written in first."""
        if row.cache is None:
            row.cache = PromptKv(self._layer_count, len(row.tokens))
            if row.prefix_kv is not None:
                for index, layer in enumerate(row.prefix_kv):
                    row.cache.update(layer[0].unsqueeze(0), layer[1].unsqueeze(0), index)
        return row.cache

    def _prefix_cache(self, row: PrefillRow) -> DynamicCache:
        cache = DynamicCache()
        if row.prefix_kv is not None:
            for index, layer in enumerate(row.prefix_kv):
                cache.update(layer[0].unsqueeze(0), layer[1].unsqueeze(0), index)
        return cache

    def _prefilled(self, output: Any, index: int, row: PrefillRow) -> Prefilled:
        # The row's tokens are its last columns (left padding before them).
        first = -len(row.tokens)
        layers = [
            (
                layer.keys[index : index + 1, :, first:],
                layer.values[index : index + 1, :, first:],
            )
            for layer in output.cache.layers
        ]
        return self._first_tokens(row, output.logits[index : index + 1, -1, :], layers)

    def _first_tokens(
        self, row: PrefillRow, logits: torch.Tensor, layers: list[KvPair]
    ) -> Prefilled:
        """The first token of each of ``row``'s sequences from the logits ``[1, vocab]``
        after its prompt, and their KV lengths set."""
        logits = logits.expand(len(row.sequences), -1)
        choices = choose_tokens(
            logits,
            [seq.sampling(self.eos_token_ids) for seq in row.sequences],
            self._shared_generator,
        )
        for seq in row.sequences:
            seq.kv_length = len(row.tokens)
        return choices, layers

    def _prefill_inputs(self, rows: list[PrefillRow], longest: int) -> dict[str, Any]:
        if len(rows) == 1:
            row = rows[0]
            start = row.prefix_length
            prompt = torch.tensor([row.tokens[start:]], device=self.device)
            inputs: dict[str, Any] = {"input_ids": prompt}
            if row.submission.embed is not None:
                inputs = {"inputs_embeds": row.submission.embed(self.model, prompt)}
            if start:
                positions = torch.arange(start, len(row.tokens), device=self.device)
                inputs["position_ids"] = positions.unsqueeze(0)
            return inputs
        # Left padding: every prompt's last token is in the last column, where the
        # logits are kept. Padding positions are masked out and their KV dropped.
        ids = torch.zeros((len(rows), longest), dtype=torch.long)
        attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for index, row in enumerate(rows):
            length = len(row.tokens)
            ids[index, longest - length :] = torch.tensor(row.tokens)
            attention_mask[index, longest - length :] = 1
        positions = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
        return {
            "input_ids": ids.to(self.device),
            "attention_mask": attention_mask.to(self.device),
            "position_ids": positions.to(self.device),
        }

    def rebuild_batch(
        self, running: list[Sequence], joined: list[tuple[Sequence, list[KvPair]]]
    ) -> list[Sequence] | None:
        """Drop finished rows, trim padding nobody needs, append newly prefilled rows;
        the batch's rows in their new order, or None when nothing changed."""
        keep = [i for i, seq in enumerate(running) if seq.in_batch]
        if len(keep) == len(running) and not joined:
            return None
        if self._cache is not None:
            order = self._cache.keep_rows(keep) if len(keep) != len(running) else keep
            survivors = [running[i] for i in order]
        else:
            survivors = []
        rows = survivors + [seq for seq, _ in joined]
        if not rows:
            self.reset()
            return rows
        width = max(seq.kv_length for seq in rows)
        headroom = max(seq.remaining_steps for seq in rows)
        if self._cache is None:
            self._cache = BatchKv(joined[0][1], row_capacity=len(joined))
        self._cache.set_width(width, headroom=headroom)
        if joined:
            self._cache.add_rows([layers for _, layers in joined], self.max_num_seqs)
        self._width = width
        return rows

    def row_kv(self, row: int, length: int, start: int, stop: int) -> torch.Tensor:
        """The KV of tokens ``[start, stop)`` of batch row ``row``, which holds ``length``
        tokens: ``[layers, 2, kv heads, stop - start, head dim]``, a copy."""
        assert self._cache is not None
        return self._cache.row_kv(row, length, start, stop)

    def reset(self) -> None:
        """Release the batch's KV cache (the batch emptied, or its step failed)."""
        self._cache = None
        self._width = 0

    def move_kv(self, device: torch.device) -> None:
        """Move the KV of held sequences."""
        if self._cache is not None:
            self._cache.to(device)

    def _adapter_names(self, submissions: Iterable[Submission]) -> dict[str, Any]:
        if not self.adapters_loaded:
            return {}
        return {"adapter_names": [s.adapter or BASE_ROW for s in submissions]}

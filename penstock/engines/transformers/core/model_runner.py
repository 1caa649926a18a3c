"""The forward passes of the batch scheduler (:mod:`.scheduler`) over the KV pool's
blocks, with each row's next token chosen from their logits.

Every running sequence is one row of the decode batch. Its KV is in its blocks of the
pool's arena (:mod:`.kv_cache`): a decode step writes each row's new token into its next
slot and attends over the row's own slots, whatever the other rows' lengths, so rows join
and leave the batch without copying any KV. The prompts admitted in a step are
prefilled together, left-padded in one forward pass (a prompt's padding is masked out, so
its first token depends on its neighbours only through the rounding of the matrix
products, whose algorithm follows the batch's row count); :mod:`.prefill_plan` writes
each one's KV into its blocks.

With LoRA adapters loaded, each row names its adapter (or none) in the forward pass, so
requests for different adapters and for the base model share one batch. Decode steps of
Llama-architecture models run :mod:`.llama_decode` instead of the model's forward.

Every method runs on the scheduler's thread with its step lock held.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from penstock.engines.transformers.core.kv_cache import GatheredCache, KvArena, KvPair, StepKv
from penstock.engines.transformers.core.llama_decode import LlamaDecoder
from penstock.engines.transformers.core.prompt_kv import PromptChunk, PromptKv
from penstock.engines.transformers.core.prompt_logprobs import PromptLogprobs
from penstock.engines.transformers.core.sampling import TokenChoice, choose_tokens
from penstock.engines.transformers.core.sequence import Sequence, Submission
from penstock.engines.transformers.features.lora import BASE_ROW

# transformers after 5.19 names a model's ``past_key_values`` (its argument and its
# output) ``cache``; vLLM 0.32 holds 5.19, beside which Penstock installs.
_CACHE_NAME = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


def cache_argument(cache: Any) -> dict[str, Any]:
    """The keyword that gives a model ``cache`` as its KV, in this transformers' name."""
    return {_CACHE_NAME: cache}


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
    # Leading tokens whose KV is in the row's blocks (matched, or written chunk by chunk).
    written: int = 0

    def __post_init__(self) -> None:
        self.computed = self.written = self.prefix_length

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
    """The model, the KV pool's arena, and the forward passes over them."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        *,
        seed: int,
        rows: int,
        vocab: int,
        ends: frozenset[int],
        arena: KvArena,
    ) -> None:
        """``rows``: the batch's most rows; ``vocab``: the vocabulary size; ``ends``: the
        end tokens, banned until a row's ``min_tokens``; ``seed``: of the generator that
        unseeded rows sample from; ``arena``: the KV pool's blocks."""
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
        self.arena = arena
        text_config = model.config.get_text_config(decoder=True)
        self._layer_count = int(text_config.num_hidden_layers)

    # Whether prompt logprobs come from the prefill's own passes (see :mod:`.prompt_logprobs`).
    gathers_prompt_logprobs = True

    def new_sequences(self, submission: Submission) -> list[Sequence]:
        """The choices of a new submission; its prompt logprobs' gathering when asked."""
        params = submission.params
        if params.prompt_logprobs is not None and self.gathers_prompt_logprobs:
            submission.prompt_logprobs = PromptLogprobs(
                submission.prompt_ids, params.prompt_logprobs, params.prompt_temperature
            )
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

    @property
    def keeps_kv_in_pool(self) -> bool:
        """Whether a prefilled row's KV is written into its blocks (decode reads it there)."""
        return True

    def _decode_with_chunk(
        self, rows: list[Sequence], row: PrefillRow, end: int
    ) -> tuple[list[TokenChoice], Prefilled | None]:
        assert self.decoder is not None
        cache = self._prompt_cache(row)
        start = row.computed
        token_ids = torch.tensor(row.tokens[start:end], device=self.device)
        every_logit = row.submission.wants_prompt_logits
        prompt_chunk = PromptChunk(token_ids, start, cache, end == len(row.tokens), every_logit)
        step, positions, tokens = self._decode_inputs(rows)
        logits, chunk_logits = self.decoder.step(tokens, positions, step, prompt_chunk)
        choices = self._decoded(rows, logits)
        row.computed = end
        if every_logit:
            self._gather_prompt_logprobs(row, start, chunk_logits)
        if not prompt_chunk.last:
            return choices, None
        assert chunk_logits is not None
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        return choices, self._first_tokens(row, chunk_logits[-1:], layers)

    def _decode_inputs(
        self, rows: list[Sequence]
    ) -> tuple[StepKv | None, torch.Tensor, torch.Tensor]:
        """The step's view of the rows' blocks, each row's position and token."""
        positions = torch.tensor([seq.kv_length for seq in rows], device=self.device)
        token_ids = torch.tensor([seq.next_token for seq in rows], device=self.device)
        if not rows:
            return None, positions, token_ids
        blocks = [([block.block_id for block in seq.blocks], seq.kv_length) for seq in rows]
        return StepKv(self.arena, blocks), positions, token_ids

    def _decoded(self, rows: list[Sequence], logits: torch.Tensor | None) -> list[TokenChoice]:
        assert logits is not None
        for seq in rows:
            seq.kv_length += 1
        return choose_tokens(
            logits, [seq.sampling(self.eos_token_ids) for seq in rows], self._shared_generator
        )

    def _decode_rows(self, rows: list[Sequence]) -> list[TokenChoice]:
        step, positions, token_ids = self._decode_inputs(rows)
        assert step is not None
        if self.fuses_chunks:
            assert self.decoder is not None
            return self._decoded(rows, self.decoder.decode(token_ids, positions, step))
        width = step.width
        columns = torch.arange(width, device=self.device).unsqueeze(0)
        output = self.model(
            input_ids=token_ids.unsqueeze(1),
            attention_mask=(columns >= (width - 1 - positions).unsqueeze(1)).long(),
            position_ids=positions.unsqueeze(1),
            **cache_argument(GatheredCache(step, self._layer_count)),
            use_cache=True,
            **self._adapter_names(seq.submission for seq in rows),
        )
        return self._decoded(rows, output.logits[:, -1, :])

    def prefill(self, rows: list[PrefillRow]) -> list[Prefilled]:
        """Prefill ``rows`` in one forward pass: per row, its sequences' first tokens and
        its whole KV (its sequences' KV lengths set). A row with a cached prefix is
        prefilled alone, its prefix's KV given to the model as the cache."""
        longest = max(len(row.tokens) - row.prefix_length for row in rows)
        # A row keeping every logit is prefilled alone (:func:`.prefill_plan.prefill_groups`).
        every_logit = rows[0].submission.wants_prompt_logits
        output = self.model(
            **self._prefill_inputs(rows, longest),
            **cache_argument(self._prefix_cache(rows[0])),
            use_cache=True,
            logits_to_keep=0 if every_logit else 1,
            **self._adapter_names(row.submission for row in rows),
        )
        if every_logit:
            self._gather_prompt_logprobs(rows[0], rows[0].prefix_length, output.logits[0])
        return [self._prefilled(output, index, row) for index, row in enumerate(rows)]

    def prefill_chunk(self, row: PrefillRow, end: int) -> Prefilled | None:
        """Compute the KV of ``row.tokens[row.computed:end]`` over the KV before them (a
        text row prefilled over several steps); the row's :data:`Prefilled` once ``end``
        reaches its last token, else None."""
        cache = self._prompt_cache(row)
        start = row.computed
        every_logit = row.submission.wants_prompt_logits
        output = self.model(
            input_ids=torch.tensor([row.tokens[start:end]], device=self.device),
            position_ids=torch.arange(start, end, device=self.device).unsqueeze(0),
            **cache_argument(cache),
            use_cache=True,
            logits_to_keep=0 if every_logit else 1,
            **self._adapter_names([row.submission]),
        )
        if every_logit:
            self._gather_prompt_logprobs(row, start, output.logits[0])
        row.computed = end
        if end < len(row.tokens):
            return None
        return self._prefilled(output, 0, row)

    def _gather_prompt_logprobs(
        self, row: PrefillRow, start: int, logits: torch.Tensor | None
    ) -> None:
        """Reduce the logits ``[tokens, vocab]`` of ``row``'s positions from ``start`` on
        to its prompt logprobs."""
        gathering = row.submission.prompt_logprobs
        assert gathering is not None and logits is not None
        gathering.add(start, logits)

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
            for layer in getattr(output, _CACHE_NAME).layers
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
        """Drop finished rows and append newly prefilled ones (their KV is in their
        blocks already); the batch's rows in their new order, or None when nothing changed."""
        kept = [seq for seq in running if seq.in_batch]
        if len(kept) == len(running) and not joined:
            return None
        return kept + [seq for seq, _ in joined]

    def reset(self) -> None:
        """Forget the batch (its step failed). Its KV is in blocks the scheduler frees."""

    def move_kv(self, device: torch.device) -> None:
        """Move the pool's KV (every block's, held or cached)."""
        self.arena.to(device)

    def _adapter_names(self, submissions: Iterable[Submission]) -> dict[str, Any]:
        if not self.adapters_loaded:
            return {}
        return {"adapter_names": [s.adapter or BASE_ROW for s in submissions]}

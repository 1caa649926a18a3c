"""The prefill half of a scheduler step: which rows are prefilled together, the pool
blocks each row holds, and the rows prefilled over several steps (chunked prefill).

A chunk's size is counted in token-equivalents: each token counts one, plus its
attention over the prompt's tokens before it (:func:`context_per_token`), so a long
prompt's later chunks, which attend over more, take fewer tokens and every step costs
about the same.

A row is a new prompt for all its choices, or one preempted choice recomputing its
prompt and output (see :mod:`.scheduler`). Its blocks come from :mod:`.block_manager`:
the cached blocks its tokens start with, then new ones (full blocks shared by the row's
choices, the last partial block each choice's own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from penstock.engines.transformers.core.block_manager import (
    BLOCK_SIZE,
    BlockManager,
    Match,
    chain_hashes,
)
from penstock.engines.transformers.core.chunk_pacing import LEAST_CHUNK_TOKENS
from penstock.engines.transformers.core.kv_cache import KvArena, KvPair
from penstock.engines.transformers.core.model_runner import ModelRunner, Prefilled, PrefillRow
from penstock.engines.transformers.core.prompt_logprobs import PROMPT_LOGPROB_CHUNK
from penstock.engines.transformers.core.sampling import TokenChoice
from penstock.engines.transformers.core.sequence import Sequence, Submission

# Prompts prefilled in one forward pass: at most this many tokens, padding included.
PREFILL_BATCH_TOKENS = 2048

Claimed = tuple[PrefillRow, Match]
# A chunk to compute: the row and the end of its next chunk.
NextChunk = tuple[Claimed, int]
Claim = Callable[[Submission, list[int], list[Sequence]], Claimed]
Outbox = dict[Submission, list[Any]]
# A sequence that goes on decoding, with its row's KV per layer.
Joined = tuple[Sequence, list[KvPair]]


def context_per_token(config: Any) -> float:
    """Tokens of context whose attention costs what one token's linear layers do (~3,000 on
    SmolLM2-135M): a token's linear layers multiply ~2 x their weights, its attention over
    ``L`` tokens before it ~4 x ``L`` x the query width per layer. Infinite when the
    config does not say (attention not counted)."""
    try:
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        inner = int(config.intermediate_size)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return float("inf")
    weights = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inner
    return weights / (2 * heads * head_dim)


def chunk_cost(start: int, tokens: int, context: float) -> float:
    """Token-equivalents of ``tokens`` prompt tokens from position ``start``."""
    return tokens + tokens * (start + (tokens - 1) / 2) / context


def chunk_end(start: int, length: int, budget: float, context: float) -> int:
    """The end of the chunk of a ``length``-token prompt that starts at ``start`` and costs
    at most ``budget`` token-equivalents (at least one token): ``n`` tokens from ``start``
    cost ``n + n * (start + (n - 1) / 2) / context``."""
    low, high = 1, length - start
    while low < high:
        middle = (low + high + 1) // 2
        if chunk_cost(start, middle, context) <= budget:
            low = middle
        else:
            high = middle - 1
    return start + low


def prefill_groups(
    rows: Iterable[tuple[Submission, list[int], list[Sequence]]], claim: Claim
) -> Iterator[list[Claimed]]:
    """``rows`` in order, as the groups prefilled together, each row with its blocks.

    The caller prefills (and caches) each group before asking for the next, so a prompt
    takes the blocks of one prefilled just before it. Text rows without a cached prefix
    join the group before them while the padded batch stays within
    ``PREFILL_BATCH_TOKENS``: one pass reads the weights once for all of them, and at
    many rows the linear layers run as one large matrix product. A row with a cached
    prefix or image features is prefilled alone; a row starting with the same block as
    one in the group waits for that one's KV instead of computing it again.
    """
    group: list[Claimed] = []
    heads: set[int] = set()
    longest = 0
    for submission, tokens, sequences in rows:
        head = chain_hashes(tokens[:BLOCK_SIZE], submission.kv_salt)
        if group and heads.intersection(head):
            yield group
            group, heads, longest = [], set(), 0
        row, match = claim(submission, tokens, sequences)
        alone = row.prefix_kv is not None or submission.embed is not None
        # A row keeping every logit must not hold the other rows' logits too.
        alone = alone or submission.wants_prompt_logits
        fits = (len(group) + 1) * max(longest, len(tokens)) <= PREFILL_BATCH_TOKENS
        if group and (alone or not fits):
            yield group
            group, heads, longest = [], set(), 0
        group.append((row, match))
        heads.update(head)
        longest = max(longest, len(tokens))
        if alone:
            yield group
            group, heads, longest = [], set(), 0
    if group:
        yield group


def claim_blocks(
    pool: BlockManager,
    arena: KvArena,
    submission: Submission,
    tokens: list[int],
    sequences: list[Sequence],
) -> Claimed:
    """Hold the blocks of ``tokens`` for ``sequences``; the row to prefill (its matched
    prefix's KV read from ``arena``) and its match."""
    if submission.embed is None and not submission.wants_prompt_logits:
        match = pool.match(tokens, submission.kv_salt)
    else:
        # Image features are not in the token ids the blocks are named by; a prompt whose
        # logprobs are asked for computes every token's logits.
        match = Match([], [])
    full = len(tokens) // BLOCK_SIZE
    partial = 1 if len(tokens) % BLOCK_SIZE else 0
    fresh = pool.allocate(full - len(match.blocks) + partial * len(sequences))
    shared = match.blocks + fresh[: full - len(match.blocks)]
    own = fresh[full - len(match.blocks) :]
    for index, seq in enumerate(sequences):
        blocks = shared if index == 0 else pool.share(shared)
        seq.blocks = blocks + own[index : index + partial]
        seq.kv_epoch = pool.epoch
    if submission.cached_tokens is None:
        submission.cached_tokens = match.tokens
    pool.cached_tokens += match.tokens
    pool.prefill_tokens += len(tokens) - match.tokens
    prefix_kv = None
    if match.blocks:
        ids = [block.block_id for block in match.blocks]
        prefix_kv = arena.read(arena.slots(ids, 0, match.tokens))
    return PrefillRow(submission, tokens, sequences, prefix_kv), match


def _logits_bound(row: PrefillRow, end: int) -> int:
    """``end``, or less for a row keeping every logit: its chunk's logits are held at once
    (:data:`.prompt_logprobs.PROMPT_LOGPROB_CHUNK` tokens at most)."""
    if row.submission.wants_prompt_logits:
        return min(end, row.computed + PROMPT_LOGPROB_CHUNK)
    return end


class Prefiller:
    """Prefills a step's admitted requests within the step's token budget.

    A text row longer than the budget left is prefilled a chunk per step (``chunked``,
    oldest first, ahead of new rows), each chunk over the KV of the ones before it, so
    the rows decoding beside it keep taking a token every step. Where the runner
    fuses chunks into decode steps, the scheduler computes them (:meth:`next_chunk`,
    :meth:`computed`) and :meth:`run` only queues long rows. ``context``: see
    :func:`context_per_token`. The scheduler's
    ``accept`` takes each first token, ``cancel`` ends a choice cancelled before its
    prefill, ``send`` delivers the chunks gathered so far.
    """

    def __init__(
        self,
        runner: ModelRunner,
        pool: BlockManager,
        *,
        accept: Callable[[Sequence, TokenChoice, Outbox], None],
        cancel: Callable[[Sequence, Outbox], None],
        send: Callable[[Outbox], None],
        context: float,
    ) -> None:
        self.runner = runner
        self.context = context
        self.pool = pool
        self._accept, self._cancel, self._send = accept, cancel, send
        self.chunked: list[Claimed] = []

    def sequences(self) -> list[Sequence]:
        """The sequences of the rows being prefilled over several steps."""
        return [seq for row, _ in self.chunked for seq in row.sequences]

    def drop_cancelled(self) -> None:
        self.chunked = [entry for entry in self.chunked if not entry[0].submission.should_stop()]

    def next_chunk(self, budget: float) -> NextChunk | None:
        """The oldest row prefilled over several steps and the end of its next chunk
        beside decoding rows: within ``budget`` token-equivalents, or
        :data:`.chunk_pacing.LEAST_CHUNK_TOKENS` tokens when more; None when there is
        none."""
        if not self.chunked:
            return None
        entry = self.chunked[0]
        row = entry[0]
        end = chunk_end(row.computed, len(row.tokens), budget, self.context)
        end = max(end, min(row.computed + LEAST_CHUNK_TOKENS, len(row.tokens)))
        return entry, _logits_bound(row, end)

    def computed(
        self, entry: Claimed, prefilled: Prefilled | None, joined: list[Joined], outbox: Outbox
    ) -> None:
        """A chunk of ``entry`` was computed; once its prompt is (``prefilled``) its
        sequences join."""
        self._store_computed(*entry)
        if prefilled is not None:
            self.chunked.remove(entry)
            joined += self._join(*entry, prefilled, outbox)

    def run(
        self, admitted: list[Submission], budget: float, outbox: Outbox, *, chunks: bool = True
    ) -> list[Joined]:
        """Prefill within ``budget`` token-equivalents; the sequences that join the batch.
        Without ``chunks``, rows prefilled over several steps are only queued."""
        joined: list[Joined] = []
        if chunks:
            budget = self._chunks(budget, joined, outbox)
        rows = (
            (submission, tokens, sequences)
            for submission in admitted
            for tokens, sequences in self._rows_of(submission, outbox)
        )
        for group in prefill_groups(rows, self._claim):
            row = group[0][0]
            if len(group) == 1 and row.submission.embed is None:
                whole = len(row.tokens)
                if whole - row.computed > budget or _logits_bound(row, whole) < whole:
                    self.chunked.append(group[0])
                    if chunks:
                        budget = self._chunks(budget, joined, outbox)
                    continue
            budget -= sum(len(row.tokens) - row.computed for row, _ in group)
            prefilled = self.runner.prefill([row for row, _ in group])
            for (row, match), done in zip(group, prefilled, strict=True):
                joined += self._join(row, match, done, outbox)
            # Each first token leaves as soon as it exists: TTFT does not wait for the
            # other prefills of this step.
            self._send(outbox)
        return joined

    def _rows_of(
        self, submission: Submission, outbox: Outbox
    ) -> list[tuple[list[int], list[Sequence]]]:
        """What ``submission`` prefills: its prompt for all its choices, or (preempted)
        each unfinished choice's prompt and output."""
        if submission.sequences:
            resumed = [seq for seq in submission.sequences if not seq.finished]
            for seq in resumed:
                seq.preempted = False
            return [(seq.kv_tokens, [seq]) for seq in resumed]
        submission.unfinished = submission.params.n
        submission.sequences = sequences = self.runner.new_sequences(submission)
        if submission.should_stop():
            for seq in sequences:
                self._cancel(seq, outbox)
            return []
        return [(submission.prompt_ids, sequences)]

    def _claim(
        self, submission: Submission, tokens: list[int], sequences: list[Sequence]
    ) -> Claimed:
        return claim_blocks(self.pool, self.runner.arena, submission, tokens, sequences)

    def _chunks(self, budget: float, joined: list[Joined], outbox: Outbox) -> float:
        """The next chunks of the rows prefilled over several steps, oldest first, within
        ``budget`` token-equivalents; returns the budget left."""
        for entry in list(self.chunked):
            if budget < 1:
                break
            row, match = entry
            end = _logits_bound(row, chunk_end(row.computed, len(row.tokens), budget, self.context))
            budget -= chunk_cost(row.computed, end - row.computed, self.context)
            done = self.runner.prefill_chunk(row, end)
            self._store_computed(row, match)
            if done is not None:
                self.chunked.remove(entry)
                joined += self._join(row, match, done, outbox)
                self._send(outbox)
        return budget

    def _store_computed(self, row: PrefillRow, match: Match) -> None:
        """Write and cache the full blocks of a row prefilled over several steps as its
        chunks fill them: each step copies the blocks of its own chunk, where writing the
        whole prompt when it ends made that step copy all of its KV at once."""
        if row.cache is not None:
            layers = [(layer.keys, layer.values) for layer in row.cache.layers]
            self._write(row, layers, row.computed // BLOCK_SIZE * BLOCK_SIZE)
            self._store(row, match, row.computed)

    def _write(self, row: PrefillRow, layers: list[KvPair], end: int) -> None:
        """Write the row's KV (``layers``: from its first token) up to token ``end`` into
        its blocks, from its first token not written yet: full blocks into the blocks its
        sequences share, the prompt's last partial block into each one's own."""
        if not self.runner.keeps_kv_in_pool or end <= row.written:
            return
        arena = self.runner.arena
        shared_end = min(end, len(row.tokens) // BLOCK_SIZE * BLOCK_SIZE)
        if shared_end > row.written:
            ids = [block.block_id for block in row.sequences[0].blocks]
            arena.write_prompt(arena.slots(ids, row.written, shared_end), layers, row.written)
        if end > shared_end:
            for seq in row.sequences:
                ids = [block.block_id for block in seq.blocks]
                arena.write_prompt(arena.slots(ids, shared_end, end), layers, shared_end)
        row.written = end

    def _store(self, row: PrefillRow, match: Match, end: int) -> None:
        """Make the row's full blocks among its first ``end`` tokens matchable, those not
        cached yet (their KV written)."""
        first = max(row.stored_blocks, len(match.blocks))
        last = min(end // BLOCK_SIZE, len(match.hashes))
        if last <= first:
            return
        self.pool.store(row.sequences[0].blocks, match.hashes[:last], row.tokens, first)
        row.stored_blocks = last

    def _join(
        self, row: PrefillRow, match: Match, prefilled: Prefilled, outbox: Outbox
    ) -> list[Joined]:
        """Cache a prefilled row's new full blocks and take its sequences' first tokens."""
        choices, layers = prefilled
        self._write(row, layers, len(row.tokens))
        self._store(row, match, len(row.tokens))
        joined = []
        for seq, choice in zip(row.sequences, choices, strict=True):
            self._accept(seq, choice, outbox)
            if not seq.finished:
                joined.append((seq, layers))
        return joined

"""Which rows a scheduler step prefills together, and the pool blocks each row holds.

A row is a new prompt for all its choices, or one preempted choice recomputing its
prompt and output (see :mod:`.scheduler`). Its blocks come from :mod:`.block_manager`:
the cached blocks its tokens start with, then new ones (full blocks shared by the row's
choices, the last partial block each choice's own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from penstock.engines.transformers.block_manager import (
    BLOCK_SIZE,
    BlockManager,
    Match,
    chain_hashes,
)
from penstock.engines.transformers.model_runner import PrefillRow
from penstock.engines.transformers.sequence import Sequence, Submission

# Prompts prefilled in one forward pass: at most this many tokens, padding included.
PREFILL_BATCH_TOKENS = 2048

Claimed = tuple[PrefillRow, Match]
Claim = Callable[[Submission, list[int], list[Sequence]], Claimed]


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
        head = chain_hashes(tokens[:BLOCK_SIZE], submission.adapter)
        if group and heads.intersection(head):
            yield group
            group, heads, longest = [], set(), 0
        row, match = claim(submission, tokens, sequences)
        alone = row.prefix_kv is not None or submission.embed is not None
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
    pool: BlockManager, submission: Submission, tokens: list[int], sequences: list[Sequence]
) -> Claimed:
    """Hold the blocks of ``tokens`` for ``sequences``; the row to prefill and its match."""
    if submission.embed is None:
        match = pool.match(tokens, submission.adapter)
    else:
        # Image features are not in the token ids the blocks are named by.
        match = Match([], [])
    full = len(tokens) // BLOCK_SIZE
    partial = 1 if len(tokens) % BLOCK_SIZE else 0
    fresh = pool.allocate(full - len(match.blocks) + partial * len(sequences))
    shared = match.blocks + fresh[: full - len(match.blocks)]
    own = fresh[full - len(match.blocks) :]
    for index, seq in enumerate(sequences):
        blocks = shared if index == 0 else pool.share(shared)
        seq.blocks = blocks + own[index : index + partial]
    if submission.cached_tokens is None:
        submission.cached_tokens = match.tokens
    pool.cached_tokens += match.tokens
    pool.prefill_tokens += len(tokens) - match.tokens
    return PrefillRow(submission, tokens, sequences, match.kv()), match

"""The batched sampler: each row's filters and generator apply to that row only."""

from __future__ import annotations

import torch

from penstock.engines.transformers.core.sampling import (
    PenaltyState,
    RowSampling,
    SamplingParams,
    choose_tokens,
)

VOCAB = 50


def row(params: SamplingParams, seed: int | None = None, penalties=None) -> RowSampling:
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    return RowSampling(params, 0, [], generator, penalties)


def logits(rows: int) -> torch.Tensor:
    return torch.linspace(0, 4, VOCAB).repeat(rows, 1)


def test_top_k_and_top_p_and_min_p_keep_only_likely_tokens() -> None:
    shared = torch.Generator().manual_seed(0)
    picks = {"top_k": set(), "top_p": set(), "min_p": set()}
    for seed in range(200):
        rows = [
            row(SamplingParams(top_k=3), seed),
            row(SamplingParams(top_p=0.2), seed),
            row(SamplingParams(min_p=0.5), seed),
        ]
        for name, choice in zip(picks, choose_tokens(logits(3), rows, shared), strict=True):
            picks[name].add(choice.token_id)
    assert picks["top_k"] == {47, 48, 49}
    assert picks["top_p"] <= set(range(40, 50)) and len(picks["top_p"]) > 1
    # Probability >= half the top one: logit within ln(2) of the best (spacing 4/49).
    assert picks["min_p"] <= {41, 42, 43, 44, 45, 46, 47, 48, 49}


def test_a_seeded_row_draws_the_same_whatever_its_neighbours() -> None:
    shared = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=2.0)
    alone = choose_tokens(logits(1), [row(params, seed=5)], shared)[0].token_id
    for neighbours in range(1, 4):
        rows = [row(SamplingParams(temperature=3.0)) for _ in range(neighbours)]
        rows.append(row(params, seed=5))
        together = choose_tokens(logits(neighbours + 1), rows, shared)
        assert together[-1].token_id == alone


def test_greedy_rows_take_the_argmax_and_min_tokens_bans_stop_ids() -> None:
    shared = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0, min_tokens=2)
    banned = RowSampling(greedy, 0, [49], None, None)
    free = RowSampling(greedy, 2, [49], None, None)
    first, second = choose_tokens(logits(2), [banned, free], shared)
    assert (first.token_id, second.token_id) == (48, 49)


def test_penalties_push_seen_tokens_down() -> None:
    shared = torch.Generator().manual_seed(0)
    state = PenaltyState([49], VOCAB, torch.device("cpu"))
    state.record(48)
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=2.0)
    (choice,) = choose_tokens(logits(1), [row(params, penalties=state)], shared)
    assert choice.token_id == 47

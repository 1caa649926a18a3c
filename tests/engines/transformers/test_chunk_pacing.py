"""Chunks beside decoding rows sized from measured step times."""

from __future__ import annotations

import pytest

from penstock.engines.transformers.args import parse_args
from penstock.engines.transformers.core.chunk_pacing import ChunkPacer


def test_without_pacing_a_step_computes_its_whole_budget() -> None:
    assert ChunkPacer(None).budget(2000.0) == 2000.0


def test_a_chunk_waits_for_a_timed_decode_step_then_starts_small() -> None:
    pacer = ChunkPacer(2.0)
    assert pacer.budget(2000.0) == 0.0
    pacer.decoded(0.020)
    assert pacer.budget(2000.0) == 4.0
    assert pacer.budget(3.0) == 3.0


def test_chunks_grow_at_most_twofold_toward_the_target_step_time() -> None:
    pacer = ChunkPacer(2.0)
    for _ in range(3):
        pacer.decoded(0.020)
    # 4 token-equivalents cost 4 ms: at 1 ms each, 20 ms beside the 20 ms step.
    pacer.fused(0.024, 4.0)
    assert pacer.budget(2000.0) == 8.0
    pacer.fused(0.028, 8.0)
    pacer.fused(0.036, 16.0)
    assert pacer.budget(2000.0) == pytest.approx(20.0)
    assert pacer.budget(12.0) == 12.0


def test_one_slow_step_does_not_shrink_the_next_chunk() -> None:
    pacer = ChunkPacer(3.0)
    for _ in range(5):
        pacer.decoded(0.010)
    for _ in range(4):
        pacer.fused(0.030, 10.0)
    pacer.fused(0.500, 10.0)
    assert pacer.budget(2000.0) == pytest.approx(10.0)
    # Still a token a step when a token costs more than the whole target.
    for _ in range(16):
        pacer.fused(1.0, 1.0)
    pacer.decoded(0.010)
    assert pacer.budget(2000.0) == 1.0


def test_the_rows_decode_alone_now_and_then_so_their_growth_is_not_billed_to_the_prompt() -> None:
    pacer = ChunkPacer(2.0)
    pacer.decoded(0.010)
    for _ in range(15):
        assert pacer.budget(2000.0) > 0
        pacer.fused(0.020, 10.0)
    assert pacer.budget(2000.0) == 0.0
    # The rows grew: a decode step now costs twice as much, and so may the step beside.
    for _ in range(5):
        pacer.decoded(0.020)
    assert pacer.budget(2000.0) == pytest.approx(20.0)


def test_the_ratio_is_an_engine_option_above_one() -> None:
    assert parse_args([]).decode_gap_ratio == 2.0
    assert parse_args(["--decode-gap-ratio", "2.5"]).decode_gap_ratio == 2.5
    with pytest.raises(SystemExit):
        parse_args(["--decode-gap-ratio", "1"])

"""The lean decode step of Llama models: the transformers forward's logits, and its fallback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
)

from penstock.engines.transformers import cpu_weights
from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.default_model import DEFAULT_MODEL_NAME
from penstock.engines.transformers.kv_cache import BatchKv
from penstock.engines.transformers.llama_decode import (
    LlamaDecoder,
    row_spans,
    unsupported_reason,
)
from tests.engines.transformers.conftest import start_engine
from tests.engines.transformers.helpers import greedy, hf_greedy, run, tokens

# Different lengths, so the batch holds left-padded rows and needs a mask.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [12, 30, 31, 32, 33, 34, 35, 36, 37, 38, 60]]
DECODE_STEPS = 6
# The step computes transformers' ops in the same order; the margin only allows for a
# different attention kernel (it was exact on the machines measured).
ATOL = RTOL = 1e-5


def _prefilled_cache(model: LlamaForCausalLM, prompts: list[list[int]]) -> BatchKv:
    """The prompts' KV as the scheduler lays it out: one row each, right-aligned."""
    rows = []
    for prompt in prompts:
        output = model(input_ids=torch.tensor([prompt]), cache=DynamicCache(), use_cache=True)
        rows.append([(layer.keys, layer.values) for layer in output.cache.layers])
    cache = BatchKv(rows[0], row_capacity=len(prompts))
    cache.set_width(max(len(p) for p in prompts), headroom=DECODE_STEPS)
    cache.add_rows(rows, len(prompts))
    return cache


def _compare_decode_steps(model: LlamaForCausalLM) -> None:
    """Feed the same tokens to the transformers forward and to the lean step, each over its
    own copy of the batch cache, and compare every step's logits."""
    decoder = LlamaDecoder.for_model(model, max_rows=len(PROMPTS))
    assert decoder is not None
    with torch.inference_mode():
        reference_cache = _prefilled_cache(model, PROMPTS)
        lean_cache = _prefilled_cache(model, PROMPTS)
        lengths = torch.tensor([len(p) for p in PROMPTS])
        width = int(lengths.max())
        token_ids = torch.tensor([p[-1] for p in PROMPTS])
        for _ in range(DECODE_STEPS):
            for cache in (reference_cache, lean_cache):
                cache.reserve(1, limit=DECODE_STEPS)
            attends = torch.arange(width + 1) >= (width - lengths).unsqueeze(1)
            expected = model(
                input_ids=token_ids.unsqueeze(1),
                attention_mask=attends.long(),
                position_ids=lengths.unsqueeze(1),
                cache=reference_cache,
                use_cache=True,
            ).logits[:, -1]
            got = decoder.decode(token_ids, lengths, lean_cache, attends[:, None, None, :])
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
            token_ids = expected.argmax(-1)
            lengths, width = lengths + 1, width + 1
        for reference, lean in zip(reference_cache.layers, lean_cache.layers, strict=True):
            torch.testing.assert_close(lean.keys, reference.keys, atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(lean.values, reference.values, atol=ATOL, rtol=RTOL)


def _tiny(tiny_model_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_decode_steps_give_the_transformers_logits(tiny_model_dir: Path) -> None:
    _compare_decode_steps(_tiny(tiny_model_dir))


@pytest.mark.parametrize("int8", [False, True])
def test_decode_steps_give_the_transformers_logits_with_packed_weights(
    tiny_model_dir: Path, int8: bool
) -> None:
    failure = cpu_weights.load_kernel(default_model_cache_dir())
    if failure is not None:
        pytest.skip(failure)
    model = _tiny(tiny_model_dir)
    cpu_weights.pack_model(model, int8=int8)
    _compare_decode_steps(model)


def test_decode_steps_give_the_transformers_logits_on_smollm2() -> None:
    model_dir = default_model_cache_dir() / DEFAULT_MODEL_NAME
    if not (model_dir / ".penstock-complete").exists():
        pytest.skip("the default model is not converted on this machine")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _compare_decode_steps(model)


async def test_engine_greedy_tokens_equal_generate_alone_and_together(
    tiny_model_dir: Path,
) -> None:
    expected = [hf_greedy(tiny_model_dir, prompt, 20) for prompt in PROMPTS]
    engine = await start_engine(tiny_model_dir, "--max-num-seqs", "4")
    try:
        assert engine.scheduler is not None and engine.scheduler.decoder is not None
        alone = [await tokens(engine, greedy(prompt, max_tokens=20)) for prompt in PROMPTS]
        # Submitted together: prefilled in one padded pass, decoded in one batch.
        together = await asyncio.gather(
            *(run(engine, greedy(prompt, max_tokens=20)) for prompt in PROMPTS)
        )
    finally:
        await engine.cleanup()
    assert alone == expected
    assert [choices[0].token_ids for choices in together] == expected


def test_what_the_step_does_not_handle_keeps_the_transformers_forward(
    tiny_model_dir: Path,
) -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert LlamaDecoder.for_model(gpt2, max_rows=4) is None
    assert unsupported_reason(gpt2) == "GPT2LMHeadModel is not a supported architecture"

    dynamic_rope = LlamaForCausalLM.from_pretrained(
        tiny_model_dir, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    assert unsupported_reason(dynamic_rope) == "rope type 'dynamic'"

    hooked = _tiny(tiny_model_dir)
    hooked.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    assert unsupported_reason(hooked) == "LlamaMLP has forward hooks"
    assert LlamaDecoder.for_model(_tiny(tiny_model_dir), max_rows=4) is not None


async def test_an_unsupported_architecture_decodes_with_its_own_forward(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    model.save_pretrained(tmp_path)
    prompts = [[5, 6, 7, 8], [9, 10]]
    expected = [hf_greedy(tmp_path, prompt, 8) for prompt in prompts]
    engine = await start_engine(tmp_path, "--max-num-seqs", "4")
    try:
        assert engine.scheduler is not None and engine.scheduler.decoder is None
        together = await asyncio.gather(
            *(run(engine, greedy(prompt, max_tokens=8)) for prompt in prompts)
        )
    finally:
        await engine.cleanup()
    assert [choices[0].token_ids for choices in together] == expected


def test_a_short_row_beside_a_long_one_attends_over_its_own_columns_only(
    tiny_model_dir: Path,
) -> None:
    model = _tiny(tiny_model_dir)
    prompts = [[5, 6, 7], [(7 * i) % 60 + 3 for i in range(400)], [8, 9, 10, 11]]
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    spans = row_spans([len(p) + 1 for p in prompts], width + 1)
    assert spans == [(0, 1, 397), (1, 2, 0), (2, 3, 396)]
    assert row_spans([8, 4, 12], 12) is None
    decoder = LlamaDecoder.for_model(model, max_rows=len(prompts))
    assert decoder is not None
    with torch.inference_mode():
        caches = [_prefilled_cache(model, prompts) for _ in range(2)]
        for cache in caches:
            cache.reserve(1, limit=DECODE_STEPS)
        attends = torch.arange(width + 1) >= (width - lengths).unsqueeze(1)
        token_ids = torch.tensor([p[-1] for p in prompts])
        mask = attends[:, None, None, :]
        whole = decoder.decode(token_ids, lengths, caches[0], mask)
        split = decoder.decode(token_ids, lengths, caches[1], mask, spans)
    torch.testing.assert_close(split, whole, atol=ATOL, rtol=RTOL)

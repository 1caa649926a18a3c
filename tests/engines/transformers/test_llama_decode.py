"""The lean decode step of Llama models over the KV pool's blocks: the transformers forward's
logits, with the paged attention kernel and with the rows gathered, and its fallback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
)

from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.core.block_manager import BLOCK_SIZE
from penstock.engines.transformers.core.kv_cache import KvArena, StepKv
from penstock.engines.transformers.core.llama_decode import LlamaDecoder, unsupported_reason
from penstock.engines.transformers.default_model import DEFAULT_MODEL_NAME
from penstock.engines.transformers.kernels import paged_attention
from penstock.engines.transformers.weights import cpu_weights
from tests.engines.transformers.conftest import start_engine
from tests.engines.transformers.helpers import greedy, hf_greedy, run, tokens

# Different lengths, one spanning several blocks: each row reads only its own tokens.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [40, 41, 42],
    [(7 * i) % 60 + 3 for i in range(70)],
    [12, 30, 31, 32, 33, 34, 35, 36, 37, 38, 60],
]
DECODE_STEPS = 6
# The step computes transformers' ops in the same order; the margin allows for a
# different attention kernel and for the batch's matrix products, which round otherwise
# than one row's (logits of ~20 differ by up to ~4e-5 on SmolLM2-135M).
ATOL, RTOL = 1e-4, 1e-5


def _reference(model: LlamaForCausalLM, prompt: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """The transformers forward's logits at each decode step of ``prompt`` alone (greedy),
    and the tokens fed."""
    output = model(input_ids=torch.tensor([prompt]), cache=DynamicCache(), use_cache=True)
    cache, fed, logits = output.cache, [prompt[-1]], []
    token = int(output.logits[0, -1].argmax())
    for step in range(DECODE_STEPS):
        fed.append(token)
        output = model(
            input_ids=torch.tensor([[token]]),
            position_ids=torch.tensor([[len(prompt) + step]]),
            cache=cache,
            use_cache=True,
        )
        logits.append(output.logits[0, -1])
        token = int(logits[-1].argmax())
    return logits, fed[1:]


def _arena_with_prompts(
    model: LlamaForCausalLM, prompts: list[list[int]]
) -> tuple[KvArena, list[list[int]]]:
    """The prompts' KV written into blocks of one arena, in shuffled order: each row's
    block ids."""
    needs = [-(-(len(p) + DECODE_STEPS) // BLOCK_SIZE) for p in prompts]
    arena = KvArena.for_model(model.config, sum(needs) + 3, torch.float32, torch.device("cpu"))
    order = torch.randperm(sum(needs) + 3, generator=torch.Generator().manual_seed(1)).tolist()
    rows = []
    for prompt, need in zip(prompts, needs, strict=True):
        ids, order = order[:need], order[need:]
        output = model(input_ids=torch.tensor([prompt]), cache=DynamicCache(), use_cache=True)
        layers = [(layer.keys, layer.values) for layer in output.cache.layers]
        arena.write_prompt(arena.slots(ids, 0, len(prompt)), layers, 0)
        rows.append(ids)
    return arena, rows


def _compare_decode_steps(model: LlamaForCausalLM, *, in_place: bool) -> None:
    """Decode the prompts as one batch over the arena and compare every step's logits
    with each prompt decoded alone by the transformers forward."""
    decoder = LlamaDecoder.for_model(model, max_rows=len(PROMPTS))
    assert decoder is not None
    with torch.inference_mode():
        expected = [_reference(model, prompt) for prompt in PROMPTS]
        arena, blocks = _arena_with_prompts(model, PROMPTS)
        for step in range(DECODE_STEPS):
            lengths = [len(p) + step for p in PROMPTS]
            kv = StepKv(arena, list(zip(blocks, lengths, strict=True)))
            assert kv.in_place == in_place
            fed = [fed_tokens[step] for _, fed_tokens in expected]
            got = decoder.decode(torch.tensor(fed), torch.tensor(lengths), kv)
            want = torch.stack([logits[step] for logits, _ in expected])
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.fixture(params=[True, False], ids=["kernel", "gathered"])
def in_place(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param:
        failure = paged_attention.load_attention_kernel(default_model_cache_dir())
        if failure is not None:
            pytest.skip(failure)
    else:
        monkeypatch.setattr(
            "penstock.engines.transformers.core.kv_cache.kernel_ready", lambda: False
        )
    return bool(request.param)


def _tiny(tiny_model_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_decode_steps_give_the_transformers_logits(tiny_model_dir: Path, in_place: bool) -> None:
    _compare_decode_steps(_tiny(tiny_model_dir), in_place=in_place)


@pytest.mark.parametrize("int8", [False, True])
def test_decode_steps_give_the_transformers_logits_with_packed_weights(
    tiny_model_dir: Path, int8: bool
) -> None:
    failure = cpu_weights.load_kernel(default_model_cache_dir())
    if failure is not None:
        pytest.skip(failure)
    model = _tiny(tiny_model_dir)
    cpu_weights.pack_model(model, int8=int8)
    _compare_decode_steps(model, in_place=paged_attention.kernel_ready())


@pytest.mark.parametrize("width", [48, 64, 576, 1536, 4096])
def test_the_norm_kernel_gives_the_bits_of_torchs_ops(width: int) -> None:
    failure = paged_attention.load_attention_kernel(default_model_cache_dir())
    if failure is not None:
        pytest.skip(failure)

    def torch_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return weight * (hidden * torch.rsqrt(variance + eps))

    generator = torch.Generator().manual_seed(width)
    for rows in (1, 3, 16):
        for scale in (0.01, 1.0, 40.0):
            hidden = torch.randn(rows, width, generator=generator) * scale
            delta = torch.randn(rows, width, generator=generator)
            weight = torch.randn(width, generator=generator)
            normed = paged_attention.rms_norm(hidden, weight, 1e-5)
            assert torch.equal(normed, torch_norm(hidden, weight, 1e-5))
            residual = hidden.clone()
            normed = paged_attention.add_rms_norm(residual, delta, weight, 1e-6)
            assert torch.equal(residual, hidden + delta)
            assert torch.equal(normed, torch_norm(hidden + delta, weight, 1e-6))


@pytest.mark.parametrize("packed", [False, True], ids=["float32", "bfloat16"])
def test_the_fused_decode_step_gives_the_general_steps_bits(
    tiny_model_dir: Path, packed: bool
) -> None:
    """Norms, rotations, KV writes and attention in the kernels' few calls: the logits and
    the keys and values written are the bits of the step made of torch's ops."""
    for failure in (
        paged_attention.load_attention_kernel(default_model_cache_dir()),
        cpu_weights.load_kernel(default_model_cache_dir()),
    ):
        if failure is not None:
            pytest.skip(failure)
    model = _tiny(tiny_model_dir)
    if packed:
        cpu_weights.pack_model(model)
    decoder = LlamaDecoder.for_model(model, max_rows=len(PROMPTS))
    assert decoder is not None
    with torch.inference_mode():
        fused_arena, blocks = _arena_with_prompts(model, PROMPTS)
        general_arena, _ = _arena_with_prompts(model, PROMPTS)
        fed = torch.tensor([prompt[-1] for prompt in PROMPTS])
        for step in range(DECODE_STEPS):
            lengths = [len(p) + step for p in PROMPTS]
            rows = list(zip(blocks, lengths, strict=True))
            fused = decoder.decode(fed, torch.tensor(lengths), StepKv(fused_arena, rows))
            general, _ = decoder.step(fed, torch.tensor(lengths), StepKv(general_arena, rows), None)
            assert general is not None
            assert torch.equal(fused, general)
            fed = fused.argmax(-1)
        for prompt, ids in zip(PROMPTS, blocks, strict=True):
            slots = fused_arena.slots(ids, 0, len(prompt) + DECODE_STEPS)
            assert torch.equal(fused_arena.read(slots), general_arena.read(slots))


def test_decode_steps_give_the_transformers_logits_on_smollm2() -> None:
    model_dir = default_model_cache_dir() / DEFAULT_MODEL_NAME
    if not (model_dir / ".penstock-complete").exists():
        pytest.skip("the default model is not converted on this machine")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _compare_decode_steps(model, in_place=paged_attention.kernel_ready())


async def test_the_default_model_alone_answers_as_generate() -> None:
    """At its defaults (the lossless weights path this CPU has), each greedy answer of
    SmolLM2 equals ``generate``'s in float32, to the end token. Neither applies the
    checkpoint's repetition penalty, so the tokens are the logits' own argmax."""
    model_dir = default_model_cache_dir() / DEFAULT_MODEL_NAME
    if not (model_dir / ".penstock-complete").exists():
        pytest.skip("the default model is not converted on this machine")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = ["What is the capital of France?", "Name three primary colours."]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for q in questions
    ]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = [
            model.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, repetition_penalty=1.0
            )[0, len(prompt) :].tolist()
            for prompt in prompts
        ]
    engine = await start_engine(model_dir)
    try:
        answers = []
        for prompt in prompts:
            request = greedy(prompt, max_tokens=32)
            request["sampling_options"]["repetition_penalty"] = 1.0
            request["stop_conditions"] = {"max_tokens": 32}
            answers.append(await tokens(engine, request))
    finally:
        await engine.cleanup()
    assert answers == expected
    assert tokenizer.decode(answers[0]).startswith("The capital of France is Paris.")


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

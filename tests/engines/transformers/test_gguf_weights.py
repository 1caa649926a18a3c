"""Linear layers decoding from GGUF blocks: the same weights, bit for bit, as bfloat16."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize
from transformers import LlamaForCausalLM

from penstock.engines.transformers import TransformersEngine
from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.weights import cpu_weights, gguf_weights
from penstock.engines.transformers.weights.gguf_weights import (
    BLOCKS_FILE,
    GgufBlockLinear,
    rebuild,
    records_from_gguf,
    write_blocks_file,
)
from tests.engines.transformers.conftest import start_engine
from tests.engines.transformers.helpers import greedy, run, tokens

# Mixed lengths, so a decode batch holds left-padded rows.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [12, 30, 31, 32, 33, 34, 35, 36, 37, 38, 60]]
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@pytest.fixture(scope="module")
def kernel() -> None:
    failure = cpu_weights.load_kernel(default_model_cache_dir())
    if failure is not None:
        pytest.skip(failure)
    if not cpu_weights.has_gguf_kernels():
        pytest.skip("the CPU has no AVX512-BF16, which its AVX-512 GGUF kernels need")


@pytest.fixture(scope="module")
def bf16_dot(kernel: None) -> None:
    """The bfloat16-activation kernels: AVX512-BF16 only."""
    if not cpu_weights.has_avx512_bf16():
        pytest.skip("the CPU has no AVX512-BF16")


def q4_1_blocks(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 blocks ``[N, K / 32 * 20]`` of ``weight``, as llama.cpp lays them out."""
    rows = weight.shape[0]
    groups = weight.float().reshape(rows, -1, 32)
    low = groups.amin(-1).half()
    scale = ((groups.amax(-1) - low.float()) / 15).half()
    levels = (groups - low.float()[..., None]) / scale.float()[..., None].clamp_min(1e-8)
    levels = levels.round().clamp(0, 15).to(torch.uint8)
    packed = levels[..., :16] | (levels[..., 16:] << 4)
    head = torch.stack((scale, low), dim=-1).view(torch.uint8)
    return torch.cat((head, packed), dim=-1).reshape(rows, -1).contiguous()


def q8_0_blocks(weight: torch.Tensor) -> torch.Tensor:
    rows = weight.shape[0]
    groups = weight.float().reshape(rows, -1, 32)
    scale = (groups.abs().amax(-1) / 127).half()
    levels = (groups / scale.float()[..., None].clamp_min(1e-8)).round().clamp(-127, 127)
    head = scale[..., None].view(torch.uint8)
    return torch.cat((head, levels.to(torch.int8).view(torch.uint8)), -1).reshape(rows, -1)


def _llama_cpp_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter gives q and k (transformers undoes it)."""
    return weight.reshape(heads, 2, -1, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _gguf_name(model: LlamaForCausalLM, module: torch.nn.Module) -> str:
    if module is model.lm_head:
        return "output.weight"
    for index, layer in enumerate(model.model.layers):
        for name, gguf_name in _LAYER_NAMES.items():
            if layer.get_submodule(name) is module:
                return f"blk.{index}.{gguf_name}.weight"
    raise KeyError(module)


def _write_gguf(model: LlamaForCausalLM, blocks: dict[str, torch.Tensor], path: Path) -> None:
    writer = GGUFWriter(str(path), "llama")
    config = model.config
    for name, raw in blocks.items():
        if ".attn_q." in name or ".attn_k." in name:
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            raw = _llama_cpp_rows(raw, heads)
        kind = GGMLQuantizationType.Q8_0 if name == "output.weight" else GGMLQuantizationType.Q4_1
        writer.add_tensor(name, raw.numpy(), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny Llama with its linear weights rounded through Q4_1 (output layer: Q8_0),
    stored in bfloat16 beside the blocks, as the default model's conversion leaves it."""
    target = tmp_path_factory.mktemp("tiny-gguf")
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    blocks: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                kind = "Q8_0" if module is model.lm_head else "Q4_1"
                raw = (q4_1_blocks if kind == "Q4_1" else q8_0_blocks)(module.weight)
                blocks[_gguf_name(model, module)] = raw
                module.weight.copy_(rebuild(records_from_gguf(raw, kind), kind))
    model.to(torch.bfloat16).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (target / name).write_bytes((tiny_model_dir / name).read_bytes())
    _write_gguf(model, blocks, target / "tiny.gguf")
    assert write_blocks_file(target / "tiny.gguf", target) == 2 * 7 + 1
    return target


@pytest.fixture(scope="module")
def other_bf16_dir(tmp_path_factory: pytest.TempPathFactory, other_tiny_model_dir: Path) -> Path:
    target = tmp_path_factory.mktemp("other-bf16")
    LlamaForCausalLM.from_pretrained(other_tiny_model_dir, dtype=torch.bfloat16).save_pretrained(
        target
    )
    return target


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_blocks_rebuild_as_the_gguf_package_dequantizes(kind: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(24, 96) * 0.05
    blocks = q4_1_blocks(weight) if kind == "Q4_1" else q8_0_blocks(weight)
    wanted = dequantize(blocks.numpy(), GGMLQuantizationType[kind])
    wanted = torch.from_numpy(np.ascontiguousarray(wanted)).reshape(24, 96).bfloat16()
    got = rebuild(records_from_gguf(blocks, kind), kind)
    assert torch.equal(got.view(torch.int16), wanted.view(torch.int16))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 16, 64])
def test_kernel_reads_each_weight_exactly(kernel: None, kind: str, rows: int) -> None:
    """Rows of the identity pick single weights: no rounding of the sum can hide one."""
    torch.manual_seed(rows)
    weight = torch.randn(37, 128) * 0.1
    blocks = q4_1_blocks(weight) if kind == "Q4_1" else q8_0_blocks(weight)
    records = records_from_gguf(blocks, kind)
    layer = _block_layer(records, kind)
    wanted = rebuild(records, kind).float()
    for first in range(0, 128, rows):
        eye = torch.eye(128)[first : first + rows]
        assert torch.equal(layer(eye), wanted[:, first : first + rows].T)
    x = torch.randn(rows, 128)
    torch.testing.assert_close(layer(x), F.linear(x, wanted), atol=1e-5, rtol=1e-5)


def _block_layer(records: torch.Tensor, kind: str) -> GgufBlockLinear:
    weight = rebuild(records, kind)
    layer = cpu_weights.Bf16WeightLinear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data = weight
    layer.__class__ = GgufBlockLinear
    layer.gguf_records, layer.gguf_kind = records, kind
    return layer


def _served_from_blocks(engine: TransformersEngine) -> int:
    return sum(
        isinstance(m, GgufBlockLinear) and m.gguf_records is not None
        for m in engine.model.modules()
    )


async def _greedy_alone_and_together(engine: TransformersEngine) -> list[list[int]]:
    alone = [await tokens(engine, greedy(prompt, max_tokens=16)) for prompt in PROMPTS]
    together = await asyncio.gather(
        *(run(engine, greedy(prompt, max_tokens=16)) for prompt in PROMPTS)
    )
    assert [choices[0].token_ids for choices in together] == alone
    return alone


async def test_greedy_tokens_equal_the_bfloat16_paths(kernel: None, gguf_dir: Path) -> None:
    reference = await start_engine(gguf_dir, "--cpu-weight-dtype", "bfloat16")
    try:
        wanted = await _greedy_alone_and_together(reference)
    finally:
        await reference.cleanup()
    engine = await start_engine(gguf_dir, "--cpu-weight-dtype", "gguf", "--max-num-seqs", "4")
    try:
        assert engine.gguf_weights
        assert _served_from_blocks(engine) == 2 * 7 + 1
        assert await _greedy_alone_and_together(engine) == wanted
    finally:
        await engine.cleanup()


async def test_a_weight_update_is_served_from_the_bfloat16_weights(
    kernel: None, gguf_dir: Path, other_bf16_dir: Path
) -> None:
    fresh = await start_engine(other_bf16_dir, "--cpu-weight-dtype", "bfloat16")
    try:
        wanted = await tokens(fresh, greedy(PROMPTS[0], max_tokens=16))
    finally:
        await fresh.cleanup()
    engine = await start_engine(gguf_dir, "--cpu-weight-dtype", "gguf")
    try:
        before = await tokens(engine, greedy(PROMPTS[0], max_tokens=16))
        assert before != wanted
        await engine.engine_control("pause_generation", {"mode": "wait"})
        snapshot = await engine.weights_snapshot()
        reply = await engine.engine_update(
            "update_weights_from_disk", {"model_path": str(other_bf16_dir)}
        )
        assert reply["status"] == "ok"
        await engine.engine_control("resume_generation", {})
        assert _served_from_blocks(engine) == 0
        assert await tokens(engine, greedy(PROMPTS[0], max_tokens=16)) == wanted
        # The old weights back: the blocks no longer serve, the weights they equal do.
        await engine.engine_control("pause_generation", {"mode": "wait"})
        await engine.restore_weights_snapshot(snapshot)
        await engine.engine_control("resume_generation", {})
        assert await tokens(engine, greedy(PROMPTS[0], max_tokens=16)) == before
    finally:
        await engine.cleanup()


async def test_an_update_from_the_folder_itself_keeps_the_blocks(
    kernel: None, gguf_dir: Path
) -> None:
    engine = await start_engine(gguf_dir, "--cpu-weight-dtype", "gguf")
    try:
        before = await tokens(engine, greedy(PROMPTS[0], max_tokens=16))
        await engine.engine_control("pause_generation", {"mode": "wait"})
        update = {"model_path": str(gguf_dir)}
        reply = await engine.engine_update("update_weights_from_disk", update)
        assert reply["status"] == "ok"
        await engine.engine_control("resume_generation", {})
        assert _served_from_blocks(engine) == 2 * 7 + 1
        assert await tokens(engine, greedy(PROMPTS[0], max_tokens=16)) == before
    finally:
        await engine.cleanup()


async def test_auto_decodes_from_blocks_where_the_folder_has_them(
    bf16_dot: None, gguf_dir: Path, other_bf16_dir: Path
) -> None:
    for folder, wanted in ((gguf_dir, True), (other_bf16_dir, False)):
        engine = await start_engine(folder)
        try:
            assert engine.bf16_weights and engine.gguf_weights == wanted
        finally:
            await engine.cleanup()


async def test_auto_keeps_bfloat16_where_the_gguf_kernels_are_no_faster(
    kernel: None, gguf_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An AVX2 CPU: its GGUF kernels are exact but read the blocks no faster.
    monkeypatch.setattr(cpu_weights, "_kernel_isa", "AVX2")
    monkeypatch.setattr(cpu_weights._kernel, "cpu_has_avx512_bf16", lambda: False)
    engine = await start_engine(gguf_dir)
    try:
        assert engine.bf16_weights and not engine.gguf_weights
        assert _served_from_blocks(engine) == 0
    finally:
        await engine.cleanup()


async def test_deep_sleep_brings_the_blocks_back(kernel: None, gguf_dir: Path) -> None:
    engine = await start_engine(gguf_dir, "--cpu-weight-dtype", "gguf")
    try:
        before = await tokens(engine, greedy(PROMPTS[1], max_tokens=12))
        assert (await engine.engine_control("sleep", {"level": 2}))["status"] == "sleeping"
        assert (await engine.engine_control("wake_up", {}))["status"] == "awake"
        assert _served_from_blocks(engine) == 2 * 7 + 1
        assert await tokens(engine, greedy(PROMPTS[1], max_tokens=12)) == before
    finally:
        await engine.cleanup()


async def _adapted_tokens(engine: TransformersEngine, lora_dir: Path) -> list[int]:
    reply = await engine.engine_update(
        "load_lora", {"lora_name": "tiny-lora", "lora_path": str(lora_dir)}
    )
    assert reply["status"] == "ok"
    return await tokens(engine, {**greedy(PROMPTS[2], max_tokens=12), "model": "tiny-lora"})


async def test_a_lora_adapter_runs_on_the_blocks(
    kernel: None, gguf_dir: Path, tiny_lora_dir: Path
) -> None:
    reference = await start_engine(gguf_dir, "--cpu-weight-dtype", "bfloat16")
    try:
        wanted = await _adapted_tokens(reference, tiny_lora_dir)
    finally:
        await reference.cleanup()
    engine = await start_engine(gguf_dir, "--cpu-weight-dtype", "gguf")
    try:
        assert await _adapted_tokens(engine, tiny_lora_dir) == wanted
        assert _served_from_blocks(engine) == 2 * 7 + 1
    finally:
        await engine.cleanup()


async def test_without_blocks_the_weights_stay_bfloat16(
    kernel: None, other_bf16_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        engine = await start_engine(other_bf16_dir, "--cpu-weight-dtype", "gguf")
    try:
        assert engine.bf16_weights and not engine.gguf_weights
        assert f"has no {BLOCKS_FILE}" in caplog.text
    finally:
        await engine.cleanup()


async def test_without_gguf_kernels_the_weights_stay_bfloat16(
    kernel: None, gguf_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An AVX-512 CPU without AVX512-BF16.
    monkeypatch.setattr(cpu_weights, "_kernel_isa", "AVX512")
    monkeypatch.setattr(cpu_weights._kernel, "cpu_has_avx512_bf16", lambda: False)
    with caplog.at_level(logging.WARNING):
        engine = await start_engine(gguf_dir, "--cpu-weight-dtype", "gguf")
    try:
        assert engine.bf16_weights and not engine.gguf_weights
        assert _served_from_blocks(engine) == 0
        assert "no AVX512-BF16" in caplog.text
    finally:
        await engine.cleanup()


def test_rows_that_no_block_rebuilds_keep_no_blocks(tmp_path: Path, gguf_dir: Path) -> None:
    for name in ("model.safetensors", "config.json"):
        (tmp_path / name).write_bytes((gguf_dir / name).read_bytes())
    model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, 5] += 1
    model.save_pretrained(tmp_path)
    assert write_blocks_file(gguf_dir / "tiny.gguf", tmp_path) == 2 * 7
    wanted = "model.layers.0.mlp.up_proj.weight"
    assert gguf_weights.checkpoint_name("blk.0.ffn_up.weight") == wanted


def _bf16_activation_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 (a single row is not: it stays float32), times the weights."""
    rounded = x if x.shape[0] == 1 else x.bfloat16().float()
    return (rounded.double() @ weight.double().T).float()


# Rows of 1 (float32), 3, 16, 64 and, for the kernel alone (layers compute longer inputs
# in float32), beyond a row block of 64; widths of one, two (704) and three (1536) passes;
# 37 outputs, so that one is left over after the groups of 4.
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 70])
@pytest.mark.parametrize("width", [128, 704, 1536])
def test_bf16_activation_kernels_equal_the_rounded_matmul(
    bf16_dot: None, kind: str, rows: int, width: int
) -> None:
    torch.manual_seed(rows * width)
    weight = torch.randn(37, width) * width**-0.5
    blocks = q4_1_blocks(weight) if kind == "Q4_1" else q8_0_blocks(weight)
    records = records_from_gguf(blocks, kind)
    layer = _block_layer(records, kind)
    layer.bf16_activations = True
    x = torch.randn(rows, width)
    wanted = _bf16_activation_reference(x, rebuild(records, kind).float())
    got = layer._block_linear()(x, records)
    torch.testing.assert_close(got, wanted, atol=1e-5, rtol=1e-5)
    if rows > 1:
        assert not torch.allclose(got, F.linear(x, rebuild(records, kind).float()))
    if rows <= 64:
        torch.testing.assert_close(layer(x), wanted, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.row_forward()(x), wanted, atol=1e-5, rtol=1e-5)


async def test_the_blocks_decode_with_bf16_activations(bf16_dot: None, gguf_dir: Path) -> None:
    engine = await start_engine(
        gguf_dir, "--cpu-weight-dtype", "gguf", "--cpu-activation-dtype", "bfloat16"
    )

    def rounding() -> list[bool]:
        return [
            m.bf16_activations for m in engine.model.modules() if isinstance(m, GgufBlockLinear)
        ]

    try:
        assert rounding() == [True] * (2 * 7 + 1)
        together = await asyncio.gather(
            *(run(engine, greedy(prompt, max_tokens=16)) for prompt in PROMPTS)
        )
        # A model reloaded after deep sleep rounds again.
        assert (await engine.engine_control("sleep", {"level": 2}))["status"] == "sleeping"
        assert (await engine.engine_control("wake_up", {}))["status"] == "awake"
        assert rounding() == [True] * (2 * 7 + 1)
    finally:
        await engine.cleanup()
    assert [choices[0].finish_reason for choices in together] == ["length"] * len(PROMPTS)
    assert [len(choices[0].token_ids) for choices in together] == [16] * len(PROMPTS)


async def test_bf16_activations_keep_the_easy_answers_of_smollm2(bf16_dot: None) -> None:
    """Three requests decoding together (so the kernels take several rows) answer as with
    float32 activations."""
    from transformers import AutoTokenizer

    from penstock.engines.transformers.default_model import DEFAULT_MODEL_NAME

    model_dir = default_model_cache_dir() / DEFAULT_MODEL_NAME
    if not (model_dir / BLOCKS_FILE).is_file():
        pytest.skip("the default model is not converted on this machine")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = ["What is the capital of France?", "What is 2 + 2?", "Name a primary colour."]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for q in questions
    ]
    answers: dict[str, list[list[int]]] = {}
    for activations in ("float32", "bfloat16"):
        engine = await start_engine(
            model_dir, "--cpu-weight-dtype", "gguf", "--cpu-activation-dtype", activations
        )
        try:
            assert all(
                m.bf16_activations == (activations == "bfloat16")
                for m in engine.model.modules()
                if isinstance(m, GgufBlockLinear)
            )
            together = await asyncio.gather(
                *(run(engine, greedy(p, max_tokens=24)) for p in prompts)
            )
        finally:
            await engine.cleanup()
        answers[activations] = [choices[0].token_ids for choices in together]
    texts = [tokenizer.decode(answer) for answer in answers["bfloat16"]]
    assert texts[0].startswith("The capital of France is Paris.")
    assert "Red" in texts[2]
    # Measured: all 24 tokens of each answer equal; 8 leave room for another CPU's sums.
    assert [a[:8] for a in answers["bfloat16"]] == [a[:8] for a in answers["float32"]]


async def test_bf16_activations_without_avx512_bf16_stay_float32(
    kernel: None, gguf_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reference = await start_engine(gguf_dir, "--cpu-weight-dtype", "bfloat16")
    try:
        wanted = await _greedy_alone_and_together(reference)
    finally:
        await reference.cleanup()
    monkeypatch.setattr(cpu_weights._kernel, "cpu_has_avx512_bf16", lambda: False)
    with caplog.at_level(logging.WARNING):
        engine = await start_engine(
            gguf_dir, "--cpu-weight-dtype", "bfloat16", "--cpu-activation-dtype", "bfloat16"
        )
    try:
        assert "activations stay float32 (--cpu-activation-dtype bfloat16)" in caplog.text
        assert "no AVX512-BF16" in caplog.text
        assert not any(getattr(m, "bf16_activations", False) for m in engine.model.modules())
        assert await _greedy_alone_and_together(engine) == wanted
    finally:
        await engine.cleanup()

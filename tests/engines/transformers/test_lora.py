"""LoRA adapters in the transformers engine: loaded through ``engine_update``, picked by
``model``, mixed with base-model rows in one batch, kept across weight updates and sleep."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from penstock.engines.context import Context
from penstock.engines.transformers import TransformersEngine
from tests.engines.transformers.conftest import peft_greedy, start_engine
from tests.engines.transformers.helpers import PROMPT, greedy, tokens

MAX_TOKENS = 16


def as_model(name: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {**greedy(max_tokens=max_tokens), "model": name}


async def load(engine: TransformersEngine, name: str, path: Path) -> dict[str, Any]:
    return await engine.engine_update("load_lora", {"lora_name": name, "lora_path": str(path)})


def max_rows_in_one_decode(engine: TransformersEngine) -> int:
    return max(m.scheduled_requests.num_decode_requests for m in engine.forward_pass_metrics)


def test_lora_updates_are_advertised(engine: TransformersEngine) -> None:
    assert {"load_lora", "unload_lora"} <= engine.supported_updates()


async def test_adapter_output_is_peft_output_and_base_is_untouched(
    engine: TransformersEngine, tiny_model_dir: Path, tiny_lora_dir: Path
) -> None:
    base = await tokens(engine, greedy(max_tokens=MAX_TOKENS))
    reply = await load(engine, "tiny-lora", tiny_lora_dir)
    assert reply["status"] == "ok"
    assert reply["lora_name"] == "tiny-lora"

    adapted = await tokens(engine, as_model("tiny-lora"))
    assert adapted == peft_greedy(tiny_model_dir, tiny_lora_dir, PROMPT, MAX_TOKENS)
    assert adapted != base
    assert await tokens(engine, greedy(max_tokens=MAX_TOKENS)) == base
    assert await tokens(engine, as_model(engine.served_model_name)) == base


async def test_base_and_adapters_share_a_batch_without_mixing(
    engine: TransformersEngine, tiny_lora_dir: Path, second_tiny_lora_dir: Path
) -> None:
    base_alone = await tokens(engine, greedy(max_tokens=24))
    assert (await load(engine, "a", tiny_lora_dir))["status"] == "ok"
    assert (await load(engine, "b", second_tiny_lora_dir))["status"] == "ok"
    a_alone = await tokens(engine, as_model("a", 24))
    b_alone = await tokens(engine, as_model("b", 24))
    assert len({tuple(base_alone), tuple(a_alone), tuple(b_alone)}) == 3

    engine.forward_pass_metrics.clear()
    together = await asyncio.gather(
        tokens(engine, greedy(max_tokens=24)),
        tokens(engine, as_model("a", 24)),
        tokens(engine, as_model("b", 24)),
        tokens(engine, greedy(max_tokens=24)),
    )
    assert together == [base_alone, a_alone, b_alone, base_alone]
    assert max_rows_in_one_decode(engine) == 4, "the four requests decoded in one batch"


async def test_unload_refuses_the_name_and_restores_the_plain_model(
    engine: TransformersEngine, tiny_lora_dir: Path
) -> None:
    plain = engine.model
    base = await tokens(engine, greedy(max_tokens=MAX_TOKENS))
    await load(engine, "tiny-lora", tiny_lora_dir)
    reply = await engine.engine_update("unload_lora", {"lora_name": "tiny-lora"})
    assert reply["status"] == "ok"
    assert engine.scheduler is not None and engine.scheduler.model is plain
    assert "lora" not in " ".join(plain.state_dict())

    with pytest.raises(ValueError, match=r"^model: LoRA adapter 'tiny-lora' is not loaded"):
        await tokens(engine, as_model("tiny-lora"))
    assert await tokens(engine, greedy(max_tokens=MAX_TOKENS)) == base
    again = await engine.engine_update("unload_lora", {"lora_name": "tiny-lora"})
    assert again == {
        "status": "error",
        "message": "LoRA adapter 'tiny-lora' is not loaded (loaded: none)",
    }
    assert (await load(engine, "tiny-lora", tiny_lora_dir))["status"] == "ok"


async def test_other_names_run_the_base_model_and_bad_ones_are_refused(
    engine: TransformersEngine, tiny_lora_dir: Path
) -> None:
    # The gateway may serve the base model under a name of its own (--served-model-name).
    base = await tokens(engine, greedy(max_tokens=MAX_TOKENS))
    await load(engine, "tiny-lora", tiny_lora_dir)
    assert await tokens(engine, as_model("renamed-by-the-gateway")) == base
    with pytest.raises(ValueError, match=r"^model: must be a string"):
        await tokens(engine, {**greedy(), "model": 7})


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing folder", "LoRA folder not found"),
        ("no adapter config", "has no adapter_config.json"),
        ("other architecture", "does not fit the model"),
        ("wrong shapes", "size mismatch"),
        ("duplicate name", "is already loaded from"),
        ("base model name", "is reserved for the base model"),
        ("no name", "missing non-empty `lora_name` string"),
        ("no path", "missing non-empty `lora_path` string"),
    ],
)
async def test_bad_loads_are_refused_and_the_engine_serves_on(
    engine: TransformersEngine,
    tiny_lora_dir: Path,
    wider_tiny_lora_dir: Path,
    gpt2_tiny_lora_dir: Path,
    tmp_path: Path,
    case: str,
    expected: str,
) -> None:
    base = await tokens(engine, greedy(max_tokens=MAX_TOKENS))
    assert (await load(engine, "good", tiny_lora_dir))["status"] == "ok"
    adapted = await tokens(engine, as_model("good"))
    body: dict[str, Any] = {
        "missing folder": {"lora_name": "x", "lora_path": str(tmp_path / "nowhere")},
        "no adapter config": {"lora_name": "x", "lora_path": str(tmp_path)},
        "other architecture": {"lora_name": "x", "lora_path": str(gpt2_tiny_lora_dir)},
        "wrong shapes": {"lora_name": "x", "lora_path": str(wider_tiny_lora_dir)},
        "duplicate name": {"lora_name": "good", "lora_path": str(tiny_lora_dir)},
        "base model name": {"lora_name": engine.served_model_name, "lora_path": str(tiny_lora_dir)},
        "no name": {"lora_path": str(tiny_lora_dir)},
        "no path": {"lora_name": "x"},
    }[case]
    reply = await engine.engine_update("load_lora", body)
    assert reply["status"] == "error"
    assert expected in reply["message"]
    assert set(engine.lora.adapters) == {"good"}
    assert await tokens(engine, greedy(max_tokens=MAX_TOKENS)) == base
    assert await tokens(engine, as_model("good")) == adapted


@pytest.mark.parametrize("bad", ["wrong shapes", "other architecture"])
async def test_a_failed_first_load_leaves_the_plain_model(
    engine: TransformersEngine, wider_tiny_lora_dir: Path, gpt2_tiny_lora_dir: Path, bad: str
) -> None:
    plain = engine.model
    path = wider_tiny_lora_dir if bad == "wrong shapes" else gpt2_tiny_lora_dir
    reply = await load(engine, "bad", path)
    assert reply["status"] == "error"
    assert engine.scheduler is not None and engine.scheduler.model is plain
    assert "lora" not in " ".join(plain.state_dict())


async def test_unload_lets_running_requests_of_the_adapter_finish(
    engine: TransformersEngine, tiny_lora_dir: Path
) -> None:
    await load(engine, "tiny-lora", tiny_lora_dir)
    expected = await tokens(engine, as_model("tiny-lora", 60))
    running = asyncio.create_task(tokens(engine, as_model("tiny-lora", 60)))
    await asyncio.sleep(0.05)
    unloading = asyncio.create_task(engine.engine_update("unload_lora", {"lora_name": "tiny-lora"}))
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="is not loaded"):
        await tokens(engine, as_model("tiny-lora"))
    assert (await unloading)["status"] == "ok"
    assert running.done()
    assert await running == expected


async def test_unload_while_paused_with_the_adapter_in_flight_is_refused(
    engine: TransformersEngine, tiny_lora_dir: Path
) -> None:
    await load(engine, "tiny-lora", tiny_lora_dir)
    stream = engine.generate(as_model("tiny-lora", 400), Context("held"))
    await anext(stream)
    await engine.engine_control("pause_generation", {"mode": "keep"})
    reply = await engine.engine_update("unload_lora", {"lora_name": "tiny-lora"})
    assert reply["status"] == "error"
    assert "in flight while generation is paused" in reply["message"]
    await engine.engine_control("abort_request", {"request_id": "held"})
    assert [chunk async for chunk in stream][-1]["finish_reason"] == "cancelled"
    assert (await engine.engine_update("unload_lora", {"lora_name": "tiny-lora"}))["status"] == "ok"


async def test_adapters_stay_loaded_on_new_base_weights(
    tiny_model_dir: Path, other_tiny_model_dir: Path, tiny_lora_dir: Path
) -> None:
    engine = await start_engine(tiny_model_dir)
    try:
        await load(engine, "tiny-lora", tiny_lora_dir)
        before = await tokens(engine, as_model("tiny-lora"))
        await engine.engine_control("pause_generation", {"mode": "wait"})
        reply = await engine.engine_update(
            "update_weights_from_disk", {"model_path": str(other_tiny_model_dir)}
        )
        assert reply["status"] == "ok", reply
        await engine.engine_control("resume_generation", {})
        after = await tokens(engine, as_model("tiny-lora"))
        assert after == peft_greedy(other_tiny_model_dir, tiny_lora_dir, PROMPT, MAX_TOKENS)
        assert after != before
    finally:
        await engine.cleanup()


@pytest.mark.parametrize("level", [1, 2])
async def test_adapters_survive_sleep_and_wake_up(
    engine: TransformersEngine, tiny_lora_dir: Path, level: int
) -> None:
    await load(engine, "tiny-lora", tiny_lora_dir)
    base = await tokens(engine, greedy(max_tokens=MAX_TOKENS))
    adapted = await tokens(engine, as_model("tiny-lora"))
    await engine.engine_control("sleep", {"level": level})
    asleep = await load(engine, "second", tiny_lora_dir)
    if level == 2:
        assert asleep["status"] == "error"
        assert "call wake_up" in asleep["message"]
    await engine.engine_control("wake_up", {})
    assert await tokens(engine, as_model("tiny-lora")) == adapted
    assert await tokens(engine, greedy(max_tokens=MAX_TOKENS)) == base


async def test_adapters_compute_in_the_model_dtype(
    tiny_model_dir: Path, tiny_lora_dir: Path, second_tiny_lora_dir: Path
) -> None:
    engine = await start_engine(tiny_model_dir, "--dtype", "bfloat16")
    try:
        await load(engine, "a", tiny_lora_dir)
        await load(engine, "b", second_tiny_lora_dir)
        dtypes = {t.dtype for name, t in engine.model.state_dict().items() if ".lora_" in name}
        assert dtypes == {torch.bfloat16}
        assert len(await tokens(engine, as_model("b"))) == MAX_TOKENS
    finally:
        await engine.cleanup()

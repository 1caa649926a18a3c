"""Command line, startup failures, health canary and the conformance kit."""

from __future__ import annotations

from pathlib import Path

import pytest

from penstock.engines.conformance import run_conformance
from penstock.engines.context import Context
from penstock.engines.host import EngineHost
from penstock.engines.transformers import TransformersEngine
from penstock.engines.transformers.weights.checkpoint import CheckpointError
from tests.engines.transformers.helpers import run


async def test_from_args_describes_the_worker(tiny_model_dir: Path) -> None:
    checkpoint = str(tiny_model_dir.resolve())  # noqa: ASYNC240 - a test, nothing else waits
    engine, worker = await TransformersEngine.from_args(
        ["--model", str(tiny_model_dir), "--served-model-name", "tiny", "--max-num-seqs", "4"]
    )
    assert worker.namespace == "penstock"
    assert worker.component == "backend"
    assert worker.model_name == checkpoint
    assert worker.served_model_name == "tiny"
    assert worker.endpoint_types == "chat,completions"
    config = await engine.start(1)
    try:
        assert config.model == config.served_model_name == "tiny"
        llm = config.llm
        assert (llm.context_length, llm.max_num_seqs, llm.kv_cache_block_size) == (512, 4, 16)
        assert llm.total_kv_blocks == 4 * 512 // 16
    finally:
        await engine.cleanup()


async def test_kv_capacity_and_context_length_options(tiny_model_dir: Path) -> None:
    engine, _ = await TransformersEngine.from_args(
        ["--model", str(tiny_model_dir), "--max-model-len", "128", "--kv-cache-tokens", "160"]
    )
    config = await engine.start(1)
    try:
        assert (config.llm.context_length, config.llm.total_kv_blocks) == (128, 10)
        too_big = {
            "token_ids": [1, 2, 3],
            "sampling_options": {"n": 2},
            "stop_conditions": {"max_tokens": 100},
        }
        with pytest.raises(ValueError, match="kv-cache-tokens"):
            await run(engine, too_big)
    finally:
        await engine.cleanup()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/nonexistent/checkpoint"], "not found"),
        (["--model", "{tmp}"], "no config.json"),
    ],
)
async def test_a_missing_checkpoint_fails_with_a_clear_message(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    with pytest.raises(CheckpointError, match=message):
        await TransformersEngine.from_args(argv)


async def test_an_unreadable_checkpoint_fails_at_start(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    engine, _ = await TransformersEngine.from_args(["--model", str(tmp_path)])
    with pytest.raises(CheckpointError, match=str(tmp_path)):
        await engine.start(1)
    await engine.cleanup()


@pytest.mark.parametrize(
    "argv",
    [
        ["--device", "tpu"],
        ["--max-num-seqs", "0"],
        ["--dtype", "int3"],
        ["--cpu-activation-dtype", "int8"],
    ],
)
async def test_bad_options_exit_with_usage(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        await TransformersEngine.from_args(argv)
    assert caught.value.code == 2
    assert "usage:" in capsys.readouterr().err


async def test_health_canary_is_a_one_token_generation(tiny_model_dir: Path) -> None:
    engine, worker = await TransformersEngine.from_args(["--model", str(tiny_model_dir)])
    host = EngineHost(engine, worker)
    await host.start()
    try:
        payload = host.health_check_payload
        assert payload["stop_conditions"] == {"max_tokens": 1, "ignore_eos": True}
        assert payload["_HEALTH_CHECK"] is True
        status = await host.check_health()
        assert status.healthy, status.reason
        choice = (await run(engine, dict(payload), Context("canary")))[0]
        assert len(choice.token_ids) == 1
    finally:
        await host.cleanup()


async def test_conformance_kit(tiny_model_dir: Path) -> None:
    # The kit's default long request asks for 100k tokens, past this model's 512-token
    # context (a 400 by design); a long request that fits exercises the same cancel check.
    long_request = {
        "token_ids": [1, 2, 3, 4],
        "sampling_options": {"temperature": 0.0},
        "stop_conditions": {"max_tokens": 500, "ignore_eos": True},
    }
    await run_conformance(
        TransformersEngine, ["--model", str(tiny_model_dir)], long_request=long_request
    )

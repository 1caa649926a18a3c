"""``--generation-config``: a model's generation_config.json supplies the sampling options
and the length a request leaves out, as in vLLM."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from penstock.engines.transformers import TransformersEngine
from penstock.engines.transformers.generation_config import GenerationConfigError
from tests.engines.transformers.conftest import start_engine
from tests.engines.transformers.helpers import PROMPT, greedy, run, tokens


def with_generation_config(source: Path, target: Path, config: dict[str, Any] | str) -> Path:
    """A copy of ``source`` whose generation_config.json adds ``config`` (or is that text)."""
    shutil.copytree(source, target)
    path = target / "generation_config.json"
    if isinstance(config, str):
        path.write_text(config)
    else:
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return target


def unset(seed: int, **stop: Any) -> dict[str, Any]:
    """A request that sets neither temperature nor (unless given) max_tokens."""
    return {
        "token_ids": PROMPT,
        "sampling_options": {"seed": seed},
        "stop_conditions": {"ignore_eos": True, **stop},
    }


async def test_temperature_from_the_config_applies_when_the_request_sets_none(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    folder = with_generation_config(tiny_model_dir, tmp_path / "m", {"temperature": 0.0})
    engine = await start_engine(folder)
    try:
        expected = await tokens(engine, greedy(max_tokens=16))
        assert await tokens(engine, unset(1, max_tokens=16)) == expected
        assert await tokens(engine, unset(2, max_tokens=16)) == expected
        asked_to_sample = unset(1, max_tokens=16)
        asked_to_sample["sampling_options"]["temperature"] = 5.0
        assert await tokens(engine, asked_to_sample) != expected
    finally:
        await engine.cleanup()


async def test_vllm_mode_ignores_the_models_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = with_generation_config(
        tiny_model_dir, tmp_path / "m", {"temperature": 0.0, "max_new_tokens": 3}
    )
    engine = await start_engine(folder, "--generation-config", "vllm")
    try:
        expected = await tokens(engine, greedy(max_tokens=16))
        # Temperature 1 with different seeds: different draws, not the greedy answer.
        first = await tokens(engine, unset(1, max_tokens=16))
        second = await tokens(engine, unset(2, max_tokens=16))
        assert expected not in (first, second)
        # No max_new_tokens either: generation runs to the end of the context.
        choice = (await run(engine, unset(1)))[0]
        assert (choice.finish_reason, len(choice.token_ids)) == ("length", 512 - len(PROMPT))
    finally:
        await engine.cleanup()


async def test_max_new_tokens_from_the_config_bounds_a_request_without_max_tokens(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    folder = with_generation_config(tiny_model_dir, tmp_path / "m", {"max_new_tokens": 5})
    engine = await start_engine(folder)
    try:
        bounded = (await run(engine, unset(1)))[0]
        assert (bounded.finish_reason, len(bounded.token_ids)) == ("length", 5)
        asked = (await run(engine, unset(1, max_tokens=9)))[0]
        assert (asked.finish_reason, len(asked.token_ids)) == ("length", 9)
    finally:
        await engine.cleanup()


async def test_a_default_longer_than_the_room_left_stops_at_the_context_end(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    folder = with_generation_config(tiny_model_dir, tmp_path / "m", {"max_new_tokens": 4096})
    engine = await start_engine(folder, "--max-model-len", "32")
    try:
        choice = (await run(engine, unset(1)))[0]
        assert (choice.finish_reason, len(choice.token_ids)) == ("length", 32 - len(PROMPT))
    finally:
        await engine.cleanup()


async def test_a_path_reads_the_config_of_another_folder(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "defaults"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 3})
    )
    plain = await start_engine(tiny_model_dir)
    try:
        expected = await tokens(plain, greedy(max_tokens=3))
    finally:
        await plain.cleanup()
    engine = await start_engine(tiny_model_dir, "--generation-config", str(elsewhere))
    try:
        choice = (await run(engine, unset(7)))[0]
        assert (choice.finish_reason, choice.token_ids) == ("length", expected)
    finally:
        await engine.cleanup()


async def test_a_path_without_a_generation_config_stops_startup(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(GenerationConfigError, match=r"no generation_config\.json in that folder"):
        await TransformersEngine.from_args(
            ["--model", str(tiny_model_dir), "--generation-config", str(tmp_path)]
        )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[0.2]", "must hold a JSON object"),
        ({"temperature": "low"}, "temperature must be a number"),
        ({"top_p": 1.5}, "top_p must be between"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ],
)
async def test_a_malformed_generation_config_stops_startup_with_the_fix(
    tiny_model_dir: Path, tmp_path: Path, config: dict[str, Any] | str, message: str
) -> None:
    folder = with_generation_config(tiny_model_dir, tmp_path / "m", config)
    with pytest.raises(GenerationConfigError) as caught:
        await TransformersEngine.from_args(["--model", str(folder)])
    text = str(caught.value)
    assert message in text
    assert str(folder / "generation_config.json") in text
    assert "--generation-config vllm" in text
    # The file is ignored in vllm mode, so it can't stop that start.
    await TransformersEngine.from_args(["--model", str(folder), "--generation-config", "vllm"])


async def test_null_and_unrelated_keys_leave_the_neutral_defaults(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    folder = with_generation_config(
        tiny_model_dir, tmp_path / "m", {"temperature": None, "max_length": 20, "num_beams": 4}
    )
    engine = await start_engine(folder)
    try:
        choice = (await run(engine, unset(1)))[0]
        assert len(choice.token_ids) == 512 - len(PROMPT)
    finally:
        await engine.cleanup()

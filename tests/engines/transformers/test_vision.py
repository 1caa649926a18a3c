"""The transformers engine on a tiny vision-language (LLaVA) checkpoint: images steer the
output, a repeated image is encoded once, image and text requests share the batch."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
from PIL import Image

from penstock.engines.contract import SUPPORTS_IMAGE_INPUT
from penstock.engines.transformers import TransformersEngine
from tests.engines.transformers.conftest import start_engine
from tests.engines.transformers.helpers import greedy, run, tokens
from tests.support.tiny_vlm import IMAGE_TOKENS_PER_IMAGE, build_tiny_vlm

TEXT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture
async def vlm(tiny_vlm_dir: Path) -> AsyncIterator[TransformersEngine]:
    engine = await start_engine(tiny_vlm_dir, "--cpu-threads", "1")
    yield engine
    await engine.cleanup()


def _image(color: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", (40, 40), color)
    image.paste((255 - color[0], color[1], 255 - color[2]), (0, 0, 20, 20))
    return image


def _with_images(engine: TransformersEngine, *images: Image.Image, **kw: Any) -> dict[str, Any]:
    assert engine.vision is not None
    placeholders = [engine.vision.image_token_id] * len(images)
    request = greedy([*TEXT[:2], *placeholders, *TEXT[2:]], **kw)
    request["multi_modal_data"] = {"image_url": [{"Decoded": image} for image in images]}
    return request


async def test_the_image_steers_greedy_output(
    vlm: TransformersEngine,
) -> None:
    red = await run(vlm, _with_images(vlm, _image((200, 20, 20)), max_tokens=8))
    blue = await tokens(vlm, _with_images(vlm, _image((20, 20, 200)), max_tokens=8))
    text_only = await tokens(vlm, greedy(TEXT, max_tokens=8))
    assert len(red[0].token_ids) == 8
    assert red[0].token_ids != blue
    assert red[0].token_ids != text_only
    assert red[0].usage is not None
    # Usage counts the image's feature tokens, as the KV does.
    assert red[0].usage["prompt_tokens"] == len(TEXT) + IMAGE_TOKENS_PER_IMAGE


async def test_no_block_of_an_image_request_is_cached_under_its_token_ids(
    vlm: TransformersEngine,
) -> None:
    # Its placeholder ids stand for features the ids do not name: another image would hit.
    red = _image((200, 20, 20))
    answer = await tokens(vlm, _with_images(vlm, red, max_tokens=40))
    assert len(answer) == 40
    assert vlm.scheduler is not None
    assert vlm.scheduler.usage().cached_blocks == 0


async def test_a_repeated_image_runs_the_vision_tower_once(vlm: TransformersEngine) -> None:
    assert vlm.vision is not None
    calls, hits = vlm.vision.encoder_calls, vlm.vision.cache_hits
    green = _image((20, 200, 20))
    first = await tokens(vlm, _with_images(vlm, green, max_tokens=6))
    # Equal pixels under a new object: the key is the content, not the identity.
    second = await tokens(vlm, _with_images(vlm, green.copy(), max_tokens=6))
    assert first == second
    assert (vlm.vision.encoder_calls, vlm.vision.cache_hits) == (calls + 1, hits + 1)
    both = await tokens(vlm, _with_images(vlm, green, _image((9, 9, 9)), max_tokens=4))
    assert len(both) == 4
    assert vlm.vision.encoder_calls == calls + 2
    text = vlm.prometheus_text()
    assert "penstock_engine_vision_encoder_calls_total" in text
    assert "penstock_engine_vision_encoder_cache_hits_total" in text


async def test_image_and_text_requests_batch_together_and_match_their_solo_runs(
    vlm: TransformersEngine,
) -> None:
    image_request = _with_images(vlm, _image((90, 30, 160)), max_tokens=12)
    text_request = greedy(TEXT, max_tokens=12)
    solo_image = await tokens(vlm, image_request)
    solo_text = await tokens(vlm, text_request)
    vlm.forward_pass_metrics.clear()
    together = await asyncio.gather(tokens(vlm, image_request), tokens(vlm, text_request))
    assert together == [solo_image, solo_text]
    assert any(
        record.scheduled_requests.num_decode_requests == 2 for record in vlm.forward_pass_metrics
    ), "the two requests decoded in one batch"


async def test_placeholders_that_do_not_match_the_images_are_refused(
    vlm: TransformersEngine,
) -> None:
    request = _with_images(vlm, _image((1, 2, 3)))
    request["token_ids"] = TEXT
    with pytest.raises(ValueError, match="0 image placeholder token"):
        await run(vlm, request)
    assert vlm.vision is not None
    with pytest.raises(ValueError, match="carries no image"):
        await run(vlm, greedy([*TEXT, vlm.vision.image_token_id]))


async def test_only_a_vlm_advertises_image_input(tiny_model_dir: Path) -> None:
    engine, _ = await TransformersEngine.from_args(["--model", str(tiny_model_dir)])
    config = await engine.start(0)
    try:
        assert config.runtime_data[SUPPORTS_IMAGE_INPUT] is False
        request = greedy(TEXT)
        request["multi_modal_data"] = {"image_url": [{"Decoded": _image((1, 1, 1))}]}
        with pytest.raises(ValueError, match="text only"):
            await run(engine, request)
    finally:
        await engine.cleanup()


async def test_new_weights_drop_the_cached_image_features(vlm: TransformersEngine) -> None:
    assert vlm.vision is not None
    picture = _image((70, 70, 140))
    before = await tokens(vlm, _with_images(vlm, picture, max_tokens=6))
    calls = vlm.vision.encoder_calls
    name = next(
        n for n in vlm.model.state_dict() if n.endswith("multi_modal_projector.linear_2.weight")
    )
    pushed = {name: vlm.model.state_dict()[name].neg().contiguous()}
    payload = base64.b64encode(safetensors.torch.save(pushed)).decode()
    await vlm.engine_control("pause_generation", {"mode": "wait"})
    updated = await vlm.engine_update(
        "update_weights_from_tensor", {"serialized_named_tensors": [payload]}
    )
    assert updated["status"] == "ok", updated
    await vlm.engine_control("resume_generation", {})
    after = await tokens(vlm, _with_images(vlm, picture, max_tokens=6))
    assert vlm.vision.encoder_calls == calls + 1
    assert after != before, "the image was encoded again, by the new projector"


def test_a_llava_folder_updates_from_disk_under_its_loaded_names(tiny_vlm_dir: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    from penstock.engines.transformers.weights.checkpoint import (
        apply_weight_update,
        plan_weight_update,
        read_safetensors,
    )

    # The folder names tensors as LLaVA was saved (language_model.model.*); the loaded
    # model as transformers renames them (model.language_model.*).
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    fresh = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    apply_weight_update(plan_weight_update(model, read_safetensors(tiny_vlm_dir)))
    assert all(torch.equal(model.state_dict()[name], fresh[name]) for name in fresh)

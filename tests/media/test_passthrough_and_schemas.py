"""Media request schemas: unknown fields travel to the engine only after screening."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from penstock.schemas.images import NvCreateImageRequest, NvImagesResponse
from penstock.schemas.media_passthrough import (
    MEDIA_PASSTHROUGH_KEY,
    MediaPassthroughRejected,
    sanitize_media_passthrough,
)
from penstock.schemas.video import NvCreateVideoRequest, NvVideosResponse, VideoData


@pytest.mark.parametrize(
    "key",
    [
        "extra_args",
        "guardrails",
        "frame_interpolation_model_path",
        "_private",
        "lora_PATH",
        "checkpoint_dir",
        "vae_ckpt",
        "repo_id",
        "hub_token",
        "callback_url",
        "weights_uri",
        "local_dir",
        "disable_guardrail",
        "safety_checker",
        "NSFW_filter",
        "moderation_level",
    ],
)
def test_sanitiser_rejects_keys_reaching_files_remotes_and_safety(key: str) -> None:
    with pytest.raises(MediaPassthroughRejected) as caught:
        sanitize_media_passthrough({MEDIA_PASSTHROUGH_KEY: {key: 1, "strength": 0.5}})
    assert caught.value.keys == [key]


def test_sanitiser_lists_every_rejected_key_sorted_and_copies_the_rest() -> None:
    with pytest.raises(MediaPassthroughRejected) as caught:
        sanitize_media_passthrough({MEDIA_PASSTHROUGH_KEY: {"zz_path": 1, "_a": 2, "ok": 3}})
    assert caught.value.keys == ["_a", "zz_path"]
    assert "_a, zz_path" in str(caught.value)
    knobs = {"strength": 0.5, "output_format": "webp"}
    screened = sanitize_media_passthrough({MEDIA_PASSTHROUGH_KEY: knobs})
    assert screened == knobs and screened is not knobs
    assert sanitize_media_passthrough(None) == {}


def test_video_request_nests_unknown_fields_and_drops_nothing() -> None:
    request = NvCreateVideoRequest.model_validate(
        {"prompt": "a cat", "model": "m", "seconds": "4", "strength": 0.4, "nvext": {"seed": 7}}
    )
    assert request.seconds == 4
    assert request.to_engine_request() == {
        "prompt": "a cat",
        "model": "m",
        "seconds": 4,
        "nvext": {"seed": 7},
        "extra_args": {MEDIA_PASSTHROUGH_KEY: {"strength": 0.4}},
    }
    plain = NvCreateVideoRequest.model_validate({"prompt": "a cat", "model": "m"})
    assert "extra_args" not in plain.to_engine_request()


def test_client_sent_extra_args_is_an_unknown_field_and_is_refused() -> None:
    request = NvCreateVideoRequest.model_validate(
        {"prompt": "a", "model": "m", "extra_args": {"anything": 1}}
    )
    assert request.extra_args is None
    with pytest.raises(MediaPassthroughRejected) as caught:
        request.to_engine_request()
    assert caught.value.keys == ["extra_args"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m"},
        {"prompt": "a"},
        {"prompt": "a", "model": "m", "response_format": "gif"},
        {"prompt": "a", "model": "m", "nvext": {"fps": 0}},
        {"prompt": "a", "model": "m", "nvext": {"num_frame": 9}},
    ],
)
def test_video_request_rejects_bad_values(body: dict) -> None:
    with pytest.raises(ValidationError):
        NvCreateVideoRequest.model_validate(body)


def test_video_response_omits_absent_fields() -> None:
    response = NvVideosResponse(
        id="v", model="m", created=5, data=[VideoData(output_format="mp4", url="u")]
    )
    assert response.wire() == {
        "id": "v",
        "object": "video",
        "model": "m",
        "status": "completed",
        "progress": 100,
        "created": 5,
        "data": [{"output_format": "mp4", "url": "u"}],
    }


def test_image_request_bounds_and_passthrough() -> None:
    with pytest.raises(ValidationError):
        NvCreateImageRequest.model_validate({"prompt": "a", "n": 11})
    with pytest.raises(ValidationError):
        NvCreateImageRequest.model_validate({"prompt": "a", "style": "baroque"})
    request = NvCreateImageRequest.model_validate({"prompt": "a", "output_format": "webp"})
    assert request.to_engine_request()["extra_args"] == {
        MEDIA_PASSTHROUGH_KEY: {"output_format": "webp"}
    }
    assert NvImagesResponse(created=1).wire() == {"created": 1, "data": []}

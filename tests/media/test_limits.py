"""Resolving and checking what a video request asks of a model."""

from __future__ import annotations

import pytest

from penstock.multimodal.limits import MediaParamError, VideoLimits, parse_size, plan_video

WAN = VideoLimits(
    default_size="128x128",
    default_fps=8,
    default_seconds=2,
    default_num_inference_steps=4,
    size_multiple=16,
    frames_step=4,
    max_num_frames=257,
)


def plan(**asked: object):  # type: ignore[no-untyped-def]
    values = {
        "size": None,
        "seconds": None,
        "fps": None,
        "num_frames": None,
        "num_inference_steps": None,
    }
    values.update(asked)
    return plan_video(limits=WAN, max_width=1920, max_height=1080, **values)  # type: ignore[arg-type]


def test_defaults_come_from_the_model() -> None:
    resolved = plan()
    assert (resolved.size, resolved.fps, resolved.num_inference_steps) == ("128x128", 8, 4)
    assert resolved.num_frames == 17 and resolved.seconds == "2"


def test_seconds_round_up_to_a_frame_count_the_model_can_make() -> None:
    assert plan(seconds=4, fps=24).num_frames == 97
    assert plan(seconds=1, fps=16).num_frames == 17


def test_num_frames_beats_seconds() -> None:
    resolved = plan(seconds=4, num_frames=9, fps=8)
    assert resolved.num_frames == 9 and resolved.seconds == "1.12"


@pytest.mark.parametrize(
    ("asked", "param", "words"),
    [
        ({"size": "832"}, "size", ["WIDTHxHEIGHT"]),
        ({"size": "63x64"}, "size", ["multiples of 16"]),
        ({"size": "0x64"}, "size", ["positive"]),
        ({"size": "3840x1024"}, "size", ["1920x1080"]),
        ({"num_frames": 6}, "nvext.num_frames", ["1 + 4k", "257", "5, 9"]),
        ({"num_frames": 261}, "nvext.num_frames", ["257"]),
        ({"seconds": 0}, "seconds", ["1 to 32"]),
        ({"seconds": 40}, "seconds", ["1 to 32", "257 frames"]),
        ({"fps": 500}, "nvext.fps", ["1 to 120"]),
        ({"num_inference_steps": 5000}, "nvext.num_inference_steps", ["1 to 1000"]),
    ],
)
def test_bad_values_name_the_field_and_the_valid_values(
    asked: dict, param: str, words: list[str]
) -> None:
    with pytest.raises(MediaParamError) as caught:
        plan(**asked)
    assert caught.value.param == param
    for word in words:
        assert word in caught.value.message


def test_generic_limits_need_only_an_even_size() -> None:
    assert parse_size("34x18", param="size", multiple=1, max_width=64, max_height=64) == (34, 18)
    with pytest.raises(MediaParamError, match="even"):
        parse_size("33x18", param="size", multiple=1, max_width=64, max_height=64)


def test_limits_round_trip_through_runtime_data() -> None:
    assert VideoLimits.from_runtime_data(WAN.to_runtime_data()) == WAN
    assert VideoLimits.from_runtime_data(None) == VideoLimits()
    newer = {"media": {"frames_step": 4, "a_future_limit": 1}}
    assert VideoLimits.from_runtime_data(newer).frames_step == 4

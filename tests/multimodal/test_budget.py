"""The decoded media budget: charges follow the decoded objects, a full budget is a 503
with Retry-After, an item larger than the budget a 413, and the image cache lets go."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from PIL import Image

from penstock.errors import PayloadTooLargeError
from penstock.multimodal import ImageLoader
from penstock.multimodal.audio_loader import decode_audio
from penstock.multimodal.budget import (
    REQUEST_MEDIA,
    DecodedMediaBudget,
    MediaMemoryBusy,
    RequestMedia,
)
from tests.support.media_files import data_url, flac, png

MIB = 1024 * 1024


def test_a_charge_follows_the_object_it_is_kept_with() -> None:
    budget = DecodedMediaBudget(10 * MIB)
    charge = budget.charge(6 * MIB, "first")
    pixels = np.zeros(MIB, np.uint8)
    charge.keep(pixels, MIB)
    assert budget.used_bytes == MIB
    del pixels
    gc.collect()
    assert budget.used_bytes == 0


def test_a_full_budget_is_busy_and_an_oversized_item_too_large() -> None:
    budget = DecodedMediaBudget(10 * MIB)
    held = budget.charge(8 * MIB, "held")
    with pytest.raises(MediaMemoryBusy) as busy:
        budget.charge(4 * MIB, "second")
    assert busy.value.status_code == 503 and busy.value.headers["Retry-After"] == "1"
    with pytest.raises(PayloadTooLargeError, match="PENSTOCK_MEDIA_DECODED_MAX_MB"):
        budget.charge(11 * MIB, "huge")
    held.release()
    budget.charge(4 * MIB, "second").release()
    assert budget.used_bytes == 0


async def test_the_image_cache_is_bounded_in_bytes_and_emptied_for_the_budget() -> None:
    budget = DecodedMediaBudget(8 * MIB)
    loader = ImageLoader(cache_size=8, cache_max_bytes=2 * MIB, budget=budget)
    urls = [data_url(png(512, 512, (i, 0, 0))) for i in range(4)]
    for url in urls:
        image = await loader.load_image(url)
    # 768 KB each: two fit in the cache's 2 MB.
    assert loader.cache_entries == 2
    del image
    gc.collect()
    assert budget.used_bytes == 2 * 512 * 512 * 3
    # Half a MB left: a 768 KB load fits only once the cache has let go.
    held = budget.charge(budget.limit_bytes - budget.used_bytes, "others")
    held.release(MIB // 2)
    held_size = budget.used_bytes - 2 * 512 * 512 * 3
    assert isinstance(await loader.load_image(data_url(png(512, 512, (9, 9, 9)))), Image.Image)
    assert loader.cache_entries == 1
    assert budget.used_bytes == held_size + 512 * 512 * 3


def test_audio_above_48_khz_is_resampled_into_one_charged_buffer() -> None:
    budget = DecodedMediaBudget(64 * MIB)
    waveform, rate = decode_audio(
        flac(2.0, 655_350), "clip", sample_rate=None, max_duration_s=5, budget=budget
    )
    assert rate == 48_000 and abs(waveform.size - 96_000) < 1000
    assert waveform.dtype == np.float32 and waveform.base is None
    assert budget.used_bytes == waveform.nbytes
    del waveform
    gc.collect()
    assert budget.used_bytes == 0


def test_a_request_whose_own_media_pass_the_budget_is_too_large() -> None:
    budget = DecodedMediaBudget(10 * MIB)
    token = REQUEST_MEDIA.set(RequestMedia())
    try:
        charges = [budget.charge(4 * MIB, "first"), budget.charge(4 * MIB, "second")]
        with pytest.raises(PayloadTooLargeError, match=r"this request decode to 12\.0 MB"):
            budget.charge(4 * MIB, "third")
    finally:
        REQUEST_MEDIA.reset(token)
    with pytest.raises(MediaMemoryBusy):
        budget.charge(4 * MIB, "another request's")
    for charge in charges:
        charge.release()

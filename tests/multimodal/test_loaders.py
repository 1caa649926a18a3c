"""Images and audio from data URLs, http(s) (through a stand-in HttpClient), and allowed
local files; the limits and the status each failure carries."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from penstock.errors import (
    HttpConnectionError,
    HttpStatusError,
    HttpTimeoutError,
    UrlValidationError,
)
from penstock.http import HttpClient, UrlValidationPolicy
from penstock.multimodal import AudioLoader, ImageLoader


class StubClient(HttpClient):
    """Answers from a dict: bytes, or an exception to raise."""

    def __init__(self, answers: dict[str, bytes | Exception]) -> None:
        super().__init__()
        self.answers = answers
        self.calls: list[str] = []

    async def fetch_bytes(self, url: str, timeout: float, **kwargs: object) -> bytes:  # noqa: ASYNC109
        self.calls.append(url)
        await asyncio.sleep(0.01)
        answer = self.answers[url]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def _request(self, *args: object) -> object:
        raise NotImplementedError

    def _translate(self, exc: Exception, url: str) -> Exception:
        raise NotImplementedError

    async def close(self) -> None:
        return None


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (8, 6), mode: str = "RGBA") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, (200, 10, 10, 255)[: len(mode)]).save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def wav_bytes(seconds: float, rate: int = 8000, channels: int = 1) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=rate)
        stream.layout = "mono" if channels == 1 else "stereo"
        t = np.arange(int(seconds * rate)) / rate
        tone = (np.sin(2 * np.pi * 440 * t) * 8000).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(
            np.repeat(tone[None, :], channels, axis=0).reshape(1, -1),
            format="s16",
            layout=stream.layout,
        )
        frame.rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


PNG = image_bytes()


def truncated_png() -> bytes:
    buffer = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buffer, format="PNG")
    return buffer.getvalue()[: len(buffer.getvalue()) // 2]


POLICY = UrlValidationPolicy()


def loader(answers: dict[str, bytes | Exception] | None = None, **kwargs: object) -> ImageLoader:
    return ImageLoader(url_policy=POLICY, http_client=StubClient(answers or {}), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
async def test_data_urls_decode_to_rgb(fmt: str) -> None:
    mode = "RGB" if fmt == "JPEG" else "RGBA"
    image = await loader().load_image(data_url(f"image/{fmt.lower()}", image_bytes(fmt, mode=mode)))
    assert image.mode == "RGB" and image.size == (8, 6)


@pytest.mark.parametrize(
    ("url", "error", "status"),
    [
        (data_url("image/gif", image_bytes("GIF", mode="P")), HttpStatusError, 415),
        (data_url("image/png", b"not an image"), HttpStatusError, 415),
        (data_url("image/png", truncated_png()), HttpStatusError, 400),
        (data_url("image/png", image_bytes(size=(100, 60))), HttpStatusError, 413),
        (data_url("text/plain", PNG), ValueError, None),
        ("data:image/png,rawbytes", UrlValidationError, None),
        ("data:image/png;base64,@@@", UrlValidationError, None),
        (data_url("image/png", b"x" * 5000), UrlValidationError, None),
        ("ftp://media.test/a.png", UrlValidationError, None),
        ("", ValueError, None),
    ],
)
async def test_bad_images_fail_with_a_client_status(
    url: str, error: type[Exception], status: int | None
) -> None:
    with pytest.raises(error) as failed:
        await loader(max_pixels=5000, max_bytes=4096).load_image(url)
    if status is not None:
        assert failed.value.status == status  # type: ignore[attr-defined]


async def test_fetch_failures_keep_their_meaning() -> None:
    answers: dict[str, bytes | Exception] = {
        "https://media.test/slow.png": HttpTimeoutError("slow"),
        "https://media.test/down.png": HttpConnectionError("refused"),
        "https://media.test/gone.png": HttpStatusError(
            404, "Not Found", "https://media.test/gone.png"
        ),
        "https://media.test/empty.png": b"",
    }
    images = loader(answers)
    for name, status in (("slow", 408), ("down", 400), ("gone", 404)):
        with pytest.raises(HttpStatusError) as failed:
            await images.load_image(f"https://media.test/{name}.png")
        assert failed.value.status == status
    with pytest.raises(ValueError, match="empty"):
        await images.load_image("https://media.test/empty.png")


async def test_fetched_images_are_cached_and_concurrent_loads_share_a_fetch() -> None:
    stub = StubClient({"https://media.test/a.png": PNG, "https://media.test/b.png": PNG})
    images = ImageLoader(cache_size=1, url_policy=POLICY, http_client=stub)
    same = await asyncio.gather(*(images.load_image("https://media.test/a.png") for _ in range(5)))
    assert all(image is same[0] for image in same) and stub.calls == ["https://media.test/a.png"]
    assert await images.load_image("HTTPS://MEDIA.TEST/a.png#frag") is same[0]
    await images.load_image("https://media.test/b.png")
    assert images.cache_entries == 1
    await images.load_image("https://media.test/a.png")
    assert len(stub.calls) == 3


async def test_local_images_only_under_allowed_folders(tmp_path: Path) -> None:
    (tmp_path / "cat.png").write_bytes(PNG)
    allowed = ImageLoader(
        url_policy=UrlValidationPolicy(allowed_local_roots=(str(tmp_path),)),
        http_client=StubClient({}),
    )
    assert (await allowed.load_image((tmp_path / "cat.png").as_uri())).size == (8, 6)
    with pytest.raises(UrlValidationError):
        await loader().load_image((tmp_path / "cat.png").as_uri())
    with pytest.raises(UrlValidationError):
        await allowed.load_image("file:///etc/hostname")


async def test_batches_keep_order_slots_and_the_most_telling_error() -> None:
    images = loader({"https://media.test/a.png": PNG, "https://media.test/x": b"junk"})
    good = {"Url": "https://media.test/a.png"}
    loaded = await images.load_image_batch(
        [good, {"UuidOnly": "u1"}, good], preserve_uuid_slots=True
    )
    assert loaded[1] is None and loaded[0].size == (8, 6)
    with pytest.raises(ValueError, match="item 1 is UuidOnly"):
        await images.load_image_batch([good, {"UuidOnly": "u1"}])
    with pytest.raises(ValueError, match="item 0 must have exactly one"):
        await images.load_image_batch([{"Url": "a", "UuidOnly": "b"}])
    with pytest.raises(ValueError, match="decoded media"):
        await images.load_image_batch([{"Decoded": {}}])
    with pytest.raises(HttpStatusError) as failed:
        await images.load_image_batch(
            [{"Url": "file:///etc/passwd"}, {"Url": "https://media.test/x"}, good]
        )
    assert failed.value.status == 415


async def test_audio_decodes_to_mono_float32_and_resamples() -> None:
    audio = AudioLoader(url_policy=POLICY, http_client=StubClient({}))
    waveform, rate = await audio.load_audio(data_url("audio/wav", wav_bytes(0.5, channels=2)))
    assert rate == 8000.0 and waveform.dtype == np.float32 and waveform.ndim == 1
    assert abs(waveform.size - 4000) < 64 and 0.1 < np.abs(waveform).max() <= 1.0
    resampling = AudioLoader(url_policy=POLICY, http_client=StubClient({}), sample_rate=16000)
    waveform, rate = await resampling.load_audio(data_url("audio/wav", wav_bytes(0.5)))
    assert rate == 16000.0 and abs(waveform.size - 8000) < 128


async def test_audio_limits_and_failures() -> None:
    stub = StubClient({"https://media.test/a.wav": wav_bytes(0.2), "https://media.test/x": b"junk"})
    audio = AudioLoader(url_policy=POLICY, http_client=stub, max_duration_s=1.0)
    with pytest.raises(HttpStatusError) as failed:
        await audio.load_audio(data_url("audio/wav", wav_bytes(2.0)))
    assert failed.value.status == 413
    with pytest.raises(ValueError, match="Failed to load audio"):
        await audio.load_audio("https://media.test/x")
    with pytest.raises(ValueError, match="must hold audio"):
        await audio.load_audio(data_url("image/png", PNG))
    with pytest.raises(ValueError):
        AudioLoader(http_timeout=0)
    batch = await audio.load_audio_batch([{"Url": "https://media.test/a.wav"}])
    assert batch[0][1] == 8000.0
    with pytest.raises(UrlValidationError):
        await audio.load_audio_batch([{"Url": "https://media.test/x"}, {"Url": "gopher://h/"}])


async def test_the_environments_limits_are_read_at_each_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cat.png").write_bytes(PNG)
    images = ImageLoader(
        url_policy=UrlValidationPolicy(allowed_local_roots=(str(tmp_path),)),
        http_client=StubClient({}),
    )
    seeded = ImageLoader(http_client=StubClient({}))
    assert (await images.load_image((tmp_path / "cat.png").as_uri())).size == (8, 6)
    assert (await seeded.load_image(data_url("image/png", PNG))).size == (8, 6)
    images.clear_cache()
    seeded.clear_cache()
    monkeypatch.setenv("DYN_MM_MAX_FILE_SIZE_MB", str(8 / 1024 / 1024))
    monkeypatch.setenv("DYN_MM_MAX_DATA_URL_MB", str(8 / 1024 / 1024))
    with pytest.raises(UrlValidationError, match="exceeds"):
        await images.load_image((tmp_path / "cat.png").as_uri())
    with pytest.raises(UrlValidationError, match="over the limit"):
        await seeded.load_image(data_url("image/png", PNG))


async def test_the_seeds_local_path_opens_no_file(tmp_path: Path) -> None:
    (tmp_path / "cat.png").write_bytes(PNG)
    policy = UrlValidationPolicy(allowed_local_path=str(tmp_path))
    with pytest.raises(UrlValidationError):
        await ImageLoader(url_policy=policy, http_client=StubClient({})).load_image(
            (tmp_path / "cat.png").as_uri()
        )
    honoured = ImageLoader(url_policy=policy, http_client=StubClient({}), honour_local_path=True)
    assert (await honoured.load_image((tmp_path / "cat.png").as_uri())).size == (8, 6)

"""The gateway's media loading: the references of one request, fetched and decoded at once.

One :class:`MediaInputs` per server holds the :class:`ImageLoader` and the
:class:`AudioLoader`, both on the server's one :class:`~penstock.http.HttpClient` and the
URL policy of its settings. A request's references load concurrently (fetches on the
event loop, decoding in worker threads); the first failure, in the order the request
named them, is the answer, and the other loads are cancelled.

Every failure is a client-visible error whose ``param`` is where the request named the
reference (``messages[0].content[1].image_url.url``): a URL the policy refuses is a 400
that says so, an image or clip over its limit a 413 naming the flag that sets it. The
references of one kind in one request count together against the decoded media budget
(:mod:`penstock.multimodal.budget`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from penstock.errors import (
    HttpStatusError,
    InvalidRequestError,
    PayloadTooLargeError,
    PenstockError,
    UrlValidationError,
    clip,
)
from penstock.extras import VIDEO_INSTALL, import_optional
from penstock.http import HttpClient, UrlValidationPolicy, env
from penstock.multimodal.budget import REQUEST_MEDIA, RequestMedia
from penstock.multimodal.image_loader import ImageLoader, decode_image_bytes

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

    from penstock.multimodal.audio_loader import AudioLoader
    from penstock.settings import Settings

T = TypeVar("T")

_PIXELS_FLAG = "--media-max-image-pixels"

_POLICY_HINT = (
    "operators widen it with --allowed-media-domain, --allowed-media-network, "
    "--media-allow-http and --allowed-local-media-path"
)


@dataclass(frozen=True)
class MediaRef:
    """A media reference and where the request named it."""

    url: str
    param: str


class MediaInputs:
    """Loads the media references of requests under one policy and one set of limits."""

    def __init__(
        self,
        client: HttpClient,
        policy: UrlValidationPolicy,
        *,
        fetch_timeout_s: float,
        max_bytes: int,
        max_image_pixels: int,
        max_audio_s: float,
    ) -> None:
        self.client = client
        self.policy = policy
        self.fetch_timeout_s = fetch_timeout_s
        self.max_bytes = max_bytes
        self.max_audio_s = max_audio_s
        self.images = ImageLoader(
            http_timeout=fetch_timeout_s,
            url_policy=policy,
            http_client=client,
            max_bytes=max_bytes,
            max_pixels=max_image_pixels,
            honour_local_path=True,
        )
        self._audio: AudioLoader | None = None

    @classmethod
    def from_settings(cls, settings: Settings, client: HttpClient) -> MediaInputs:
        return cls(
            client,
            UrlValidationPolicy.from_settings(settings),
            fetch_timeout_s=settings.media_fetch_timeout_s,
            max_bytes=env.fetch_max_bytes(settings),
            max_image_pixels=settings.media_max_image_pixels,
            max_audio_s=settings.media_max_audio_s,
        )

    @property
    def audio(self) -> AudioLoader:
        # PyAV is imported with the first clip, not with the server.
        if self._audio is None:
            import_optional("av", needed_for="decoding audio", install=VIDEO_INSTALL)
            from penstock.multimodal.audio_loader import AudioLoader

            self._audio = AudioLoader(
                http_timeout=self.fetch_timeout_s,
                url_policy=self.policy,
                http_client=self.client,
                max_bytes=self.max_bytes,
                max_duration_s=self.max_audio_s,
                honour_local_path=True,
            )
        return self._audio

    async def load_images(self, refs: Sequence[MediaRef]) -> list[Image.Image]:
        """RGB images, in the order of ``refs``."""
        return await _load_all(refs, self.images.load_image, _PIXELS_FLAG)

    async def decode_image(self, data: bytes, param: str) -> Image.Image:
        """RGB pixels of image bytes a client sent as they are (an upload), under the same
        pixel limit and budget as a reference."""
        images = self.images

        async def decode(label: str) -> Image.Image:
            return await decode_image_bytes(data, label, images.max_pixels, images.budget)

        return await _load_one(MediaRef(param, param), decode, _PIXELS_FLAG)

    async def load_audio(self, refs: Sequence[MediaRef]) -> list[tuple[np.ndarray, float]]:
        """``(mono float32 waveform, sample rate)`` per reference, in order."""
        return await _load_all(refs, self.audio.load_audio, "--media-max-audio-s")


async def _load_all(
    refs: Sequence[MediaRef], load: Callable[[str], Awaitable[T]], limit_flag: str
) -> list[T]:
    token = REQUEST_MEDIA.set(RequestMedia())
    try:
        tasks = [asyncio.ensure_future(_load_one(ref, load, limit_flag)) for ref in refs]
    finally:
        REQUEST_MEDIA.reset(token)
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
    # Every finished task's exception is read, so none is reported as never retrieved.
    errors = [task.exception() if task.done() and not task.cancelled() else None for task in tasks]
    for error in errors:
        if error is not None:
            raise error
    return [task.result() for task in tasks]


async def _load_one(ref: MediaRef, load: Callable[[str], Awaitable[T]], limit_flag: str) -> T:
    try:
        return await load(ref.url)
    except UrlValidationError as exc:
        raise UrlValidationError(
            f"{ref.param} was refused by the media URL policy: {exc.message}"
            + ("" if "--" in exc.message else f" ({_POLICY_HINT})"),
            param=ref.param,
            code=exc.code,
        ) from exc
    except HttpStatusError as exc:
        if exc.status == 413:
            raise PayloadTooLargeError(
                f"{ref.param}: {exc.message} (the server's {limit_flag})",
                param=ref.param,
                code="media_too_large",
            ) from exc
        exc.param = clip(ref.param)
        raise
    except PenstockError as exc:
        if exc.param is None:
            exc.param = clip(ref.param)
        raise
    except ValueError as exc:
        raise InvalidRequestError(
            f"{ref.param}: {exc}", param=ref.param, code="invalid_media"
        ) from exc

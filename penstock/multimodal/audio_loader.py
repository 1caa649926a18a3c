"""Audio of multimodal requests, from reference to a mono float32 waveform (``AudioLoader``).

References are resolved as for images (:mod:`penstock.multimodal.media_source`: data
URLs, http(s) through the SSRF-safe client, ``file://`` or bare paths under an
operator-allowed folder). PyAV decodes any container and codec it knows; the audio is
mixed down to mono float32 and, when ``sample_rate`` is given, resampled to it (else it
keeps its native rate, as upstream, up to :data:`MAX_SAMPLE_RATE`: a higher rate is
resampled down to it while decoding). The duration limit is checked from the container's
header and again while decoding, so a long file is refused without decoding it whole;
the samples go into one buffer charged to the decoded media budget
(:mod:`penstock.multimodal.budget`).
"""

from __future__ import annotations

import asyncio
import io
import math
from typing import Any

import av
import numpy as np

from penstock.errors import HttpStatusError
from penstock.http import HttpClient, UrlValidationPolicy, describe_media_source
from penstock.multimodal.budget import DECODED_MEDIA, Charge, DecodedMediaBudget
from penstock.multimodal.image_loader import gather_media
from penstock.multimodal.media_source import (
    FROM_ENVIRONMENT,
    ByteLimit,
    fetch_media,
    load_rules,
)

DEFAULT_MAX_DURATION_S = 600.0
# Audio models listen at 16 to 48 kHz; a clip above this rate is resampled down to it as it
# is decoded, so its samples are bounded by its duration whatever rate it declares.
MAX_SAMPLE_RATE = 48_000


def _too_long(seconds: float, limit: float, label: str) -> HttpStatusError:
    return HttpStatusError(413, f"audio lasts {seconds:.1f}s, over the limit of {limit:g}s", label)


def _samples_in(seconds: float, rate: int) -> int:
    # A resampler's last samples may run a little past the duration.
    return math.ceil(seconds * rate) + rate // 50


class _Samples:
    """The decoded waveform: one float32 buffer, charged to the budget as it is sized, never
    longer than the duration limit allows."""

    def __init__(
        self, capacity: int, charge: Charge, label: str, rate: int, max_duration_s: float
    ) -> None:
        self.buffer = np.empty(capacity, np.float32)
        self.size = 0
        self.charge = charge
        self.label = label
        self.rate = rate
        self.max_duration_s = max_duration_s
        self.limit = _samples_in(max_duration_s, rate)

    def append(self, chunk: np.ndarray) -> None:
        end = self.size + chunk.size
        if end > self.limit:
            raise _too_long(end / self.rate, self.max_duration_s, self.label)
        if end > self.buffer.size:
            # The header said less than the stream holds: grow, within the duration bound.
            capacity = min(max(end, 2 * self.buffer.size), self.limit)
            self.charge.grow(4 * (capacity - self.buffer.size), self.label)
            self.buffer.resize(capacity, refcheck=False)
        self.buffer[self.size : end] = chunk
        self.size = end

    def waveform(self) -> np.ndarray:
        self.buffer.resize(self.size, refcheck=False)
        self.charge.keep(self.buffer, self.buffer.nbytes)
        return self.buffer


def decode_audio(
    data: bytes,
    label: str,
    *,
    sample_rate: int | None,
    max_duration_s: float,
    budget: DecodedMediaBudget = DECODED_MEDIA,
) -> tuple[np.ndarray, float]:
    """Mono float32 samples and their rate; ValueError when PyAV can't decode ``data``.

    The rate is ``sample_rate``, else the clip's own up to :data:`MAX_SAMPLE_RATE`. The
    samples are charged to ``budget`` from the header's duration (or the duration limit)
    before any is decoded, and land in one buffer."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise ValueError(f"no audio stream in {label}")
            stream = container.streams.audio[0]
            declared = None
            if stream.duration is not None and stream.time_base is not None:
                declared = float(stream.duration * stream.time_base)
                if declared > max_duration_s:
                    raise _too_long(declared, max_duration_s, label)
            if not stream.rate:
                raise ValueError(f"audio in {label} has no sample rate")
            rate = sample_rate or min(stream.rate, MAX_SAMPLE_RATE)
            limit = _samples_in(max_duration_s, rate)
            capacity = limit if declared is None else min(limit, _samples_in(declared, rate))
            charge = budget.charge(4 * capacity, label, reclaim=False)
            samples = _Samples(capacity, charge, label, rate, max_duration_s)
            try:
                _decode_into(container, stream, samples)
            except BaseException:
                samples.charge.release()
                raise
    except (av.FFmpegError, UnicodeDecodeError) as exc:
        raise ValueError(f"Failed to load audio from {label}: {exc}") from exc
    if samples.size == 0:
        samples.charge.release()
        raise ValueError(f"audio from {label} is empty")
    return samples.waveform(), float(rate)


def _decode_into(container: Any, stream: Any, samples: _Samples) -> None:
    resampler = av.AudioResampler(format="flt", layout="mono", rate=samples.rate)
    for frame in container.decode(stream):
        for out in resampler.resample(frame):
            samples.append(out.to_ndarray().reshape(-1))
    for out in resampler.resample(None):
        samples.append(out.to_ndarray().reshape(-1))


class AudioLoader:
    """Async audio loader for multimodal pipelines."""

    def __init__(
        self,
        http_timeout: float = 30.0,
        enable_frontend_decoding: bool = False,
        url_policy: UrlValidationPolicy | None = None,
        *,
        http_client: HttpClient | None = None,
        max_bytes: ByteLimit = FROM_ENVIRONMENT,
        max_duration_s: float = DEFAULT_MAX_DURATION_S,
        sample_rate: int | None = None,
        honour_local_path: bool = False,
    ) -> None:
        if http_timeout <= 0:
            raise ValueError(f"http_timeout must be > 0, got {http_timeout}")
        self.http_timeout = http_timeout
        self.url_policy = url_policy
        self.max_bytes = max_bytes
        self.honour_local_path = honour_local_path
        self.max_duration_s = max_duration_s
        self.sample_rate = sample_rate
        self._client = http_client
        self._receiver: Any = None
        if enable_frontend_decoding:
            from penstock.multimodal.transfer import NixlReadEmbeddingReceiver
            from penstock.nixl_agent import nixl_api

            nixl_api()
            self._receiver = NixlReadEmbeddingReceiver(max_items=0)

    def _http(self) -> HttpClient:
        if self._client is None:
            from penstock.http import get_default_client

            self._client = get_default_client()
        return self._client

    async def load_audio(self, audio_url: str) -> tuple[np.ndarray, float]:
        """``(waveform, sample_rate)``: mono float32 at the native rate, or at
        ``sample_rate`` when the loader was given one."""
        label = describe_media_source(audio_url)
        local = self.honour_local_path
        policy, max_bytes = load_rules(self.url_policy, self.max_bytes, honour_local_path=local)
        media = await fetch_media(
            audio_url,
            "the audio",
            policy=policy,
            client=self._http(),
            fetch_timeout_s=self.http_timeout,
            max_bytes=max_bytes,
        )
        if media.mime is not None and not media.mime.startswith(("audio/", "video/")):
            raise ValueError(f"data URL must hold audio, not {media.mime}")
        return await asyncio.to_thread(
            decode_audio,
            media.data,
            label,
            sample_rate=self.sample_rate,
            max_duration_s=self.max_duration_s,
        )

    async def _load_decoded(self, metadata: Any) -> tuple[np.ndarray, float]:
        from penstock.multimodal.transfer import TransferRequest

        if isinstance(metadata, tuple):
            # ``(waveform, sample_rate)`` the gateway decoded in this process.
            return metadata
        if self._receiver is None:
            raise ValueError("Could not load decoded media from frontend")
        request = TransferRequest.model_validate(metadata)
        tensor_id, samples = await self._receiver.receive_embeddings(request)
        try:
            rate = float((metadata.get("metadata") or {}).get("sample_rate", 16000))
            return samples.cpu().numpy().astype(np.float32).reshape(-1), rate
        finally:
            self._receiver.release_tensor(tensor_id)

    async def load_audio_batch(
        self, audio_mm_items: list[dict[str, Any]]
    ) -> list[tuple[np.ndarray, float]]:
        """Load audio from multimodal data items (``Url`` or ``Decoded``: a transfer, or a
        ``(waveform, sample_rate)`` decoded in this process), concurrently, in order;
        errors are chosen as for images."""
        for index, item in enumerate(audio_mm_items):
            if not isinstance(item, dict) or set(item) not in ({"Url"}, {"Decoded"}):
                raise ValueError(f"audio item {index} must have exactly one of Url, Decoded")
        jobs = [
            self.load_audio(item["Url"]) if "Url" in item else self._load_decoded(item["Decoded"])
            for item in audio_mm_items
        ]
        return await gather_media(jobs, jobs)

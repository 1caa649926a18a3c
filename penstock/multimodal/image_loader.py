"""Images of multimodal requests, from reference to RGB pixels (``ImageLoader``).

References are data URLs (``image/*;base64``), http(s) URLs fetched through the SSRF-safe
:class:`~penstock.http.HttpClient`, or ``file://`` paths under an operator-allowed folder.
Decoding is Pillow's, restricted to JPEG, PNG and WEBP: the header is read on the event
loop, where the pixel count is checked (a pixel bomb that declares billions of pixels
included) and the decoded bytes are charged to the process's decoded media budget
(:mod:`penstock.multimodal.budget`); the pixels are then decoded in a worker thread. The
byte count is checked while the bytes arrive.

Failures carry the status a client should get: the fetch's ``HttpStatusError`` as is, a
timeout 408, an unreachable host 400, an undecodable image 415 or 400, too many pixels
413, a full decoded media budget 503; a refused URL stays a ``UrlValidationError`` (400).

Decoded images are kept in a small LRU keyed by the normalized URL, bounded in entries
and in bytes, emptied when the budget runs short; concurrent loads of one URL share one
fetch.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from penstock.errors import HttpStatusError, UrlValidationError
from penstock.http import HttpClient, UrlValidationPolicy, describe_media_source
from penstock.multimodal.budget import DECODED_MEDIA, Charge, DecodedMediaBudget
from penstock.multimodal.media_source import (
    FROM_ENVIRONMENT,
    ByteLimit,
    fetch_media,
    load_rules,
)

if TYPE_CHECKING:
    from PIL import Image

# The seed's variable is read when Penstock's is unset.
CACHE_SIZE_MAXIMUM = int(
    os.environ.get("PENSTOCK_MM_IMAGE_CACHE_SIZE") or os.environ.get("DYN_MM_IMAGE_CACHE_SIZE") or 8
)
CACHE_MAX_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_PIXELS = 32 * 1024 * 1024
_FORMATS = ("JPEG", "PNG", "WEBP")
_DECLARED_PIXELS = re.compile(r"\((\d+) pixels\)")


def normalize_url(url: str) -> str:
    """The cache key: scheme and host lower-cased, fragment dropped, the rest as given."""
    if url[:5].lower() == "data:":
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), parts.path, parts.query, ""))


def _too_many_pixels(declared: str, max_pixels: int, url: str) -> HttpStatusError:
    return HttpStatusError(413, f"image is {declared}, over the limit of {max_pixels} pixels", url)


def open_image(data: bytes, url: str, max_pixels: int) -> Image.Image:
    """The image ``data`` holds, its header read and its size checked; no pixel decoded."""
    # Pillow is imported by the servers that load images only.
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # The size is checked below, against the server's own limit.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=_FORMATS)
    except Image.DecompressionBombError as exc:
        declared = _DECLARED_PIXELS.search(str(exc))
        shown = f"{declared.group(1)} pixels" if declared else "a decompression bomb"
        raise _too_many_pixels(shown, max_pixels, url) from None
    except UnidentifiedImageError:
        raise HttpStatusError(415, "Unsupported Media Type", url) from None
    width, height = image.size
    if width * height > max_pixels:
        raise _too_many_pixels(f"{width}x{height}", max_pixels, url)
    return image


def decoded_bytes(image: Image.Image) -> int:
    """What decoding ``image`` to RGB holds at its peak: its own mode, then the RGB copy."""
    width, height = image.size
    own = width * height * len(image.getbands())
    return own if image.mode == "RGB" else own + width * height * 3


def decode_pixels(image: Image.Image, url: str, charge: Charge) -> Image.Image:
    """``image`` decoded to RGB; ``charge`` then follows the pixels (or is released)."""
    try:
        image.load()
        rgb = image if image.mode == "RGB" else image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as exc:
        charge.release()
        raise HttpStatusError(400, "Invalid or truncated image data", url) from exc
    except BaseException:
        charge.release()
        raise
    width, height = rgb.size
    charge.keep(rgb, width * height * 3)
    return rgb


async def decode_image_bytes(
    data: bytes, url: str, max_pixels: int, budget: DecodedMediaBudget
) -> Image.Image:
    """RGB pixels of ``data``: header and budget on the loop, pixels in a worker thread."""
    image = open_image(data, url, max_pixels)
    charge = budget.charge(decoded_bytes(image), f"image {url}")
    return await asyncio.to_thread(decode_pixels, image, url, charge)


class ImageLoader:
    CACHE_SIZE_MAXIMUM = CACHE_SIZE_MAXIMUM

    def __init__(
        self,
        cache_size: int = CACHE_SIZE_MAXIMUM,
        http_timeout: float = 30.0,
        enable_frontend_decoding: bool = False,
        url_policy: UrlValidationPolicy | None = None,
        *,
        http_client: HttpClient | None = None,
        max_bytes: ByteLimit = FROM_ENVIRONMENT,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        cache_max_bytes: int = CACHE_MAX_BYTES,
        budget: DecodedMediaBudget = DECODED_MEDIA,
        honour_local_path: bool = False,
    ) -> None:
        """``url_policy`` None and ``max_bytes`` left out: the environment's, read at each
        load (:func:`~penstock.multimodal.media_source.load_rules`); ``honour_local_path``
        opens files under the policy's ``allowed_local_path``; ``http_client`` None: the
        process-wide client. ``enable_frontend_decoding`` accepts ``Decoded``
        items (images already decoded elsewhere, read over NIXL) and needs NIXL. Decoded
        images are charged to ``budget``; the cache keeps at most ``cache_size`` of them
        and ``cache_max_bytes`` of pixels."""
        if http_timeout <= 0:
            raise ValueError(f"http_timeout must be > 0, got {http_timeout}")
        self.cache_size = cache_size
        self.http_timeout = http_timeout
        self.url_policy = url_policy
        self.max_bytes = max_bytes
        self.honour_local_path = honour_local_path
        self.max_pixels = max_pixels
        self.cache_max_bytes = cache_max_bytes
        self.budget = budget
        self._client = http_client
        self._cache: OrderedDict[str, Image.Image] = OrderedDict()
        self._cache_bytes = 0
        budget.add_reclaimer(self.clear_cache)
        self._in_flight: dict[str, asyncio.Future[Image.Image]] = {}
        self._receiver: Any = None
        if enable_frontend_decoding:
            from penstock.multimodal.transfer import NixlReadEmbeddingReceiver
            from penstock.nixl_agent import nixl_api

            nixl_api()
            self._receiver = NixlReadEmbeddingReceiver(max_items=0)

    @property
    def cache_entries(self) -> int:
        return len(self._cache)

    def clear_cache(self) -> None:
        self._cache.clear()
        self._cache_bytes = 0

    def _remember(self, key: str, image: Image.Image) -> None:
        size = image.width * image.height * 3
        if self.cache_size <= 0 or size > self.cache_max_bytes or key in self._cache:
            return
        self._cache[key] = image
        self._cache_bytes += size
        while len(self._cache) > self.cache_size or self._cache_bytes > self.cache_max_bytes:
            _, dropped = self._cache.popitem(last=False)
            self._cache_bytes -= dropped.width * dropped.height * 3

    def _http(self) -> HttpClient:
        if self._client is None:
            from penstock.http import get_default_client

            self._client = get_default_client()
        return self._client

    async def load_image(self, image_url: str) -> Image.Image:
        key = normalize_url(image_url) if isinstance(image_url, str) else ""
        if self.cache_size > 0 and key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        running = self._in_flight.get(key)
        if running is None:
            running = asyncio.ensure_future(self._load(image_url))
            self._in_flight[key] = running
            running.add_done_callback(lambda _: self._in_flight.pop(key, None))
        image = await asyncio.shield(running)
        self._remember(key, image)
        return image

    async def _load(self, url: str) -> Image.Image:
        label = describe_media_source(url)
        local = self.honour_local_path
        policy, max_bytes = load_rules(self.url_policy, self.max_bytes, honour_local_path=local)
        media = await fetch_media(
            url,
            "the image",
            policy=policy,
            client=self._http(),
            fetch_timeout_s=self.http_timeout,
            max_bytes=max_bytes,
        )
        if media.mime is not None and not media.mime.startswith("image/"):
            raise ValueError(f"data URL must hold an image, not {media.mime}")
        if not media.data:
            raise ValueError(f"image is empty: {label}")
        return await decode_image_bytes(media.data, label, self.max_pixels, self.budget)

    async def _load_decoded(self, metadata: Any) -> Image.Image:
        from PIL import Image

        from penstock.multimodal.transfer import TransferRequest

        if isinstance(metadata, Image.Image):
            # Decoded in this process by the gateway: nothing to transfer.
            return metadata
        if self._receiver is None:
            raise ValueError("Could not load decoded media from frontend")
        request = TransferRequest.model_validate(metadata)
        tensor_id, pixels = await self._receiver.receive_embeddings(request)
        try:
            return Image.fromarray(pixels.cpu().numpy().copy(), mode="RGB")
        finally:
            self._receiver.release_tensor(tensor_id)

    async def load_image_batch(
        self, image_mm_items: list[dict[str, Any]], *, preserve_uuid_slots: bool = False
    ) -> list[Any]:
        """Load images from multimodal data items, concurrently, in order.

        Each item has exactly one key: ``Url`` (a reference, loaded as by
        :meth:`load_image`), ``Decoded`` (a ``TransferRequest`` of a ``(height, width, 3)``
        uint8 tensor, which needs ``enable_frontend_decoding``, or an image the gateway
        already decoded in this process, returned as it is) or ``UuidOnly`` (an empty slot,
        None in the result, for a backend cache lookup; needs ``preserve_uuid_slots``).

        The first ``HttpStatusError`` wins, then the first ``UrlValidationError``, then
        the first ``ValueError``; other failures are reported together.
        """
        kinds: list[str] = []
        for index, item in enumerate(image_mm_items):
            keys = set(item) if isinstance(item, dict) else set()
            if keys not in ({"Url"}, {"Decoded"}, {"UuidOnly"}):
                raise ValueError(
                    f"image item {index} must have exactly one of Url, Decoded, UuidOnly"
                )
            if keys == {"UuidOnly"} and not preserve_uuid_slots:
                raise ValueError(f"image item {index} is UuidOnly, which this call refuses")
            kinds.append(keys.pop())
        jobs = [
            self.load_image(item["Url"])
            if kind == "Url"
            else self._load_decoded(item["Decoded"])
            if kind == "Decoded"
            else None
            for kind, item in zip(kinds, image_mm_items, strict=True)
        ]
        return await gather_media([job for job in jobs if job is not None], jobs)


async def gather_media(running: list[Any], slots: list[Any]) -> list[Any]:
    """Run the loads; results in slot order (None slots kept); the most telling error."""
    outcomes = iter(await asyncio.gather(*running, return_exceptions=True))
    results = [None if slot is None else next(outcomes) for slot in slots]
    errors = [r for r in results if isinstance(r, BaseException)]
    for error in errors:
        if isinstance(error, asyncio.CancelledError):
            raise error
    for kind in (HttpStatusError, UrlValidationError, ValueError):
        for error in errors:
            if isinstance(error, kind):
                raise error
    if errors:
        raise Exception("; ".join(f"{type(e).__name__}: {e}" for e in errors))
    return results

"""Encode generated frames (H.264 MP4 via PyAV, still images via Pillow) and decode
reference images sent by clients.

PyAV, NumPy and Pillow are imported where they are used: the routers import this module
for its constants, and a server whose engine makes no media never needs them (PyAV alone
is ~20 MB of RSS).
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

VIDEO_CONTENT_TYPES = {"mp4": "video/mp4"}
IMAGE_CONTENT_TYPES = {"png": "image/png", "webp": "image/webp", "jpeg": "image/jpeg"}
_PILLOW_FORMATS = {"png": "PNG", "webp": "WEBP", "jpeg": "JPEG"}


class UndecodableImage(ValueError):
    """The bytes are not an image Pillow can decode."""


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Float frames in [0, 1] (what diffusers returns) to uint8 RGB."""
    import numpy as np

    if frames.dtype == np.uint8:
        return frames
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """``(frames, height, width, 3)`` uint8 RGB to an H.264 (yuv420p) MP4 at ``fps``."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected (frames, height, width, 3) RGB, got {frames.shape}")
    height, width = frames.shape[1], frames.shape[2]
    if height % 2 or width % 2:
        raise ValueError(f"H.264 needs an even size, got {width}x{height}")
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def encode_image(pixels: np.ndarray, image_format: str) -> bytes:
    """``(height, width, 3)`` uint8 RGB to PNG, WEBP or JPEG bytes."""
    pillow_format = _PILLOW_FORMATS.get(image_format)
    if pillow_format is None:
        raise ValueError(
            f"output_format '{image_format}' is not supported: use {', '.join(_PILLOW_FORMATS)}"
        )
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buffer, format=pillow_format)
    return buffer.getvalue()


def decode_image(data: bytes) -> Image.Image:
    """Fully decode ``data`` as an RGB image, or raise :class:`UndecodableImage`."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return image.convert("RGB")
    except UnidentifiedImageError as exc:
        raise UndecodableImage("not a decodable image (unknown format)") from exc
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise UndecodableImage(f"not a decodable image ({exc})") from exc


def image_data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def data_url_bytes(value: str) -> bytes | None:
    """The payload of a base64 ``data:`` URL (or of bare base64); None if it is neither."""
    payload = value
    if value.startswith("data:"):
        header, sep, payload = value.partition(",")
        if not sep or not header.endswith(";base64"):
            return None
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None

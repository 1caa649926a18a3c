"""Media made in the test for hostile-input probes: PNGs that only declare their size,
FLAC silence at any rate, gzip layers, data URLs."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import av
import numpy as np
from PIL import Image

MIB = 1024 * 1024


def png(width: int, height: int, color: tuple[int, int, int] = (90, 160, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def declared_png(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height``, with next to no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def flac(seconds: float, rate: int) -> bytes:
    """Silence as FLAC: a few KB whatever the rate."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="flac") as container:
        stream = container.add_stream("flac", rate=rate, layout="mono")
        stream.format = "s16"
        total, step = int(seconds * rate), 16384
        for pts in range(0, total, step):
            silence = np.zeros((1, min(step, total - pts)), np.int16)
            frame = av.AudioFrame.from_ndarray(silence, format="s16", layout="mono")
            frame.sample_rate, frame.pts = rate, pts
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def gzip(data: bytes, level: int = 9) -> bytes:
    compressor = zlib.compressobj(level, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    return compressor.compress(data) + compressor.flush()


def zero_bomb(megabytes: int) -> bytes:
    """``megabytes`` of zeros, gzip inside gzip: a few KB on the wire."""
    compressor = zlib.compressobj(1, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    zeros = bytes(MIB)
    inner = b"".join(compressor.compress(zeros) for _ in range(megabytes)) + compressor.flush()
    return gzip(inner)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"

"""Hostile media against a real ``penstock serve``: what each costs the server stays bounded.

Bombs come from a loopback file server or as data URLs, all made in the test: a body
that inflates through two ``Content-Encoding`` layers, a FLAC at 655,350 Hz, PNGs that
declare billions of pixels, images that together fill the decoded media budget. The
server's memory is read from ``/proc``: its peak resident set (``VmHWM``, reset before
each probe through ``clear_refs``) may grow by a generous bound, never by what the bomb
would inflate to. The server is configured the way a Dynamo deployment is, through the
seed's ``DYN_MM_*`` variables (a trusted egress proxy included), with one ``PENSTOCK_*``
variable that wins over its seed counterpart.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.file_server import serving
from tests.support.media_files import MIB, data_url, declared_png, flac, gzip, png, zero_bomb
from tests.support.server import ServerProcess, running_server

MODEL = "sample-model"
BUDGET_MB = 16
ENV = {
    # Loopback is internal: only the seed's switch lets this server fetch from it.
    "DYN_MM_ALLOW_INTERNAL": "1",
    "DYN_MM_MAX_FILE_SIZE_MB": "1",
    # Penstock's own name wins over the seed's.
    "DYN_MM_MAX_DATA_URL_MB": "0.001",
    "PENSTOCK_MEDIA_MAX_DATA_URL_MB": "2",
    "PENSTOCK_MEDIA_DECODED_MAX_MB": str(BUDGET_MB),
}


BOMB_MB = 128
FILES: dict[str, tuple[bytes, str | None]] = {
    "/photo.png.gz": (gzip(png(40, 30)), "gzip"),
    "/bomb.png": (zero_bomb(BOMB_MB), "gzip, gzip"),
}


class Held:
    """``/held.png`` is answered only once the test releases it."""

    arrived = threading.Event()
    release = threading.Event()


class EncodedFiles(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/held.png":
            Held.arrived.set()
            Held.release.wait(60)
            self.path = "/photo.png.gz"
        if self.path == "/broken.png":
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body, encoding = FILES.get(self.path, (b"", None))
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "image/png")
        if encoding:
            self.send_header("Content-Encoding", encoding)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


class EgressProxy(EncodedFiles):
    """Answers an absolute-form request (``GET http://host/path``) from the same files."""

    seen: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.seen.append(self.path)
        self.path = urlsplit(self.path).path
        super().do_GET()


@pytest.fixture(scope="module")
def files() -> Iterator[str]:
    with serving(EncodedFiles) as url:
        yield url


@pytest.fixture(scope="module")
def proxy() -> Iterator[str]:
    with serving(EgressProxy) as url:
        yield url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, proxy: str) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("hostile-media")
    engine = ["--", "--delay", "0.02", "--image-input", "--audio-input"]
    args = ["--engine", "sample", "--media-max-audio-s", "20", *engine]
    # The file server is reached directly; any other host through the trusted proxy.
    egress = {"DYN_MM_TRUST_EGRESS_PROXY": "1", "HTTP_PROXY": proxy, "NO_PROXY": "127.0.0.1"}
    with running_server(args, root, env={**ENV, **egress}) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        yield http


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def rss_bytes(server: ServerProcess) -> int:
    return _status_kb(server.process.pid, "VmRSS") * 1024


def peak_growth(server: ServerProcess, probe: Callable[[], None]) -> int:
    """How far the server's peak resident set rose above where it was while ``probe`` ran."""
    pid = server.process.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = _status_kb(pid, "VmHWM")
    probe()
    return (_status_kb(pid, "VmHWM") - before) * 1024


def chat(client: httpx.Client, *parts: dict[str, Any], max_tokens: int = 40) -> httpx.Response:
    content = [{"type": "text", "text": "what is this?"}, *parts]
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
    }
    return client.post("/v1/chat/completions", json=body)


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def audio(url: str) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": url}}


def reply(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def error_of(response: httpx.Response, status: int, param: str, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def test_nested_content_encoding_stays_within_the_fetch_limit(
    server: ServerProcess, client: httpx.Client, files: str
) -> None:
    # A host that compresses anyway is still understood.
    assert reply(chat(client, image(f"{files}/photo.png.gz"))).startswith("[image 40x30]")
    answers: list[httpx.Response] = []
    grown = peak_growth(server, lambda: answers.append(chat(client, image(f"{files}/bomb.png"))))
    error_of(answers[0], 400, "messages[0].content[1].image_url.url", "1048576 byte")
    # 128 MB inflated would show; the 1 MB limit, decoded in steps, can't.
    assert grown < 48 * MIB, f"peak RSS grew by {grown / MIB:.0f} MB"
    assert client.get("/v1/models").status_code == 200


def test_audio_at_an_absurd_rate_is_bounded_by_its_duration(
    server: ServerProcess, client: httpx.Client
) -> None:
    clip = data_url(flac(0.5, 8000), "audio/flac")
    assert reply(chat(client, audio(clip))).startswith("[audio 0.50s 8000Hz]")
    bomb = data_url(flac(20, 655_350), "audio/flac")
    assert len(bomb) < 64 * 1024
    answers: list[httpx.Response] = []
    grown = peak_growth(server, lambda: answers.append(chat(client, audio(bomb))))
    # Resampled to 48 kHz as it decodes: 20 s is 3.7 MB of float32, not 52 MB (three times).
    assert reply(answers[0]).startswith("[audio 20.00s 48000Hz]")
    assert grown < 40 * MIB, f"peak RSS grew by {grown / MIB:.0f} MB"


def test_declared_pixel_bombs_get_413_naming_the_limit(client: httpx.Client) -> None:
    error = error_of(
        chat(client, image(data_url(declared_png(50_000, 50_000)))),
        413,
        "messages[0].content[1].image_url.url",
        "2500000000 pixels",
        "--media-max-image-pixels",
    )
    assert error["code"] == "media_too_large"
    error_of(
        chat(client, image(data_url(declared_png(5000, 5000)))),
        413,
        "messages[0].content[1].image_url.url",
        "5000x5000",
        "--media-max-image-pixels",
    )


def test_the_seed_environment_carries_over(client: httpx.Client, files: str) -> None:
    # DYN_MM_ALLOW_INTERNAL=1 opened loopback (the test above fetched from it); the data URL
    # limit is PENSTOCK_MEDIA_MAX_DATA_URL_MB's, not DYN_MM_MAX_DATA_URL_MB's 1 KB.
    photo = data_url(png(64, 64, (1, 2, 3)) + b"\x00" * 4096)
    assert reply(chat(client, image(photo))).startswith("[image 64x64]")
    error_of(
        chat(client, image(f"{files}/bomb.png")),
        400,
        "messages[0].content[1].image_url.url",
        "1048576 byte",
    )


def test_a_trusted_egress_proxy_carries_fetches(client: httpx.Client) -> None:
    # Nothing listens on 127.0.0.9:1: only the proxy can answer.
    target = "http://127.0.0.9:1/photo.png.gz"
    assert reply(chat(client, image(target))).startswith("[image 40x30]")
    assert target in EgressProxy.seen


def _colors(count: int, offset: int) -> list[dict[str, Any]]:
    return [image(data_url(png(1024, 1024, (offset + i, 7, 7)))) for i in range(count)]


def test_decoded_media_beyond_the_budget_is_a_503_with_retry_after(
    server: ServerProcess, client: httpx.Client, files: str
) -> None:
    baseline = rss_bytes(server)
    wanted = _colors(2, 50)
    # 4 images of 1024x1024 RGB (12 MB of the 16) stay decoded while their request waits
    # for its fifth, which the file server holds back.
    held = [*_colors(4, 10), image(f"{files}/held.png")]
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.base_url, timeout=60) as other:
        first = pool.submit(chat, other, *held, max_tokens=120)
        assert Held.arrived.wait(30), "the held image was never asked for"
        busy = chat(client, *wanted)
        Held.release.set()
        assert reply(first.result()).startswith("[image 1024x1024] " * 4 + "[image 40x30]")
    error = error_of(busy, 503, "messages[0].content[2].image_url.url", "retry")
    assert error["code"] == "media_memory_busy"
    assert busy.headers["retry-after"] == "1"
    # Once that request is done, the same request fits.
    assert reply(chat(client, *wanted)).startswith("[image 1024x1024] [image 1024x1024]")
    grown = rss_bytes(server) - baseline
    assert grown < 4 * BUDGET_MB * MIB, f"RSS stayed {grown / MIB:.0f} MB above its baseline"


def test_a_request_whose_media_alone_pass_the_budget_is_413(client: httpx.Client) -> None:
    # Six images of 3 MB decoded: more than the 16 MB budget, whoever else is served.
    too_much = chat(client, *_colors(6, 90))
    param = "messages[0].content[6].image_url.url"
    error = error_of(too_much, 413, param, "18.0 MB", "PENSTOCK_MEDIA_DECODED_MAX_MB")
    assert error["code"] == "media_too_large"
    assert reply(chat(client, *_colors(2, 90))).startswith("[image 1024x1024]")


def test_an_upstream_failure_is_a_502_logged_as_a_warning(
    server: ServerProcess, client: httpx.Client, files: str
) -> None:
    error_of(
        chat(client, image(f"{files}/broken.png")), 502, "messages[0].content[1].image_url.url"
    )
    # The upstream's fault is the operator's warning, not an error of this server.
    lines = [line for line in server.log().splitlines() if "request failed" in line]
    assert lines and all(" WARNING " in line for line in lines), lines

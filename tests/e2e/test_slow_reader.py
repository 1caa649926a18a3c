"""A client that stops reading a stream holds its generation back (the connection's flow
control reaches the engine) and, once it reads again, gets every frame in order."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import running_server

MODEL = "sample-model"
# ~9 MB of frames. The socket buffers on both sides of a loopback connection took up to
# ~17,600 of these tokens (~2.6 MB) here; the rest must wait for the client.
TOKENS = 60_000
STALL_S = 1.5
ARGS = ["--engine", "sample", "--", "--delay", "0", "--context-length", str(2 * TOKENS)]


def sample_value(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no {name} sample")


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """The head and the de-chunked body of one chunked HTTP response."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(1 << 16)
    head, _, rest = data.partition(b"\r\n\r\n")
    parts: list[bytes] = []
    while True:
        while b"\r\n" not in rest:
            rest += sock.recv(1 << 16)
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        while len(rest) < size + 2:
            rest += sock.recv(1 << 20)
        parts.append(rest[:size])
        rest = rest[size + 2 :]
        if size == 0:
            return head, b"".join(parts)


def streamed_text(body: bytes) -> str:
    frames = [frame for frame in body.split(b"\n\n") if frame]
    assert frames[-1] == b"data: [DONE]"
    chunks = [json.loads(frame.removeprefix(b"data: ")) for frame in frames[:-1]]
    return "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])


def test_a_stalled_reader_holds_its_stream_back_then_gets_all_of_it(tmp_path: Path) -> None:
    with running_server(ARGS, tmp_path) as server:
        request = {"model": MODEL, "prompt": "x", "max_tokens": TOKENS}
        body = json.dumps({**request, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: penstock\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                % (len(body), body)
            )
            time.sleep(STALL_S)
            # Unhindered, the engine makes these tokens in about the stall or less.
            assert sample_value(server.base_url, "penstock_frontend_active_requests") == 1
            made = sample_value(server.base_url, "penstock_frontend_output_tokens_total")
            assert made < TOKENS / 2
            head, streamed = read_response(sock)
        assert head.startswith(b"HTTP/1.1 200")
        whole = httpx.post(f"{server.base_url}/v1/completions", json=request, timeout=60)
        assert streamed_text(streamed) == whole.json()["choices"][0]["text"]
        # The server goes on serving once the slow stream is done.
        assert httpx.get(f"{server.base_url}/health").status_code == 200

"""Slow, idle and oversized clients against a real server: header, body and keep-alive
timeouts, the body deadline, the bound on request heads and the connection limit close
them, normal requests go on being served, and HTTP/1.0 clients get streams they can read."""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Iterator

import h11
import httpx
import orjson
import pytest

from tests.support.server import ServerProcess, running_server

TIMEOUT_S = 1.0
# The server's event loop keeps time in whole milliseconds: a timer may fire that much early.
EARLIEST_S = TIMEOUT_S - 0.01
# Past the body timeout, so a body that never stalls that long meets the deadline instead.
BODY_DEADLINE_S = 2 * TIMEOUT_S
MAX_CONNECTIONS = 60
SLOW_CLIENTS = 50


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = [
        "--engine",
        "sample",
        "--header-timeout-s",
        str(TIMEOUT_S),
        "--body-timeout-s",
        str(TIMEOUT_S),
        "--body-deadline-s",
        str(BODY_DEADLINE_S),
        "--keep-alive-timeout-s",
        str(TIMEOUT_S),
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--",
        "--delay",
        "0",
    ]
    with running_server(args, tmp_path_factory.mktemp("connections")) as process:
        yield process


def connect(server: ServerProcess, first_bytes: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (10 s at most)."""
    data = b""
    with sock:
        while chunk := sock.recv(4096):
            data += chunk
    return data


def envelope(response: bytes) -> dict[str, object]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    return orjson.loads(body)["error"]


def test_clients_that_never_finish_their_headers_are_closed_and_others_served(
    server: ServerProcess,
) -> None:
    started = time.monotonic()
    slow = [connect(server, b"GET /v1/mod") for _ in range(SLOW_CLIENTS)]
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 200

    silent = [connect(server) for _ in range(MAX_CONNECTIONS - SLOW_CLIENTS)]
    refused = httpx.get(f"{server.base_url}/v1/models")
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "too_many_connections"

    answers = [read_until_closed(sock) for sock in slow]
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers)
    assert envelope(answers[0])["code"] == "header_timeout"
    assert [read_until_closed(sock) for sock in silent] == [b""] * len(silent)
    assert EARLIEST_S <= time.monotonic() - started < TIMEOUT_S + 8
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 200


def test_headers_sent_a_little_at_a_time_do_not_extend_the_deadline(
    server: ServerProcess,
) -> None:
    started = time.monotonic()
    sock = connect(server, b"GET /")
    for piece in (b"v1/", b"models"):
        time.sleep(TIMEOUT_S * 0.4)
        sock.sendall(piece)
    answer = read_until_closed(sock)
    assert envelope(answer)["code"] == "header_timeout"
    # Restarting the timer on each piece would have held it until 1.8 timeouts.
    assert time.monotonic() - started < TIMEOUT_S * 1.6


def test_a_stalled_body_gets_408_and_is_closed(server: ServerProcess) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: penstock\r\n"
        b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
    )
    started = time.monotonic()
    answer = read_until_closed(connect(server, head + b'{"model": "sam'))
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert envelope(answer)["code"] == "body_timeout"
    assert EARLIEST_S <= time.monotonic() - started < TIMEOUT_S + 8
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 200
    # The access line shows what the client got.
    assert "POST /v1/completions 408 " in server.log()


def test_an_idle_kept_alive_connection_is_closed(server: ServerProcess) -> None:
    sock = connect(server, b"GET /live HTTP/1.1\r\nhost: penstock\r\n\r\n")
    started = time.monotonic()
    answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert EARLIEST_S <= time.monotonic() - started < TIMEOUT_S + 8


def test_a_kept_alive_connection_never_waits_for_a_delayed_ack(server: ServerProcess) -> None:
    """With Nagle's algorithm on, a response written in pieces (the headers, then the body
    or each frame) holds its next piece back until the client acknowledges the first,
    which Linux delays ~40 ms on a kept-alive connection but acknowledges at once in a
    connection's first exchanges. So a request past those takes as long as one on a new
    connection, not ten times as long."""
    bodies = [
        {"model": "sample-model", "prompt": "x", "max_tokens": 2},
        {"model": "sample-model", "prompt": "x", "max_tokens": 2, "stream": True},
    ]
    for body in bodies:
        fresh = []
        for _ in range(10):
            with httpx.Client(base_url=server.base_url, timeout=10) as client:
                fresh.append(timed_post(client, body))
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            kept = [timed_post(client, body) for _ in range(25)]
        assert statistics.median(kept[5:]) < 3 * statistics.median(fresh), (kept, fresh)


def timed_post(client: httpx.Client, body: dict[str, object]) -> float:
    started = time.perf_counter()
    response = client.post("/v1/completions", json=body)
    took = time.perf_counter() - started
    assert response.status_code == 200
    return took


def parse_responses(data: bytes, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """The ``count`` responses to as many POSTs at the start of ``data`` (status, headers,
    body with its chunks joined), read by h11 as a client would: it refuses anything
    malformed, and there must be nothing after them."""
    client = h11.Connection(h11.CLIENT)
    client.receive_data(data)
    client.receive_data(b"")
    responses: list[tuple[int, dict[str, str], bytes]] = []
    for _ in range(count):
        if client.our_state is h11.DONE:
            client.start_next_cycle()
        head = [("host", "penstock"), ("content-length", "0")]
        client.send(h11.Request(method="POST", target="/v1/chat/completions", headers=head))
        client.send(h11.EndOfMessage())
        body = b""
        while not isinstance(event := client.next_event(), h11.EndOfMessage):
            if isinstance(event, h11.Response):
                status, headers = (
                    event.status_code,
                    {name.decode(): value.decode() for name, value in event.headers},
                )
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            else:
                raise AssertionError(f"unexpected {event!r}")
        responses.append((status, headers, body))
    assert client.next_event() in (h11.PAUSED, h11.ConnectionClosed())
    return responses


def chat_request(body: dict[str, object], version: bytes = b"1.1", close: bool = False) -> bytes:
    payload = orjson.dumps(body)
    head = b"POST /v1/chat/completions HTTP/%b\r\nhost: penstock\r\n" % version
    head += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(payload)
    if close:
        head += b"connection: close\r\n"
    return head + b"\r\n" + payload


def test_pipelined_and_http_1_0_requests_get_whole_responses(server: ServerProcess) -> None:
    """A response's head leaves with its body's first bytes: every response on a
    connection must still be whole and in order, where requests are pipelined and where
    the connection closes after the response."""
    chat = {"model": "sample-model", "messages": [{"role": "user", "content": "hi"}]}
    unary = {**chat, "max_tokens": 3}
    stream = {**chat, "max_tokens": 3, "stream": True}
    pipelined = chat_request(unary) + chat_request(stream) + chat_request(unary, close=True)
    answers = parse_responses(read_until_closed(connect(server, pipelined)), 3)
    assert [status for status, _, _ in answers] == [200, 200, 200]
    first, streamed, last = (body for _, _, body in answers)
    assert orjson.loads(first)["usage"]["completion_tokens"] == 3
    assert orjson.loads(last)["usage"]["completion_tokens"] == 3
    assert answers[1][1]["content-type"].startswith("text/event-stream")
    frames = [frame for frame in streamed.split(b"\n\n") if frame]
    assert frames[-1] == b"data: [DONE]"
    assert b'"role":"assistant"' in frames[0]
    for version in (b"1.0", b"1.1"):
        [(status, _, body)] = parse_responses(
            read_until_closed(connect(server, chat_request(unary, version, close=True))), 1
        )
        assert status == 200
        assert orjson.loads(body)["choices"][0]["finish_reason"] == "length"


def trickle(sock: socket.socket, interval_s: float) -> None:
    """Send a byte of the body every ``interval_s``, until the server closes."""
    try:
        for _ in range(1000):
            time.sleep(interval_s)
            sock.sendall(b" ")
    except OSError:
        return


def test_bodies_trickled_in_a_byte_at_a_time_get_408_and_others_are_served(
    server: ServerProcess,
) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: penstock\r\n"
        b"content-type: application/json\r\ncontent-length: 100000\r\n\r\n{"
    )
    clients = [connect(server, head) for _ in range(3)]
    # Each byte well within the body timeout: only the deadline ends them.
    senders = [
        threading.Thread(target=trickle, args=(sock, TIMEOUT_S / 4), daemon=True)
        for sock in clients
    ]
    for sender in senders:
        sender.start()
    answers = [read_until_closed(sock) for sock in clients]
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408 ")
        error = envelope(answer)
        assert error["code"] == "body_deadline"
        assert f"within {BODY_DEADLINE_S:g}s" in str(error["message"])
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 200
    for sender in senders:
        sender.join(timeout=10)


def models_request(*headers: bytes) -> bytes:
    return b"GET /v1/models HTTP/1.1\r\nhost: penstock\r\n" + b"".join(headers)


def test_request_heads_over_64_kib_get_431_and_are_closed(server: ServerProcess) -> None:
    whole = models_request(b"x-padding: " + b"a" * 100 * 1024 + b"\r\n\r\n")
    # A header that never ends: answered once 64 KiB are in, not when the client stops.
    unfinished = models_request(b"x-padding: " + b"a" * 80 * 1024)
    many = models_request(*(b"x-padding-%d: %b\r\n" % (i, b"a" * 1000) for i in range(80)))
    for request in (whole, unfinished, many + b"\r\n"):
        answer = read_until_closed(connect(server, request))
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        error = envelope(answer)
        assert error["code"] == "request_headers_too_large"
        assert "64 KiB" in str(error["message"])
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 200


def test_request_heads_under_64_kib_are_served(server: ServerProcess) -> None:
    padding = {f"x-padding-{i}": "a" * 1000 for i in range(50)}
    response = httpx.get(f"{server.base_url}/v1/models", headers=padding)
    assert response.status_code == 200
    assert response.json()["data"][0]["id"] == "sample-model"


def test_an_http_1_0_stream_is_delimited_by_the_connection_close(server: ServerProcess) -> None:
    """HTTP/1.0 has no chunked encoding: the event stream's bytes come as they are, and
    the end of the connection ends them."""
    chat = {"model": "sample-model", "messages": [{"role": "user", "content": "hi"}]}
    stream = {**chat, "max_tokens": 3, "stream": True}
    answer = read_until_closed(connect(server, chat_request(stream, b"1.0")))
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {name.lower(): value for name, _, value in (h.partition(": ") for h in header_lines)}
    assert status_line.startswith("HTTP/1.1 200 ")
    assert "transfer-encoding" not in headers and "content-length" not in headers
    assert headers["connection"] == "close"
    assert headers["content-type"].startswith("text/event-stream")
    frames = body.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    chunks = [orjson.loads(frame.removeprefix(b"data: ")) for frame in frames[:-2]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

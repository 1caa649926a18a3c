"""Every output constraint is held to the same limits, whichever spelling carries it, and
a refused one costs the server (and other API keys) nothing: a real server on a tiny
checkpoint with random weights, two API keys."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.support.server import ServerProcess, running_server
from tests.support.tiny_llm import build_tiny_llama

KEYS = ("key-one", "key-two")
MESSAGES: list[Any] = [{"role": "user", "content": "Describe something."}]


def nested_schema(depth: int) -> dict[str, Any]:
    """An object schema whose JSON nests ``depth`` levels deep (odd ``depth``)."""
    schema: dict[str, Any] = {"type": "integer"}
    # Each object adds two levels: itself and its ``properties``.
    for _ in range((depth - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def deep_tool(depth: int, name: str = "deep") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": nested_schema(depth)}}


def deep_tag(depth: int) -> dict[str, Any]:
    return {
        "type": "structural_tag",
        "structures": [{"begin": "<a>", "schema": nested_schema(depth), "end": "</a>"}],
        "triggers": ["<a>"],
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    keys = [arg for key in KEYS for arg in ("--api-key", key)]
    args = ["--engine", "transformers", "--model", str(model_dir), "--tool-call-parser", "hermes"]
    args += [*keys, "--", "--served-model-name", "tiny", "--cpu-threads", "1"]
    with running_server(
        args, tmp_path_factory.mktemp("serve"), env={"HF_HUB_OFFLINE": "1"}, ready_timeout=300
    ) as process:
        yield process


def chat(server: ServerProcess, extra: dict[str, Any], key: str = KEYS[0]) -> httpx.Response:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **extra}
    return httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    )


def refusal(answer: httpx.Response) -> str:
    assert answer.status_code == 400, answer.text
    return str(answer.json()["error"]["message"])


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [deep_tool(41)], "tool_choice": "required"},
        {
            "tools": [deep_tool(41)],
            "tool_choice": {"type": "function", "function": {"name": "deep"}},
        },
        {"structured_outputs": {"structural_tag": deep_tag(41)}},
        {"structured_outputs": {"structural_tag": json.dumps(deep_tag(41))}},
        {"structured_outputs": {"json": json.dumps(nested_schema(41))}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "d", "schema": nested_schema(41)},
            }
        },
        {"guided_json": nested_schema(41)},
    ],
    ids=[
        "tool-required",
        "tool-named",
        "tag",
        "tag-text",
        "json-text",
        "response-format",
        "guided",
    ],
)
def test_every_spelling_holds_a_schema_to_32_levels(
    server: ServerProcess, extra: dict[str, Any]
) -> None:
    assert "at most 32" in refusal(chat(server, extra))


def test_a_tool_schema_within_the_limit_is_served(server: ServerProcess) -> None:
    answer = chat(server, {"tools": [deep_tool(31)], "tool_choice": "required"})
    assert answer.status_code == 200, answer.text


# More costly compiles than a small machine has compile threads, by enough that a regex
# queued behind them is told apart from one served beside them on a loaded machine.
FLOOD = 10


def patterned_schema(prefix: str, properties: int) -> dict[str, Any]:
    """A schema within every limit that takes xgrammar a second or more to compile (each
    property's pattern is an automaton of its own); ``prefix`` keeps it out of the cache."""
    names = [f"{prefix}{i}" for i in range(properties)]
    pattern = {"type": "string", "pattern": "^[a-z]{2,9}[0-9]{1,4}$"}
    return {"type": "object", "properties": dict.fromkeys(names, pattern), "required": names}


def answered_beside_a_flood(server: ServerProcess, salted: bool) -> int:
    """How many of one key's ten costly compiles were answered when another key's
    trivial regex was (each of the ten with a cache salt of its own when ``salted``)."""
    answered: list[int] = []

    def costly(n: int) -> httpx.Response:
        extra: dict[str, Any] = {"guided_json": patterned_schema(f"flood{n}_", 200)}
        if salted:
            # Spelled as the server spells a key's scope in the salts it sends an engine.
            extra["cache_salt"] = f"key:{n:032x}"
        answer = chat(server, extra, KEYS[0])
        answered.append(n)
        return answer

    # Without a share per key, the other key's regex would queue behind them.
    with ThreadPoolExecutor(FLOOD) as pool:
        flood = [pool.submit(costly, n) for n in range(FLOOD)]
        time.sleep(0.5)
        beside = chat(server, {"structured_outputs": {"regex": "[d-f]{2}"}}, KEYS[1])
        answered_first = len(answered)
        answers = [future.result() for future in flood]
    assert beside.status_code == 200, beside.text
    for answer in answers:
        assert answer.status_code == 200 or "--grammar-compile-timeout" in refusal(answer)
    return answered_first


def test_one_keys_costly_compiles_do_not_hold_back_another_keys_regex(
    server: ServerProcess,
) -> None:
    # One key's compiles run one at a time: one ahead of the regex, a second or a third on
    # a loaded machine (3 seen under a full suite). Queued behind all ten, it would see at
    # least ten less the compile threads answered.
    assert answered_beside_a_flood(server, salted=False) <= 3


def test_a_key_shares_its_compiles_whatever_cache_salt_it_sends(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # Cached prefixes shared between keys: the salts reach the engine as sent.
    with constrained_server(tmp_path_factory, "--no-cache-salt-by-key") as shared:
        assert answered_beside_a_flood(shared, salted=True) <= 3


@contextlib.contextmanager
def constrained_server(
    tmp_path_factory: pytest.TempPathFactory, *server_args: str, engine_args: tuple[str, ...] = ()
) -> Iterator[ServerProcess]:
    """A server of its own on the tiny checkpoint, with both keys."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    keys = [arg for key in KEYS for arg in ("--api-key", key)]
    args = ["--engine", "transformers", "--model", str(model_dir), *keys, *server_args]
    args += ["--", "--served-model-name", "tiny", "--cpu-threads", "1", *engine_args]
    with running_server(
        args, tmp_path_factory.mktemp("serve"), env={"HF_HUB_OFFLINE": "1"}, ready_timeout=300
    ) as process:
        yield process


def test_a_compile_past_the_deadline_is_a_400_and_the_server_serves_on(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    deadline = ("--grammar-compile-timeout", "0.5")
    with constrained_server(tmp_path_factory, engine_args=deadline) as slow:
        # Compiles for seconds: several times the deadline.
        message = refusal(chat(slow, {"guided_json": patterned_schema("p", 900)}))
        assert "within 0.5 s" in message and "--grammar-compile-timeout" in message, message
        trivial = chat(slow, {"structured_outputs": {"regex": "[a-c]{2}"}}, KEYS[1])
        assert trivial.status_code == 200, trivial.text
        assert httpx.get(f"{slow.base_url}/live", timeout=10).status_code == 200


def live_stalls(server: ServerProcess, during: threading.Thread) -> float:
    """The longest ``/live`` answer while ``during`` runs."""
    worst = 0.0
    during.start()
    with httpx.Client(timeout=120) as client:
        while during.is_alive():
            started = time.perf_counter()
            client.get(f"{server.base_url}/live")
            worst = max(worst, time.perf_counter() - started)
            time.sleep(0.02)
    during.join()
    return worst


def test_an_oversized_schema_is_refused_before_the_body_is_parsed(
    server: ServerProcess,
) -> None:
    wide = {"type": "object", "properties": {f"p{i}": {} for i in range(500_000)}}
    answers: dict[str, httpx.Response] = {}

    def send(name: str, extra: dict[str, Any]) -> threading.Thread:
        # Encoded here: encoding it in the thread would hold up this process's probes.
        fields = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **extra}
        body = json.dumps(fields).encode()
        headers = {"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"}
        url = f"{server.base_url}/v1/chat/completions"

        def post() -> None:
            answers[name] = httpx.post(url, content=body, headers=headers, timeout=300)

        return threading.Thread(target=post)

    # The same value where no constraint is read from, refused by a plain field check
    # after the body is parsed: what reading it costs.
    read = {"chat_template_kwargs": {"padding": wide}, "max_tokens": -1}
    baseline = live_stalls(server, send("read", read))
    refused = live_stalls(server, send("schema", {"guided_json": wide}))
    assert answers["read"].status_code == 400, answers["read"].text
    assert "at most 65536" in refusal(answers["schema"])
    assert refused < baseline / 4, (refused, baseline)


def test_a_schema_text_nested_3000_levels_is_a_400(server: ServerProcess) -> None:
    text = '{"type": "object", "properties": {"a": ' * 1500 + "{}" + "}}" * 1500
    message = refusal(chat(server, {"structured_outputs": {"json": text}}))
    assert "levels" in message


def test_a_refused_constraint_logs_one_line_and_no_traceback(server: ServerProcess) -> None:
    before = server.log()
    assert "not supported" in refusal(chat(server, {"structured_outputs": {"regex": "([a-z]"}}))
    time.sleep(0.5)
    added = server.log()[len(before) :]
    assert "Traceback" not in added, added
    assert "ERROR" not in added, added

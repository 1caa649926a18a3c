"""Requests both servers must refuse (or, where vLLM is lenient, accept): malformed bodies,
missing and mistyped fields, values out of range, unknown models, routes and methods."""

from __future__ import annotations

from typing import Any

from tests.conformance.case import MODEL, PERSON_SCHEMA, PROMPT, QUESTION, WEATHER_TOOL, Case

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _chat(name: str, **fields: Any) -> Case:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0, **fields}
    return Case(f"bad-chat-{name}", "POST", CHAT, {k: v for k, v in body.items() if v is not _DROP})


def _completion(name: str, **fields: Any) -> Case:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}
    return Case(
        f"bad-completion-{name}",
        "POST",
        COMPLETIONS,
        {k: v for k, v in body.items() if v is not _DROP},
    )


_DROP = object()


def _bad_chat() -> list[Case]:
    return [
        _chat("no-messages", messages=_DROP),
        _chat("empty-messages", messages=[]),
        _chat("messages-not-list", messages="hello"),
        _chat("bad-role", messages=[{"role": "wizard", "content": "hi"}]),
        _chat("no-role", messages=[{"content": "hi"}]),
        _chat("no-model", model=_DROP),
        _chat("unknown-model", model="no-such-model"),
        _chat("max-tokens-string", max_tokens="ten"),
        _chat("max-tokens-negative", max_tokens=-1),
        _chat("max-tokens-zero", max_tokens=0),
        _chat("max-tokens-over-context", max_tokens=100000),
        _chat("temperature-negative", temperature=-0.5),
        _chat("top-p-zero", top_p=0),
        _chat("top-p-over-one", top_p=1.5),
        _chat("top-k-negative-two", top_k=-2),
        _chat("n-zero", n=0),
        _chat("top-logprobs-without-logprobs", top_logprobs=2),
        _chat("top-logprobs-too-many", logprobs=True, top_logprobs=50),
        _chat("presence-penalty-too-high", presence_penalty=5),
        _chat("stream-options-without-stream", stream_options={"include_usage": True}),
        _chat("response-format-unknown", response_format={"type": "yaml"}),
        _chat("json-schema-missing", response_format={"type": "json_schema"}),
        _chat("structured-two-kinds", structured_outputs={"choice": ["a"], "regex": "a"}),
        _chat("structured-bad-regex", structured_outputs={"regex": "("}),
        _chat(
            "tool-choice-unknown-tool",
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        ),
        _chat("tool-choice-without-tools", tool_choice="required"),
        _chat("tools-not-list", tools={"type": "function"}),
        _chat("unknown-field", frobnicate=True),
        _chat("logit-bias-bad-token", logit_bias={"999999": 1}),
        _chat("seed-string", seed="seven"),
        _chat("stop-too-long-type", stop=123),
        _chat("guided-json-bad", guided_json="{not json"),
    ]


def _bad_completion() -> list[Case]:
    return [
        _completion("no-prompt", prompt=_DROP),
        _completion("empty-prompt", prompt=""),
        _completion("empty-prompt-list", prompt=[]),
        _completion("prompt-number", prompt=5),
        _completion("token-id-out-of-vocab", prompt=[504, 99999999]),
        _completion("token-id-negative", prompt=[-1]),
        _completion("no-model", model=_DROP),
        _completion("unknown-model", model="no-such-model"),
        _completion("prompt-too-long", prompt="hello " * 9000),
        _completion("logprobs-too-many", logprobs=50),
        _completion("logprobs-bool", logprobs=True),
        _completion("n-negative", n=-1),
        _completion("best-of-below-n", n=2, best_of=1),
        _completion("suffix", suffix="!"),
        _completion("unknown-field", frobnicate=True),
        _completion(
            "json-schema-format",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON_SCHEMA},
            },
        ),
        _completion("echo-with-prompt-embeds-null", echo=True, prompt_embeds=None),
        _completion("temperature-string", temperature="hot"),
    ]


def _bad_other() -> list[Case]:
    def raw(name: str, path: str, text: str, content_type: str = "application/json") -> Case:
        return Case(name, "POST", path, text, content_type=content_type)

    return [
        raw("bad-chat-malformed-json", CHAT, '{"model": '),
        raw("bad-chat-body-array", CHAT, "[1, 2]"),
        raw("bad-chat-empty-body", CHAT, ""),
        raw("bad-chat-text-plain", CHAT, '{"messages": []}', "text/plain"),
        raw("bad-completion-malformed-json", COMPLETIONS, "{"),
        raw("bad-tokenize-malformed-json", "/tokenize", "{"),
        Case("bad-tokenize-no-prompt", "POST", "/tokenize", {"model": MODEL}),
        Case("bad-detokenize-no-tokens", "POST", "/detokenize", {"model": MODEL}),
        Case("bad-detokenize-strings", "POST", "/detokenize", {"model": MODEL, "tokens": ["a"]}),
        Case("bad-responses-no-input", "POST", "/v1/responses", {"model": MODEL}),
        Case(
            "bad-responses-unknown-model", "POST", "/v1/responses", {"model": "nope", "input": "hi"}
        ),
        Case("bad-chat-get", "GET", CHAT),
        Case("bad-unknown-route", "GET", "/v1/no-such-route"),
        Case("bad-models-unknown", "GET", "/v1/models/no-such-model"),
    ]


def bad_input_cases() -> list[Case]:
    return [*_bad_chat(), *_bad_completion(), *_bad_other()]

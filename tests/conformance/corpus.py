"""The requests sent to both vLLM and Penstock. Most generate a few tokens only.

``values`` marks the cases whose values are compared too: greedy generations (temperature
0, where float32 on both sides must pick the same tokens) and the tokenizer's answers.
"""

from __future__ import annotations

from typing import Any

from tests.conformance.bad_inputs import bad_input_cases
from tests.conformance.case import (
    MODEL,
    PERSON_SCHEMA,
    PROMPT,
    PROMPT_IDS,
    QUESTION,
    WEATHER_TOOL,
    Case,
)


def chat(name: str, values: bool = True, **fields: Any) -> Case:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "temperature": 0, **fields}
    return Case(f"chat-{name}", "POST", "/v1/chat/completions", body, values)


def completion(name: str, values: bool = True, **fields: Any) -> Case:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}
    return Case(f"completion-{name}", "POST", "/v1/completions", body, values)


def _streamed(build: Any, name: str, values: bool = True, **fields: Any) -> list[Case]:
    """A case and its streamed forms: plain, and with usage in the stream."""
    return [
        build(name, values, **fields),
        build(f"{name}-stream", values, stream=True, **fields),
        build(
            f"{name}-stream-usage",
            values,
            stream=True,
            stream_options={"include_usage": True},
            **fields,
        ),
    ]


def chat_cases() -> list[Case]:
    sampled = {"temperature": 1.0, "seed": 7}
    return [
        *_streamed(chat, "plain"),
        *_streamed(chat, "logprobs", logprobs=True, top_logprobs=3),
        *_streamed(chat, "n2-seeded", False, n=2, **sampled),
        *_streamed(chat, "stop", stop=["Paris"], max_tokens=16),
        chat("stop-string", stop="capital", max_tokens=16),
        chat("stop-included", stop=["Paris"], include_stop_str_in_output=True, max_tokens=16),
        chat("stop-token-ids", stop_token_ids=[1], max_tokens=16),
        chat("ignore-eos", ignore_eos=True, max_tokens=24),
        chat("min-tokens", min_tokens=4, max_tokens=8),
        chat("max-completion-tokens", max_completion_tokens=5),
        chat("no-max-tokens", max_tokens=None, stop=["."]),
        chat(
            "stream-continuous-usage",
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ),
        chat("seeded", False, temperature=0.8, seed=123, top_p=0.9, top_k=20),
        chat("echo", echo=True),
        chat("return-token-ids", return_token_ids=True),
        chat("prompt-logprobs", prompt_logprobs=1),
        chat("add-special-tokens", add_special_tokens=True),
        chat("no-generation-prompt", add_generation_prompt=False),
        chat(
            "continue-final-message",
            messages=[*QUESTION, {"role": "assistant", "content": "The capital is"}],
            continue_final_message=True,
            add_generation_prompt=False,
        ),
        chat(
            "system-and-turns",
            messages=[
                {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Capital of Italy?"},
                {"role": "assistant", "content": "Rome"},
                {"role": "user", "content": "And of Spain?"},
            ],
        ),
        chat(
            "content-parts",
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        ),
        chat("user-name", messages=[{"role": "user", "content": "Hello", "name": "ada"}]),
        chat("penalties", frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.2),
        chat("logit-bias", logit_bias={"504": 5}),
        chat("chat-template-kwargs", chat_template_kwargs={"enable_thinking": False}),
        chat("skip-special-tokens-off", skip_special_tokens=False),
        chat("user-field", user="someone"),
        *[chat(f"openai-{key}", **{key: value}) for key, value in _OPENAI_FIELDS.items()],
        chat("parallel-tool-calls", parallel_tool_calls=False),
    ]


_OPENAI_FIELDS: dict[str, Any] = {
    "store": False,
    "metadata": {"run": "conformance"},
    "reasoning_effort": "low",
    "service_tier": "auto",
    "modalities": ["text"],
    "verbosity": "low",
    "safety_identifier": "user-1",
    "prompt_cache_key": "key-1",
}


def structured_chat_cases() -> list[Case]:
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
    }
    return [
        chat("json-object", response_format={"type": "json_object"}, max_tokens=12),
        chat("json-schema", response_format=schema_format, max_tokens=12),
        chat("json-schema-stream", response_format=schema_format, max_tokens=12, stream=True),
        chat("response-format-text", response_format={"type": "text"}),
        chat("structured-choice", structured_outputs={"choice": ["Paris", "London"]}),
        chat("structured-regex", structured_outputs={"regex": "[A-Z][a-z]+"}, max_tokens=6),
        chat("structured-json", structured_outputs={"json": PERSON_SCHEMA}, max_tokens=12),
        chat("structured-grammar", structured_outputs={"grammar": 'root ::= "yes" | "no"'}),
        chat("structured-json-object", structured_outputs={"json_object": True}, max_tokens=8),
        chat("guided-choice", guided_choice=["Paris", "London"]),
        chat("guided-regex", guided_regex="[A-Z][a-z]+", max_tokens=6),
        chat("guided-json", guided_json=PERSON_SCHEMA, max_tokens=12),
    ]


def tool_cases() -> list[Case]:
    named = {"type": "function", "function": {"name": "get_weather"}}
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    return [
        chat("tools-default", tools=[WEATHER_TOOL], messages=weather, max_tokens=12),
        chat("tools-none", tools=[WEATHER_TOOL], tool_choice="none", messages=weather),
        chat(
            "tools-auto", tools=[WEATHER_TOOL], tool_choice="auto", messages=weather, max_tokens=12
        ),
        chat(
            "tools-required",
            tools=[WEATHER_TOOL],
            tool_choice="required",
            messages=weather,
            max_tokens=24,
        ),
        chat(
            "tools-named", tools=[WEATHER_TOOL], tool_choice=named, messages=weather, max_tokens=16
        ),
        chat(
            "tools-named-stream",
            tools=[WEATHER_TOOL],
            tool_choice=named,
            messages=weather,
            max_tokens=16,
            stream=True,
        ),
        chat(
            "tools-result-turn",
            tools=[WEATHER_TOOL],
            messages=[
                *weather,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
            ],
        ),
    ]


def completion_cases() -> list[Case]:
    sampled = {"temperature": 1.0, "seed": 7}
    return [
        *_streamed(completion, "plain"),
        *_streamed(completion, "logprobs", logprobs=3),
        *_streamed(completion, "n2-seeded", False, n=2, **sampled),
        *_streamed(completion, "token-ids", prompt=PROMPT_IDS),
        *_streamed(completion, "batch", prompt=[PROMPT, "Once upon a time"]),
        completion("n2-greedy", n=2),
        completion("batch-token-ids", prompt=[PROMPT_IDS, [504, 3575]]),
        completion("batch-n2-seeded", False, prompt=[PROMPT, "Hello"], n=2, **sampled),
        completion("echo", echo=True),
        completion("echo-logprobs", echo=True, logprobs=2),
        completion("echo-token-ids", echo=True, prompt=PROMPT_IDS),
        completion("echo-stream", echo=True, stream=True),
        completion("logprobs-zero", logprobs=0),
        completion("stop", stop=["."], max_tokens=24),
        completion("stop-included", stop=["."], include_stop_str_in_output=True, max_tokens=24),
        completion("stop-stream", stop=["."], max_tokens=24, stream=True),
        completion("ignore-eos", ignore_eos=True, max_tokens=24),
        completion("min-tokens", min_tokens=4),
        completion("seeded", False, temperature=0.7, seed=11, top_k=10, min_p=0.05),
        completion("return-token-ids", return_token_ids=True),
        completion("prompt-logprobs", prompt_logprobs=2),
        completion("no-special-tokens", add_special_tokens=False),
        completion("max-tokens-one", max_tokens=1),
        completion("repetition-penalty", repetition_penalty=1.3, max_tokens=12),
        completion("truncate-prompt", truncate_prompt_tokens=3),
        completion("allowed-token-ids", allowed_token_ids=[504, 3575, 282], max_tokens=3),
        completion("json-object", response_format={"type": "json_object"}, max_tokens=8),
        completion("structured-choice", structured_outputs={"choice": ["Paris", "Lyon"]}),
        completion("structured-regex", structured_outputs={"regex": " [A-Z][a-z]+"}),
        completion("guided-choice", guided_choice=["Paris", "Lyon"]),
        completion("user-field", user="someone"),
        completion("empty-stop-list", stop=[]),
    ]


def responses_cases() -> list[Case]:
    base = {"model": MODEL, "max_output_tokens": 8, "temperature": 0}

    def response(name: str, values: bool = True, **fields: Any) -> Case:
        return Case(f"responses-{name}", "POST", "/v1/responses", {**base, **fields}, values)

    return [
        response("text", input="What is the capital of France?"),
        response("messages", input=QUESTION),
        response("instructions", input="Capital of France?", instructions="Be brief."),
        response("stream", input="What is the capital of France?", stream=True),
        response(
            "json-schema",
            input="A person",
            text={"format": {"type": "json_schema", "name": "p", "schema": PERSON_SCHEMA}},
            max_output_tokens=12,
        ),
        response("no-store", input="Hi", store=False),
        Case(
            "responses-no-model",
            "POST",
            "/v1/responses",
            {"input": "Hi", "max_output_tokens": 8, "temperature": 0},
            values=True,
        ),
    ]


def tokenizer_cases() -> list[Case]:
    def post(name: str, path: str, body: Any) -> Case:
        return Case(name, "POST", path, body, values=True)

    return [
        post("tokenize-prompt", "/tokenize", {"model": MODEL, "prompt": PROMPT}),
        post(
            "tokenize-no-special",
            "/tokenize",
            {"model": MODEL, "prompt": PROMPT, "add_special_tokens": False},
        ),
        post(
            "tokenize-token-strs",
            "/tokenize",
            {"model": MODEL, "prompt": PROMPT, "return_token_strs": True},
        ),
        post("tokenize-messages", "/tokenize", {"model": MODEL, "messages": QUESTION}),
        post(
            "tokenize-messages-no-prompt",
            "/tokenize",
            {"model": MODEL, "messages": QUESTION, "add_generation_prompt": False},
        ),
        post("tokenize-no-model", "/tokenize", {"prompt": PROMPT}),
        post("detokenize", "/detokenize", {"model": MODEL, "tokens": PROMPT_IDS}),
        post("detokenize-no-model", "/detokenize", {"tokens": PROMPT_IDS}),
    ]


def service_cases() -> list[Case]:
    return [
        Case("models", "GET", "/v1/models"),
        Case("health", "GET", "/health"),
        Case("ping-get", "GET", "/ping"),
        Case("ping-post", "POST", "/ping"),
        Case("load", "GET", "/load"),
        Case("version", "GET", "/version"),
    ]


def all_cases() -> list[Case]:
    cases = [
        *chat_cases(),
        *structured_chat_cases(),
        *tool_cases(),
        *completion_cases(),
        *responses_cases(),
        *tokenizer_cases(),
        *service_cases(),
        *bad_input_cases(),
    ]
    names = [case.name for case in cases]
    duplicates = {name for name in names if names.count(name) > 1}
    if duplicates:
        raise ValueError(f"case names used twice: {sorted(duplicates)}")
    return cases

"""The comparator on answers written by hand: what it reports, and what it leaves out."""

from __future__ import annotations

import json
from typing import Any

from tests.conformance.compare import Answer, Difference, answer_differences
from tests.conformance.intentional_differences import unlisted


def _json(body: Any, status: int = 200) -> Answer:
    return Answer(status, "application/json", json.dumps(body))


def _sse(*chunks: Any, done: bool = True) -> Answer:
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    return Answer(200, "text/event-stream", "".join(events) + ("data: [DONE]\n\n" if done else ""))


def _kinds(found: list[Difference]) -> set[tuple[str, str]]:
    return {(difference.kind, difference.path) for difference in found}


def test_missing_extra_and_retyped_keys_are_reported_once_at_their_top() -> None:
    vllm = {"choices": [{"text": "a", "stop_reason": "x"}], "usage": {"n": 1}}
    penstock = {"choices": [{"text": 1, "extra": {"deep": 1}}], "usage": None}
    found = answer_differences(_json(vllm), _json(penstock), values=False)
    assert _kinds(found) == {
        ("missing", "choices[].stop_reason"),
        ("type", "choices[].text"),
        ("extra", "choices[].extra"),
        ("type", "usage"),
    }


def test_a_key_sent_as_null_equals_a_key_left_out() -> None:
    found = answer_differences(_json({"a": 1, "b": None}), _json({"a": 1}), values=True)
    assert found == []


def test_greedy_values_compare_numbers_within_the_tolerance() -> None:
    vllm = {"id": "x1", "logprob": -0.50001, "text": "Paris"}
    penstock = {"id": "y2", "logprob": -0.50003, "text": "Lyon"}
    found = answer_differences(_json(vllm), _json(penstock), values=True)
    assert _kinds(found) == {("value", "text")}


def test_token_keyed_maps_compare_their_keys_as_values_not_as_structure() -> None:
    def answer(tokens: dict[str, float]) -> Answer:
        return _json({"choices": [{"logprobs": {"top_logprobs": [tokens]}}]})

    found = answer_differences(answer({" Paris": -0.1}), answer({" Lyon": -0.1}), values=True)
    assert _kinds(found) == {("value", "choices[0].logprobs.top_logprobs[0]")}


def test_a_status_difference_hides_the_body_differences_it_causes() -> None:
    found = answer_differences(_json({"error": {}}, 400), _json({"id": 1}), values=True)
    assert _kinds(found) == {("status", "")}


def test_stream_framing_and_assembled_text_are_compared() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}

    def text(content: str, finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}

    vllm = _sse(role, text("Par"), text("is", "stop"))
    penstock = _sse(role, text("Paris"), text("", "stop"), done=False)
    found = answer_differences(vllm, penstock, values=True)
    assert _kinds(found) == {("sse", "ends_with_done"), ("sse", "pattern")}


def test_the_listed_error_code_difference_is_not_reported() -> None:
    vllm = _json({"error": {"message": "m", "code": 400}}, 400)
    penstock = _json({"error": {"message": "m", "code": "invalid_value"}}, 400)
    found = answer_differences(vllm, penstock, values=False)
    assert _kinds(found) == {("type", "error.code")}
    assert unlisted("bad-chat-n-zero", found) == []

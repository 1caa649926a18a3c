"""One choice folding engine chunks: text, stop strings, finish reasons, logprobs,
weight versions, reasoning and tool calls, with the shipped tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from penstock.preprocess import Preprocessor
from penstock.preprocess.tool_calls import TOOL_CALL_FORMATS
from penstock.serving.choice import ChoiceState, Delta, LogprobEntry, TokenLogprob
from penstock.serving.parsing import OutputParsing

SAMPLE_TOKENIZER = Path(__file__).parents[2] / "penstock/engines/assets/sample-tokenizer"
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def preprocessor() -> Preprocessor:
    return Preprocessor.from_folder(SAMPLE_TOKENIZER)


def choice_for(
    preprocessor: Preprocessor, stops: tuple[str, ...] = (), **options: Any
) -> ChoiceState:
    settings: dict[str, Any] = {"keep_text": True, "want_logprobs": False, **options}
    return ChoiceState(0, preprocessor, list(stops), prompt_token_ids=[], **settings)


def feed_tokens(
    choice: ChoiceState, token_ids: list[int], finish: str = "length", version: str | None = None
) -> list[Delta]:
    """One chunk per token, the last one finishing, as an engine streams them."""
    deltas = []
    for position, token in enumerate(token_ids):
        chunk: dict[str, Any] = {"token_ids": [token], "index": 0}
        if position == len(token_ids) - 1:
            chunk["finish_reason"] = finish
        deltas.append(choice.consume(chunk, version))
        if deltas[-1].finish_reason is not None:
            break
    return deltas


def test_tokens_become_text_and_the_last_chunk_finishes(preprocessor: Preprocessor) -> None:
    choice = choice_for(preprocessor)
    ids = preprocessor.encode("Hello, world! Ünïcödé ✓")
    deltas = feed_tokens(choice, ids)
    assert "".join(delta.text for delta in deltas) == "Hello, world! Ünïcödé ✓"
    assert [delta.finish_reason for delta in deltas] == [None] * (len(ids) - 1) + ["length"]
    assert [t for delta in deltas for t in delta.token_ids] == ids
    assert choice.text == "Hello, world! Ünïcödé ✓"
    assert choice.token_ids == ids


def test_a_stop_string_split_across_chunks_ends_the_choice_before_it(
    preprocessor: Preprocessor,
) -> None:
    choice = choice_for(preprocessor, stops=("world",))
    deltas = feed_tokens(choice, preprocessor.encode("hello wo" + "rld and more"))
    assert "".join(delta.text for delta in deltas) == "hello "
    assert deltas[-1].finish_reason == "stop"
    assert choice.finish_reason == "stop"


def test_held_back_text_is_released_when_no_stop_string_completes(
    preprocessor: Preprocessor,
) -> None:
    choice = choice_for(preprocessor, stops=("world",))
    deltas = feed_tokens(choice, preprocessor.encode("hello wor"))
    assert "".join(delta.text for delta in deltas) == "hello wor"
    assert deltas[-1].finish_reason == "length"


@pytest.mark.parametrize(
    ("engine_reason", "client_reason"),
    [
        ("cancelled", "abort"),
        ("abort", "abort"),
        ("eos", "stop"),
        ("stop", "stop"),
        ("length", "length"),
        ("content_filter", "content_filter"),
        ("something_new", "something_new"),
    ],
)
def test_engine_finish_reasons_read_as_clients_know_them(
    preprocessor: Preprocessor, engine_reason: str, client_reason: str
) -> None:
    choice = choice_for(preprocessor)
    delta = choice.consume({"token_ids": [], "index": 0, "finish_reason": engine_reason}, None)
    assert delta.finish_reason == client_reason == choice.finish_reason


def test_logprobs_pair_each_token_with_its_alternatives(preprocessor: Preprocessor) -> None:
    choice = choice_for(preprocessor, want_logprobs=True)
    chunk = {
        "token_ids": [10, 11],
        "log_probs": [-0.5],
        "top_logprobs": [[{"token_id": 12, "logprob": -1.5}]],
    }
    delta = choice.consume(chunk, None)
    assert delta.logprobs == [
        LogprobEntry(10, -0.5, [TokenLogprob(12, -1.5)]),
        LogprobEntry(11, float("-inf"), []),
    ]
    choice.consume({"token_ids": [13], "log_probs": [-0.25], "finish_reason": "length"}, None)
    assert [entry.logprob for entry in choice.logprobs or []] == [-0.5, float("-inf"), -0.25]


def test_no_logprobs_unless_asked(preprocessor: Preprocessor) -> None:
    choice = choice_for(preprocessor)
    delta = choice.consume({"token_ids": [10], "log_probs": [-0.5]}, None)
    assert delta.logprobs is None and choice.logprobs is None


def test_weight_version_segments_say_where_each_version_starts(
    preprocessor: Preprocessor,
) -> None:
    choice = choice_for(preprocessor)
    choice.consume({"token_ids": [10, 11]}, "v1")
    choice.consume({"token_ids": [12]}, "v1")
    delta = choice.consume({"token_ids": [13], "finish_reason": "length"}, "v2")
    assert delta.weight_version == "v2"
    assert choice.weight_version_segments() == [
        {"weight_version": "v1", "start_token": 0},
        {"weight_version": "v2", "start_token": 3},
    ]


def test_tool_calls_come_with_the_finishing_delta(preprocessor: Preprocessor) -> None:
    choice = choice_for(preprocessor, parse_tool_calls=True)
    deltas = feed_tokens(choice, preprocessor.encode("Sure. " + CALL))
    assert "".join(delta.text for delta in deltas) == "Sure. "
    assert all(not delta.tool_calls for delta in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == "tool_calls"
    assert [(call.name, call.arguments) for call in last.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert choice.tool_calls == last.tool_calls


def test_a_malformed_tool_call_is_released_as_text(preprocessor: Preprocessor) -> None:
    choice = choice_for(preprocessor, parse_tool_calls=True)
    deltas = feed_tokens(choice, preprocessor.encode("<tool_call>{not json}</tool_call>"))
    assert "".join(delta.text for delta in deltas) == "<tool_call>{not json}</tool_call>"
    assert deltas[-1].finish_reason == "length" and not deltas[-1].tool_calls


def test_reasoning_and_calls_split_token_by_token(preprocessor: Preprocessor) -> None:
    parsing = OutputParsing(TOOL_CALL_FORMATS["hermes"], {}, True, reasoning_opened=True)
    thought = "Maybe " + CALL.replace("Paris", "Lyon")
    whole = choice_for(preprocessor)
    whole.parse_with(parsing)
    deltas = feed_tokens(whole, preprocessor.encode(f"{thought}</think>Sure. {CALL}"), "stop")
    assert "".join(delta.reasoning for delta in deltas) == whole.reasoning == thought
    assert "".join(delta.text for delta in deltas) == whole.text == "Sure. "
    assert deltas[-1].finish_reason == "tool_calls"
    assert [json.loads(call.arguments) for call in whole.tool_calls] == [{"city": "Paris"}]


def test_a_stream_keeps_no_reasoning_text(preprocessor: Preprocessor) -> None:
    streaming = choice_for(preprocessor, keep_text=False)
    streaming.parse_with(OutputParsing(None, {}, True, reasoning_opened=False))
    deltas = feed_tokens(streaming, preprocessor.encode("<think>a</think>b"))
    assert "".join(delta.reasoning for delta in deltas) == "a"
    assert streaming.reasoning == ""


def test_without_parsers_there_is_no_reasoning(preprocessor: Preprocessor) -> None:
    plain = choice_for(preprocessor)
    deltas = feed_tokens(plain, preprocessor.encode("<think>a</think>b"))
    assert "".join(delta.text for delta in deltas) == "<think>a</think>b"
    assert plain.reasoning is None and all(delta.reasoning == "" for delta in deltas)


def test_stop_reason_is_the_stop_string_or_stop_token_that_ended_the_choice(
    preprocessor: Preprocessor,
) -> None:
    ids = preprocessor.encode("one two three")
    assert len(ids) == len(set(ids)) >= 3
    by_string = choice_for(preprocessor, ("two",))
    feed_tokens(by_string, ids, finish="stop")
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", "two")
    by_token = choice_for(preprocessor, stop_token_ids=[ids[-1]])
    feed_tokens(by_token, ids, finish="stop")
    assert by_token.stop_reason == ids[-1]
    # An end-of-sequence token is no stop the request asked for; a length is no stop.
    by_eos = choice_for(preprocessor, stop_token_ids=[ids[0]])
    feed_tokens(by_eos, ids, finish="eos")
    assert (by_eos.finish_reason, by_eos.stop_reason) == ("stop", None)
    by_length = choice_for(preprocessor, stop_token_ids=[ids[-1]])
    feed_tokens(by_length, ids, finish="length")
    assert by_length.stop_reason is None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_end_token_that_stops_a_choice_leaves_no_text(
    preprocessor: Preprocessor, skip_special_tokens: bool
) -> None:
    choice = choice_for(preprocessor, skip_special_tokens=skip_special_tokens)
    words = preprocessor.encode("Paris")
    feed_tokens(choice, [*words, preprocessor.eos_token_ids[0]], finish="stop")
    assert choice.text == "Paris"


def test_a_stop_token_the_request_names_leaves_no_text(preprocessor: Preprocessor) -> None:
    stop_token = preprocessor.encode(" end")[-1]
    choice = choice_for(preprocessor, stop_token_ids=[stop_token])
    feed_tokens(choice, [*preprocessor.encode("Paris"), stop_token], finish="stop")
    assert choice.text == "Paris" and choice.stop_reason == stop_token


def test_an_end_token_taken_at_the_length_limit_keeps_its_text(
    preprocessor: Preprocessor,
) -> None:
    choice = choice_for(preprocessor, skip_special_tokens=False)
    eos = preprocessor.eos_token_ids[0]
    feed_tokens(choice, [*preprocessor.encode("Paris"), eos], finish="length")
    assert choice.text == "Paris" + preprocessor.token_text(eos)

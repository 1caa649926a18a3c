"""Reasoning split from the answer, whole and streamed, by each parser's rule."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from penstock.preprocess.reasoning import (
    REASONING_PARSERS,
    ReasoningStream,
    opens_in_reasoning,
    split_reasoning,
)
from penstock.settings import Settings


@pytest.mark.parametrize(
    ("text", "opened", "reasoning", "content"),
    [
        (
            "<think>Rain is likely.</think>Take an umbrella.",
            False,
            "Rain is likely.",
            "Take an umbrella.",
        ),
        (
            "<think>Rain is likely.</think>Take an umbrella.",
            True,
            "Rain is likely.",
            "Take an umbrella.",
        ),
        ("\n<think>a</think>\n\nb", False, "\na", "\n\nb"),
        # The template opened the block: the answer starts inside it.
        ("Rain is likely.</think>Take an umbrella.", True, "Rain is likely.", "Take an umbrella."),
        # Cut off while thinking: all of it is reasoning.
        ("Rain is lik", True, "Rain is lik", ""),
        ("<think>Rain is lik", False, "Rain is lik", ""),
        # No block opened: all of it is the answer, a stray </think> included.
        ("Take an umbrella.", False, "", "Take an umbrella."),
        ("Take</think> an umbrella.", False, "", "Take</think> an umbrella."),
        # Only the first </think> ends the reasoning.
        ("<think>a</think>b</think>c", False, "a", "b</think>c"),
        ("<thin", False, "", "<thin"),
        ("", True, "", ""),
    ],
)
def test_split(text: str, opened: bool, reasoning: str, content: str) -> None:
    assert split_reasoning(text, opened=opened) == (reasoning, content)


def test_which_answers_open_in_reasoning() -> None:
    assert opens_in_reasoning("deepseek_r1", "<|Assistant|>")
    assert opens_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not opens_in_reasoning("qwen3", "<|im_start|>assistant\n")
    # enable_thinking: false closes the block in the prompt.
    assert not opens_in_reasoning("qwen3", "assistant\n<think>\n\n</think>\n\n")


def test_the_parsers_are_the_settings_choices() -> None:
    assert REASONING_PARSERS == ("deepseek_r1", "qwen3")
    assert Settings(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="deepseek_r1"):
        Settings(reasoning_parser="o1")


THOUGHTS = st.sampled_from(["<think>", "</think>", "<th", "</", "a", " ", "\n", "b c"])


@given(st.lists(THOUGHTS, max_size=12), st.booleans(), st.lists(st.integers(0, 80)))
def test_any_split_streams_to_the_whole_text_result(
    parts: list[str], opened: bool, cuts: list[int]
) -> None:
    text = "".join(parts)
    points = sorted({min(cut, len(text)) for cut in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    stream = ReasoningStream(opened=opened)
    reasoning, content = "", ""
    for piece in pieces:
        more_reasoning, more_content = stream.feed(piece)
        reasoning, content = reasoning + more_reasoning, content + more_content
    tail_reasoning, tail_content = stream.finish()
    assert (reasoning + tail_reasoning, content + tail_content) == split_reasoning(
        text, opened=opened
    )

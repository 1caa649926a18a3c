"""Reasoning in generated text: what a thinking model writes between ``<think>`` and
``</think>``, kept apart from the answer.

Two rules, named as vLLM names them (``--reasoning-parser``):

- ``deepseek_r1``: the answer opens in reasoning, whether the model writes ``<think>`` or
  the chat template already did, and the reasoning ends at the first ``</think>``; an
  answer cut off before it is all reasoning;
- ``qwen3``: the answer is reasoning only when it opens with ``<think>``, or when the
  prompt ends with ``<think>`` (the templates that open the block themselves); with
  ``enable_thinking: false`` the template closes the block in the prompt, and nothing is
  reasoning.

A ``<think>`` the answer opens with is dropped, and so is the ``</think>`` that ends the
reasoning; the text around them is kept as written. The whole-text split is the stream fed
at once, so a stream and a non-stream answer always agree.
"""

from __future__ import annotations

from typing import NamedTuple, get_args

from penstock.preprocess.tool_calls import partial_marker_length
from penstock.settings import ReasoningParser

REASONING_PARSERS: tuple[str, ...] = get_args(ReasoningParser)

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningSplit(NamedTuple):
    reasoning: str
    content: str


def opens_in_reasoning(parser: str, prompt_tail: str) -> bool:
    """Whether an answer that does not open with ``<think>`` is reasoning from its start;
    ``prompt_tail``: the end of the prompt as text."""
    if parser == "deepseek_r1":
        return True
    return prompt_tail.rstrip().endswith(THINK_START)


class ReasoningStream:
    """One choice's text, split as it streams into reasoning and content."""

    __slots__ = ("_held", "_opened", "_state")

    # Waiting to see whether the answer opens with <think>; in the reasoning; past it.
    _OPENING, _REASONING, _CONTENT = range(3)

    def __init__(self, *, opened: bool) -> None:
        self._opened = opened
        self._state = self._OPENING
        self._held = ""

    def feed(self, text: str) -> ReasoningSplit:
        if self._state == self._CONTENT:
            return ReasoningSplit("", text)
        text = self._held + text
        self._held = ""
        if self._state == self._OPENING:
            opening = text.lstrip()
            if opening.startswith(THINK_START):
                self._state = self._REASONING
                text = text[: len(text) - len(opening)] + opening[len(THINK_START) :]
            elif THINK_START.startswith(opening):
                self._held = text
                return ReasoningSplit("", "")
            elif self._opened:
                self._state = self._REASONING
            else:
                self._state = self._CONTENT
                return ReasoningSplit("", text)
        end = text.find(THINK_END)
        if end >= 0:
            self._state = self._CONTENT
            return ReasoningSplit(text[:end], text[end + len(THINK_END) :])
        keep = partial_marker_length(text, THINK_END)
        self._held = text[len(text) - keep :] if keep else ""
        return ReasoningSplit(text[: len(text) - keep], "")

    def finish(self) -> ReasoningSplit:
        """At the end of the choice: what was held, where it belongs."""
        held, self._held = self._held, ""
        if self._state == self._REASONING or (self._state == self._OPENING and self._opened):
            return ReasoningSplit(held, "")
        return ReasoningSplit("", held)


def split_reasoning(text: str, *, opened: bool) -> ReasoningSplit:
    """The whole text's reasoning and content: what a stream of it ends with."""
    stream = ReasoningStream(opened=opened)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return ReasoningSplit(reasoning + more_reasoning, content + more_content)

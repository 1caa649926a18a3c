"""One choice's output as engine chunks arrive: text, stop strings, reasoning, tool calls,
logprobs.

This is the streaming hot path: plain data, no models, one pass per chunk. Each chunk
folds into the choice's :class:`ChoiceState` and comes out as a :class:`Delta`, what the
chunk added. A choice without parsers (:meth:`ChoiceState.parse_with`) pays one check a
chunk for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from penstock.preprocess.stop_strings import StopStringMatcher
from penstock.preprocess.tool_calls import TOOL_CALL_FORMATS, ParsedToolCall
from penstock.serving.parsing import ChoiceParser, OutputParsing

if TYPE_CHECKING:
    from penstock.preprocess import IncrementalDetokenizer, Preprocessor

# Engines say "cancelled"; clients of vLLM/SGLang (RL trainers among them) know "abort".
# The engine's finish reasons for a choice that took a stop or end token last.
_STOPPED = frozenset({"stop", "eos"})
FINISH_REASONS = {
    "stop": "stop",
    "eos": "stop",
    "length": "length",
    "cancelled": "abort",
    "abort": "abort",
    "tool_calls": "tool_calls",
    "content_filter": "content_filter",
}


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float


class LogprobEntry(NamedTuple):
    """One generated token's logprob and the alternatives the engine reported with it."""

    token_id: int
    logprob: float
    top: list[TokenLogprob]


class WeightVersionSegment(NamedTuple):
    """From ``start_token`` on, the choice's tokens came from ``weight_version``."""

    weight_version: str | None
    start_token: int


class Delta(NamedTuple):
    """What one engine chunk added to one choice."""

    choice: ChoiceState
    text: str
    token_ids: list[int]
    # None when the choice wants no logprobs or the chunk carried none.
    logprobs: list[LogprobEntry] | None
    finish_reason: str | None
    weight_version: str | None
    # Only on the delta that finishes a choice whose text held tool calls.
    tool_calls: tuple[ParsedToolCall, ...]
    # What the chunk added to the choice's reasoning, with a reasoning parser.
    reasoning: str = ""


# ``Delta(...)`` goes through a generated Python ``__new__``; one delta a token makes the
# tuple's own constructor worth calling directly (same object, ~0.2 µs less a token).
_new_delta = tuple.__new__


class ChoiceState:
    """Everything one choice has produced so far."""

    __slots__ = (
        "detokenizer",
        "end_token_ids",
        "finish_reason",
        "include_stop",
        "index",
        "keep_text",
        "logprobs",
        "parser",
        "reasoning_parts",
        "stop",
        "stop_token_ids",
        "text_parts",
        "token_ids",
        "tool_calls",
        "versions",
    )

    def __init__(
        self,
        index: int,
        preprocessor: Preprocessor | None,
        stops: list[str],
        *,
        prompt_token_ids: list[int],
        keep_text: bool,
        want_logprobs: bool,
        parse_tool_calls: bool = False,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        self.index = index
        self.parser: ChoiceParser | None = None
        # None without a reasoning parser: the answer has no reasoning field then.
        self.reasoning_parts: list[str] | None = None
        # ``Generation``'s flag: the hermes format, no tool schemas. Chat chooses its
        # parsers per request and attaches them with :meth:`parse_with`.
        if parse_tool_calls:
            self.parse_with(OutputParsing(TOOL_CALL_FORMATS["hermes"], {}, True, None))
        self.tool_calls: tuple[ParsedToolCall, ...] = ()
        # Primed with the prompt so a decoder that treats the first token specially (a
        # SentencePiece leading space) decodes the completion as it continues the prompt.
        self.detokenizer: IncrementalDetokenizer | None = (
            preprocessor.new_detokenizer(prompt_token_ids, skip_special_tokens=skip_special_tokens)
            if preprocessor is not None
            else None
        )
        self.stop = StopStringMatcher(stops) if stops else None
        self.include_stop = include_stop
        self.stop_token_ids = stop_token_ids
        # The tokens that end a choice without their text, as in vLLM: the model's end of
        # sequence and the request's stop tokens (shown only where special tokens are).
        self.end_token_ids = frozenset(
            [
                *(preprocessor.eos_token_ids if preprocessor is not None else ()),
                *(stop_token_ids or ()),
            ]
        )
        self.keep_text = keep_text
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[LogprobEntry] | None = [] if want_logprobs else None
        self.finish_reason: str | None = None
        self.versions: list[WeightVersionSegment] = []

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def reasoning(self) -> str | None:
        parts = self.reasoning_parts
        return "".join(parts) if parts is not None else None

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's ``stop_reason``: the stop string or the request's stop token that ended
        the choice; None for an end-of-sequence token, a length or an abort."""
        if self.finish_reason != "stop":
            return None
        if self.stop is not None and self.stop.matched:
            return self.stop.matched
        if self.stop_token_ids and self.token_ids and self.token_ids[-1] in self.stop_token_ids:
            return self.token_ids[-1]
        return None

    def parse_with(self, parsing: OutputParsing) -> None:
        """Split this choice's text with ``parsing``'s parsers from now on."""
        self.parser = parsing.for_choice()
        if parsing.reasoning_opened is not None:
            self.reasoning_parts = []

    def weight_version_segments(self) -> list[dict[str, Any]]:
        """Which weights produced which tokens: ``[{"weight_version", "start_token"}]``."""
        return [segment._asdict() for segment in self.versions]

    def consume(self, chunk: dict[str, Any], version: str | None) -> Delta:
        """Fold one engine chunk in; return what it added."""
        token_ids: list[int] = chunk.get("token_ids") or []
        versions = self.versions
        if not versions or versions[-1].weight_version != version:
            versions.append(WeightVersionSegment(version, len(self.token_ids)))
        self.token_ids.extend(token_ids)
        text = ""
        reason = chunk.get("finish_reason")
        detokenizer = self.detokenizer
        if detokenizer is not None:
            shown = token_ids
            if (
                reason
                and reason in _STOPPED
                and token_ids[-1:]
                and token_ids[-1] in self.end_token_ids
            ):
                shown = token_ids[:-1]
            # Most chunks carry one token.
            if len(shown) == 1:
                text = detokenizer.step(shown[0])
            else:
                for token in shown:
                    text += detokenizer.step(token)
        if reason and detokenizer is not None:
            text += detokenizer.flush()
        # Stop strings and parsers cost a call only to the requests that have them.
        if self.stop is not None:
            text, reason = self._match_stops(self.stop, text, reason)
        tool_calls: tuple[ParsedToolCall, ...] = ()
        reasoning = ""
        if self.parser is not None:
            reasoning, text, tool_calls = self._parse(self.parser, text, bool(reason))
            if tool_calls:
                reason = "tool_calls"
        entries = None
        if self.logprobs is not None and "log_probs" in chunk:
            entries = _logprob_entries(token_ids, chunk)
            self.logprobs.extend(entries)
        if reason:
            self.finish_reason = FINISH_REASONS.get(reason, reason)
        if self.keep_text and text:
            self.text_parts.append(text)
        fields = (
            self,
            text,
            token_ids,
            entries,
            self.finish_reason,
            version,
            tool_calls,
            reasoning,
        )
        return _new_delta(Delta, fields)

    def _match_stops(
        self, stop: StopStringMatcher, text: str, reason: str | None
    ) -> tuple[str, str | None]:
        text, matched = stop.feed(text)
        if matched:
            # Once: after the match the matcher answers every chunk with no text.
            if self.include_stop and self.finish_reason is None:
                text += stop.matched
            return text, "stop"
        if reason:
            text += stop.flush()
        return text, reason

    def _parse(
        self, parser: ChoiceParser, text: str, final: bool
    ) -> tuple[str, str, tuple[ParsedToolCall, ...]]:
        reasoning, text, tool_calls = parser.feed(text, final)
        if tool_calls:
            self.tool_calls = tool_calls
        if reasoning and self.keep_text and self.reasoning_parts is not None:
            self.reasoning_parts.append(reasoning)
        return reasoning, text, tool_calls


def _logprob_entries(token_ids: list[int], chunk: dict[str, Any]) -> list[LogprobEntry]:
    values = chunk.get("log_probs") or []
    tops = chunk.get("top_logprobs") or []
    entries: list[LogprobEntry] = []
    for position, token in enumerate(token_ids):
        logprob = values[position] if position < len(values) else float("-inf")
        alternatives = tops[position] if position < len(tops) else []
        top = [TokenLogprob(alt["token_id"], alt["logprob"]) for alt in alternatives or []]
        entries.append(LogprobEntry(token, logprob, top))
    return entries

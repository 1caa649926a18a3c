"""Every way Penstock's answers differ from vLLM's on purpose, once, with its reason.

The differential suite fails on any difference not listed here, and on an entry no case
produces any more. ``case`` and ``path`` are patterns where ``*`` stands for any text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from tests.conformance.compare import Difference


@dataclass(frozen=True)
class IntentionalDifference:
    case: str
    kind: str
    path: str
    reason: str
    detail: str = "*"

    @cached_property
    def _patterns(self) -> tuple[re.Pattern[str], ...]:
        return _pattern(self.case), _pattern(self.path), _pattern(self.detail)

    def covers(self, case: str, difference: Difference) -> bool:
        case_pattern, path_pattern, detail_pattern = self._patterns
        return (
            difference.kind == self.kind
            and case_pattern.fullmatch(case) is not None
            and path_pattern.fullmatch(difference.path) is not None
            and detail_pattern.fullmatch(difference.detail) is not None
        )


def _pattern(text: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in text.split("*")), re.DOTALL)


_GUIDED = (
    "Penstock honours the legacy guided_choice, guided_regex and guided_json fields "
    "(clients written for vLLM before structured_outputs still send them); vLLM 0.32 "
    "ignores them and generates freely."
)
_PREFIX_CACHE = (
    "Penstock reports the prompt tokens its prefix cache served (chat and completions: "
    "usage.prompt_tokens_details.cached_tokens; Responses: "
    "usage.input_tokens_details.cached_tokens) as OpenAI does; vLLM sends null, or 0 in "
    "Responses, unless started with --enable-prompt-tokens-details."
)
_WEIGHT_VERSION = (
    "Penstock stamps each answer and choice with the weight version(s) that produced it, "
    "which an RL trainer needs to tell stale rollouts apart; vLLM has no such field."
)
_RESPONSES_OPENAI = (
    "Penstock's Responses objects follow OpenAI's Responses API, which Responses clients "
    "are written against; vLLM's diverge from it here."
)
_RESPONSES_USAGE = (
    "Penstock's Responses usage is OpenAI's (input_tokens_details.cached_tokens, "
    "output_tokens_details.reasoning_tokens); vLLM adds per-turn and tool-output counts of "
    "its own, which no OpenAI client reads and which a one-turn response would fill with "
    "what usage already says."
)
_REFUSED = (
    "Penstock refuses this field with a 400 naming it rather than ignore it: its engines "
    "have no per-request logits processor (logit_bias, allowed_token_ids) or it does not "
    "yet render or cut the prompt this way, and a silently ignored field would give an "
    "answer the client did not ask for. vLLM honours it."
)
_COMPACT_JSON = (
    "Penstock's JSON constraints (json_object, json_schema, structured_outputs.json) default "
    "to compact whitespace: with free whitespace a weak model pads until its token limit. "
    "vLLM's xgrammar allows any whitespace by default, so greedy texts differ in whitespace "
    "(properties come in the schema's order in both); structured_outputs."
    "disable_any_whitespace: false asks Penstock for vLLM's behaviour."
)
_ERROR_ENVELOPE = (
    "Penstock answers unknown routes and wrong methods in OpenAI's error envelope "
    "(error.message/type/code), as every other error; vLLM leaves FastAPI's {detail}."
)

INTENTIONAL_DIFFERENCES: tuple[IntentionalDifference, ...] = (
    IntentionalDifference(
        "*",
        "type",
        "error.code",
        "Penstock sends OpenAI's string error code (invalid_value, model_not_found...), "
        "which OpenAI's clients read; vLLM sends the HTTP status as an int.",
    ),
    IntentionalDifference(
        "*",
        "type",
        "error.param",
        "Penstock names the offending field in error.param wherever it knows it; vLLM "
        "sends null for most validation errors.",
        detail="vLLM null, Penstock string",
    ),
    IntentionalDifference("bad-*", "missing", "detail", _ERROR_ENVELOPE),
    IntentionalDifference("bad-*", "extra", "error", _ERROR_ENVELOPE),
    IntentionalDifference("*-guided-*", "value", "*", _GUIDED),
    IntentionalDifference("bad-chat-guided-json-bad", "status", "", _GUIDED),
    IntentionalDifference("*", "type", "*usage.prompt_tokens_details", _PREFIX_CACHE),
    IntentionalDifference("*", "extra", "*usage.prompt_tokens_details", _PREFIX_CACHE),
    IntentionalDifference(
        "responses-*", "value", "*usage.input_tokens_details.cached_tokens", _PREFIX_CACHE
    ),
    IntentionalDifference("*", "extra", "*choices[].weight_versions", _WEIGHT_VERSION),
    IntentionalDifference(
        "health",
        "body",
        "",
        "Penstock's /health reports the engine's and the admin plane's state as JSON "
        "(deployments and the RL admin read it); vLLM answers an empty 200.",
    ),
    IntentionalDifference(
        "bad-chat-bad-role",
        "status",
        "",
        "Penstock refuses a role outside OpenAI's five (system, developer, user, assistant, "
        "tool) with 400 naming messages[i].role; vLLM passes it into the chat template, "
        "which renders whatever the template does with an unknown role.",
    ),
    IntentionalDifference(
        "responses-*", "type", "*metadata", _RESPONSES_OPENAI, "vLLM null, Penstock object"
    ),
    IntentionalDifference(
        "responses-*", "type", "*reasoning", _RESPONSES_OPENAI, "vLLM null, Penstock object"
    ),
    IntentionalDifference(
        "responses-*", "type", "*text", _RESPONSES_OPENAI, "vLLM null, Penstock object"
    ),
    IntentionalDifference(
        "responses-*",
        "value",
        "*tool_choice",
        _RESPONSES_OPENAI
        + ' OpenAI\'s default tool_choice is "auto"; vLLM reports "none" for a request '
        "without tools.",
    ),
    IntentionalDifference(
        "responses-*",
        "extra",
        "*completed_at",
        _RESPONSES_OPENAI + " OpenAI's response carries completed_at.",
    ),
    IntentionalDifference(
        "responses-*", "extra", "*store", _RESPONSES_OPENAI + " OpenAI's response echoes store."
    ),
    IntentionalDifference(
        "responses-*",
        "type",
        "*top_p",
        "Penstock echoes the top_p the request set (null when it left it to the model's "
        "generation config) rather than claim a value; vLLM reports 1.0.",
        "vLLM number, Penstock null",
    ),
    IntentionalDifference(
        "responses-*",
        "type",
        "*content[].logprobs",
        _RESPONSES_OPENAI
        + " OpenAI sends an output_text's logprobs as an array, empty unless asked for.",
        "vLLM null, Penstock array",
    ),
    IntentionalDifference(
        "responses-stream",
        "type",
        "chunks[].part.logprobs",
        _RESPONSES_OPENAI
        + " OpenAI sends an output_text's logprobs as an array, empty unless asked for.",
        "vLLM array|null, Penstock array",
    ),
    IntentionalDifference(
        "responses-stream",
        "type",
        "chunks[].response.usage",
        _RESPONSES_OPENAI + " Penstock's in-progress events carry the usage so far.",
        "vLLM null|object, Penstock object",
    ),
    IntentionalDifference(
        "responses-*", "missing", "*usage.input_tokens_details.*", _RESPONSES_USAGE
    ),
    IntentionalDifference(
        "responses-*", "missing", "*usage.output_tokens_details.*", _RESPONSES_USAGE
    ),
    IntentionalDifference(
        "responses-stream",
        "sse",
        "ends_with_done",
        "Penstock ends every event stream, Responses' too, with data: [DONE] (after an error "
        "event as well), so one client loop reads all its streams; OpenAI's SDK stops there. "
        "vLLM's Responses stream ends at response.completed.",
    ),
    IntentionalDifference("chat-logit-bias", "status", "", _REFUSED),
    IntentionalDifference("completion-allowed-token-ids", "status", "", _REFUSED),
    IntentionalDifference("completion-truncate-prompt", "status", "", _REFUSED),
    IntentionalDifference("chat-continue-final-message", "status", "", _REFUSED),
    IntentionalDifference("chat-echo", "status", "", _REFUSED),
    IntentionalDifference("*json-*", "value", "*", _COMPACT_JSON),
    IntentionalDifference("chat-structured-json*", "value", "*", _COMPACT_JSON),
)


def unlisted(case: str, differences: list[Difference]) -> list[Difference]:
    return [
        difference
        for difference in differences
        if not any(entry.covers(case, difference) for entry in INTENTIONAL_DIFFERENCES)
    ]

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
)


def unlisted(case: str, differences: list[Difference]) -> list[Difference]:
    return [
        difference
        for difference in differences
        if not any(entry.covers(case, difference) for entry in INTENTIONAL_DIFFERENCES)
    ]

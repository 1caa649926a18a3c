"""One request of the differential corpus, and the values many of them share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.conformance.servers import SERVED_MODEL_NAME

MODEL = SERVED_MODEL_NAME
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
# SmolLM2 ids of "The capital of France is".
PROMPT_IDS = [504, 3575, 282, 4649, 314]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: Any = None
    """A JSON body; a ``str`` is sent as is (malformed JSON)."""
    values: bool = False
    content_type: str = "application/json"

"""xgrammar (installed without triton) against llguidance: compile time and mask cost.

Both are vLLM's grammar backends; both run on the CPU. On the default model's tokenizer
(SmolLM2-135M-Instruct, 49k tokens) this times, per grammar (JSON schemas, a regex, a
choice): building the backend's tokenizer table once, compiling the grammar (the median
of ``--rounds`` fresh compiles, xgrammar's cache off), and walking a valid output token
by token, filling the next-token bitmask and accepting the token (the median microseconds
per token, the work the engine adds to each decode step of a constrained row).

    .venv/bin/python bench/grammar_backends.py [--rounds 5]

llguidance is not a Penstock dependency: install it next to the script's interpreter
(``pip install llguidance``) to get its rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from constrained import SCHEMA
from transformers import AutoTokenizer

MODEL = Path.home() / ".cache" / "penstock" / "models" / "SmolLM2-135M-Instruct"

# The cities schema bench/constrained.py decodes under.
CITIES = SCHEMA
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "get_time", "search"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "unit"],
        },
    },
    "required": ["name", "arguments"],
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}
# (name, kind, grammar, an output the grammar accepts)
CASES: list[tuple[str, str, Any, str]] = [
    (
        "json: cities (arrays, bounded strings)",
        "json",
        CITIES,
        json.dumps(
            {
                "cities": [
                    {"name": "Paris", "country": "France", "population": 2102650},
                    {"name": "Berlin", "country": "Germany", "population": 3878100},
                    {"name": "Madrid", "country": "Spain", "population": 3332035},
                ]
            }
        ),
    ),
    (
        "json: tool call (enums, bounds)",
        "json",
        TOOL_CALL,
        json.dumps(
            {"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius", "days": 3}}
        ),
    ),
    (
        "json: person (pattern, nesting)",
        "json",
        PERSON,
        json.dumps(
            {
                "name": "Ada Lovelace",
                "age": 36,
                "email": "ada@example.org",
                "tags": ["math", "engines"],
                "address": {"street": "12 St James's Square", "zip": "SW1Y 4JH"},
            }
        ),
    ),
    ("json: any object", "json", {"type": "object"}, json.dumps({"a": [1, 2, {"b": None}]})),
    (
        "regex: date and time",
        "regex",
        r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z",
        "2026-12-06T23:15:00Z",
    ),
    ("choice: 3 strings", "regex", "positive|negative|neutral", "negative"),
]


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, kind: str, grammar: Any) -> Any:
        if kind == "regex":
            return self.compiler.compile_regex(grammar)
        return self.compiler.compile_json_schema(json.dumps(grammar), any_whitespace=False)

    def walk(self, compiled: Any, tokens: list[int]) -> list[float]:
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        costs = []
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            assert matcher.accept_token(token), "xgrammar refused the sample output"
            costs.append(time.perf_counter() - start)
        return costs


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, kind: str, grammar: Any) -> Any:
        if kind == "regex":
            spec = self.llg.LLMatcher.grammar_from_regex(grammar)
        else:
            # xgrammar's compact separators, no free whitespace, as the engine asks of both.
            defaults = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            spec = self.llg.LLMatcher.grammar_from_json_schema(
                json.dumps(grammar), defaults=defaults
            )
        matcher = self.llg.LLMatcher(self.tokenizer, spec)
        assert not matcher.is_error(), matcher.get_error()
        return spec

    def walk(self, compiled: Any, tokens: list[int]) -> list[float]:
        matcher = self.llg.LLMatcher(self.tokenizer, compiled)
        bitmask = self.llg.torch.allocate_token_bitmask(1, self.vocab_size)
        costs = []
        for token in tokens:
            start = time.perf_counter()
            self.llg.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(token), f"llguidance refused: {matcher.get_error()}"
            costs.append(time.perf_counter() - start)
        return costs


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = action()
    return time.perf_counter() - start, result


def backend_compile(backend: Any, kind: str, grammar: Any) -> tuple[float, Any]:
    return timed(lambda: backend.compile(kind, grammar))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)
    vocab_size = len(tokenizer)
    backends: list[Any] = []
    for backend in (Xgrammar, Llguidance):
        try:
            seconds, built = timed(lambda backend=backend: backend(tokenizer, vocab_size))
        except ImportError as exc:
            print(f"{backend.name}: not installed ({exc}), skipped")
            continue
        print(f"{backend.name}: tokenizer table {seconds * 1e3:.0f} ms")
        backends.append(built)
    print(f"\n| grammar | backend | compile ms (median of {args.rounds}) | us/token (median) |")
    print("|---|---|---:|---:|")
    for name, kind, grammar, sample in CASES:
        tokens = tokenizer.encode(sample, add_special_tokens=False)
        for backend in backends:
            compiles = [backend_compile(backend, kind, grammar) for _ in range(args.rounds)]
            compiled = compiles[-1][1]
            per_token = statistics.median(backend.walk(compiled, tokens))
            compile_ms = statistics.median(seconds for seconds, _ in compiles) * 1e3
            print(f"| {name} | {backend.name} | {compile_ms:.2f} | {per_token * 1e6:.0f} |")


if __name__ == "__main__":
    main()

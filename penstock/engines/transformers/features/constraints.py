"""Constrained decoding: a request's ``sampling_options.guided_decoding`` as an xgrammar
grammar, one matcher per sequence, and the token bitmask applied to the batch's logits.

The request names exactly one constraint (the gateway turns every API's spelling into
this one), checked and held to its limits by :mod:`penstock.engines.guided_specs`.
``whitespace`` ``"compact"`` (the default) fixes JSON separators to ``", "`` and ``": "``
and allows no whitespace between tokens; ``"any"`` allows any run of it. The default matters with a
weak model: free whitespace lets it pad until the token limit.

Every JSON grammar forbids raw control characters and broken UTF-8 inside strings (which
xgrammar's own let through in places), and once
the value is complete only an end token may follow, so the sequence stops there.
Compiled grammars are cached by their spec; compiling runs off the event loop, within a
deadline (:mod:`.grammar_compiles`). Rows
without a constraint never reach this module: the sampler only calls it for rows that
carry a matcher.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from penstock import extras
from penstock.engines.guided_specs import GuidedSpec

# Compiled grammars kept, least recently used dropped first.
GRAMMAR_CACHE_SIZE = 256

# xgrammar's errors open with a time and a source location, no use to a client.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# A negated character class of xgrammar's EBNF, and what no JSON string may hold raw, in
# its syntax: control characters, and surrogates (UTF-8 that decodes to no character).
_NEGATED_CLASS = re.compile(r"\[\^((?:\\.|[^\]\\])*)\]")
_NOT_IN_STRINGS = "\\0-\\x1f\\uD800-\\uDFFF"


class GrammarCompiler:
    """Compiles :class:`GuidedSpec` s against one tokenizer, cached; thread-safe.

    The tokenizer's table is built on the first constrained request, so a server that
    never sees one never loads xgrammar, and one without it installed answers each
    constrained request with a 501 saying how to install it.
    """

    def __init__(self, tokenizer_path: Path, vocab_size: int, end_ids: frozenset[int]) -> None:
        self._tokenizer_path = tokenizer_path
        self._vocab_size = vocab_size
        self._end_ids = sorted(end_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[GuidedSpec, Any] = OrderedDict()

    def prepare(self) -> None:
        """Build the tokenizer's table now (the first constrained request's wait)."""
        with self._lock:
            self._xgrammar_compiler()

    def cached(self, spec: GuidedSpec) -> Any:
        """The compiled grammar of ``spec`` if it is cached, else None."""
        with self._lock:
            return self._cache.get(spec)

    def compile(self, spec: GuidedSpec) -> Any:
        """The compiled grammar of ``spec``; ``ValueError`` says what it cannot express."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
            compiler = self._xgrammar_compiler()
        compiled = _compile(compiler, spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            from transformers import AutoTokenizer

            xgrammar = extras.xgrammar()

            tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path, local_files_only=True)
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._end_ids
            )
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return self._compiler


def _compile(compiler: Any, spec: GuidedSpec) -> Any:
    xgrammar = extras.xgrammar()

    where = f"sampling_options.guided_decoding.{spec.kind}"
    try:
        if spec.kind in ("regex", "choice"):
            return compiler.compile_regex(spec.text)
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.text)
        if spec.kind == "json":
            grammar = xgrammar.Grammar.from_json_schema(
                spec.text, any_whitespace=spec.any_whitespace, strict_mode=True
            )
        else:
            grammar = xgrammar.Grammar.from_structural_tag(_structural_tag(spec.text))
        return compiler.compile_grammar(_strings_well_formed(str(grammar)))
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = _LOG_PREFIX.sub("", str(exc).strip().splitlines()[-1]) if str(exc).strip() else ""
        raise ValueError(f"{where} is not supported: {reason or type(exc).__name__}") from exc


def _strings_well_formed(ebnf: str) -> str:
    """``ebnf`` with every negated character class (in a JSON grammar: the characters of
    a string) excluding raw control characters and surrogates too. xgrammar's grammars
    exclude control characters from free strings but not from strings with a length
    bound, and let surrogates through, which decode to no character."""
    return _NEGATED_CLASS.sub(
        lambda match: (
            match.group(0)
            if match.group(1).startswith(_NOT_IN_STRINGS)
            else f"[^{_NOT_IN_STRINGS}{match.group(1)}]"
        ),
        ebnf,
    )


def _structural_tag(text: str) -> Any:
    """vLLM's structural tag (``structures`` of begin/schema/end, ``triggers``) as
    xgrammar's; any other shape goes to xgrammar as it is."""
    xgrammar = extras.xgrammar()

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not valid JSON: {exc}") from exc
    if isinstance(value, dict) and "structures" in value:
        try:
            items = [
                xgrammar.StructuralTagItem(
                    begin=item["begin"], schema=json.dumps(item["schema"]), end=item["end"]
                )
                for item in value["structures"]
            ]
        except (KeyError, TypeError) as exc:
            raise ValueError("each of structures needs begin, schema and end") from exc
        return xgrammar.StructuralTag.from_legacy_structural_tag(items, value.get("triggers", []))
    return text


class SequenceConstraint:
    """One sequence's place in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, compiled: Any) -> None:
        self._matcher = extras.xgrammar().GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advance past the chosen token (one the bitmask allowed)."""
        self._matcher.accept_token(token_id)

    @property
    def complete(self) -> bool:
        """The grammar has ended (an end token was accepted): nothing may follow."""
        return bool(self._matcher.is_terminated())


def apply_constraints(logits: torch.Tensor, constraints: list[SequenceConstraint | None]) -> None:
    """Set to -inf, in place, every logit a row's grammar forbids next (rows without a
    constraint untouched)."""
    rows = [i for i, constraint in enumerate(constraints) if constraint is not None]
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
    for j, i in enumerate(rows):
        constraint = constraints[i]
        assert constraint is not None
        constraint.fill(bitmask, j)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, -torch.inf)


def advance_constraints(token_ids: list[int], constraints: list[SequenceConstraint | None]) -> None:
    for token_id, constraint in zip(token_ids, constraints, strict=True):
        if constraint is not None:
            constraint.accept(token_id)

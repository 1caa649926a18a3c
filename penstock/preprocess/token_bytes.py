"""The raw bytes behind one token, for the ``bytes`` field of logprobs.

Decoding a single token loses information when the token holds part of a UTF-8 character
(it decodes to U+FFFD). The bytes are read from the token's vocabulary string instead,
according to how the tokenizer's decoder maps that string back to text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

from tokenizers import Tokenizer

_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    characters = list(printable)
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + shifted)
            shifted += 1
    return {chr(character): byte for byte, character in zip(printable, characters, strict=True)}


_BYTE_OF_CHARACTER = byte_level_alphabet()


def token_bytes_reader(tokenizer: Tokenizer) -> Callable[[str], bytes]:
    """A function from a (non-added) vocabulary string to the bytes it decodes to."""
    decoder_specs = list(_decoder_specs(tokenizer))
    kinds = {spec.get("type") for spec in decoder_specs}
    if "ByteLevel" in kinds:
        return byte_level_bytes
    replacements = [
        (spec["pattern"]["String"], spec["content"])
        for spec in decoder_specs
        if spec.get("type") == "Replace"
        and isinstance(spec.get("pattern"), dict)
        and isinstance(spec["pattern"].get("String"), str)
        and isinstance(spec.get("content"), str)
    ]
    replacements += [
        (spec.get("replacement", "\u2581"), " ")
        for spec in decoder_specs
        if spec.get("type") == "Metaspace"
    ]
    byte_fallback = "ByteFallback" in kinds

    def read(piece: str) -> bytes:
        if byte_fallback:
            match = _BYTE_FALLBACK_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        for pattern, content in replacements:
            piece = piece.replace(pattern, content)
        return piece.encode("utf-8")

    return read


def is_byte_level(tokenizer: Tokenizer) -> bool:
    """Whether the decoder is GPT-2's byte-level mapping and nothing else: a token then
    stands for the same bytes wherever it appears."""
    kinds = {spec.get("type") for spec in _decoder_specs(tokenizer)}
    return "ByteLevel" in kinds and kinds <= {"ByteLevel", "Sequence"}


def byte_level_bytes(piece: str) -> bytes:
    """The bytes a byte-level vocabulary string stands for."""
    result = bytearray()
    for character in piece:
        byte = _BYTE_OF_CHARACTER.get(character)
        if byte is None:
            # Not from the byte alphabet (a hand-edited vocabulary): keep its own UTF-8.
            result += character.encode("utf-8")
        else:
            result.append(byte)
    return bytes(result)


def _decoder_specs(tokenizer: Tokenizer) -> Iterator[dict[str, Any]]:
    decoder = tokenizer.decoder
    if decoder is None:
        return
    stack: list[Any] = [json.loads(decoder.__getstate__())]
    while stack:
        spec = stack.pop()
        if not isinstance(spec, dict):
            continue
        yield spec
        if spec.get("type") == "Sequence":
            stack.extend(reversed(spec.get("decoders") or []))

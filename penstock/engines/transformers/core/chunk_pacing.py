"""How much of a long prompt a step computes while rows decode beside it.

A chunk rides in the decode rows' pass (:mod:`.llama_decode`), so the rows wait for it:
their inter-token gap is the whole step. Where pacing is on (the CPU), a chunk is sized
so that a step takes about ``ratio`` times a step of the rows alone, from times this
process measures, not from a fixed token count: what a token of prompt costs beside a
decode step depends on the machine, the model, the rows decoding and how long the prompt
already is. Its size is in token-equivalents (:func:`.prefill_plan.chunk_cost`), which
already count a token's attention over the prompt before it, so one measured price per
token-equivalent holds along the whole prompt.

A decode-only step gets dearer as the rows grow (a row's attention reads its whole KV),
and a prompt paced beside them for minutes lets a row grow by thousands of tokens: every
:data:`_REFRESH` steps one step decodes without a chunk, so the price of a decode step
follows the rows; else their growth would be billed to the prompt, shrinking its chunks,
which lengthens the prefill and lets the rows grow further.

Both prices are the lower quartile of the last steps' times: another process taking the
CPU only ever slows a step, and divided by a chunk of a token or two such a delay would
make a token look many times dearer and shrink every later chunk to a token. Since it
slows decode-only steps as much, the ratio holds under load without counting it. A chunk
grows at most twofold a step, so a price measured on a small chunk is checked on a
larger one before the chunks grow further.

A chunk computes :data:`LEAST_CHUNK_TOKENS` tokens at least, whatever its budget
(:meth:`.prefill_plan.Prefiller.next_chunk`): its attention reads the prompt's whole KV
once, however few tokens it has. On SmolLM2-135M (one CPU thread) that read costs what
~3 tokens' attention over the same KV computes: late in an 8,000-token prompt a chunk of
one token took 36 ms, against 11 ms a token in a chunk of 32, so chunks of a token made
the prefill several times slower than its compute; a chunk of 8 took 113 ms, a fifth of
it the read. Each step beside the rows also costs their own decode step, which a chunk
of a few tokens pays for alone. Where 8 tokens cost more than the target, the step takes
longer than ``ratio`` times a decode-only step.
"""

from __future__ import annotations

from collections import deque

# Steps whose times make the price of a token-equivalent, and of a decode step.
_WINDOW = 16
_DECODE_WINDOW = 5
# While chunks ride beside the rows, one step in this many decodes alone.
_REFRESH = 16
# The first chunk beside decoding rows, before any chunk was timed, in token-equivalents.
_FIRST_CHUNK = 4.0
# The fewest tokens a chunk beside decoding rows computes (see the module's docstring).
LEAST_CHUNK_TOKENS = 8
# What a CPU step computes of a prompt beside decoding rows when the chunk cannot ride in
# their pass (a LoRA adapter loaded, a model without the fused decoder): such steps are
# never timed as a chunk beside rows, so they keep a fixed size.
UNPACED_CPU_CHUNK = 32


class ChunkPacer:
    """The token-equivalents of prompt the next step computes beside its decoding rows.

    ``ratio``: the step's target time over a decode-only step's (None: no pacing, a
    step computes what its budget allows).
    """

    def __init__(self, ratio: float | None) -> None:
        self.ratio = ratio
        self._decode_s: deque[float] = deque(maxlen=_DECODE_WINDOW)
        self._per_equivalent_s: deque[float] = deque(maxlen=_WINDOW)
        self._last = 0.0
        self._fused_since_decode = 0

    def budget(self, ceiling: float) -> float:
        """Token-equivalents of prompt for the next step beside decoding rows, at most
        ``ceiling``; 0 when a decode-only step is due (the step then decodes alone and
        times it)."""
        if self.ratio is None:
            return ceiling
        if not self._decode_s or self._fused_since_decode >= _REFRESH - 1:
            return 0.0
        if not self._per_equivalent_s:
            return min(_FIRST_CHUNK, ceiling)
        spare = (self.ratio - 1) * _low(self._decode_s)
        paced = spare / max(_low(self._per_equivalent_s), 1e-9)
        if self._last:
            paced = min(paced, 2 * self._last)
        return max(min(paced, ceiling), 1.0)

    def decoded(self, seconds: float) -> None:
        """A decode step without a chunk took ``seconds``."""
        self._decode_s.append(seconds)
        self._fused_since_decode = 0

    def fused(self, seconds: float, equivalents: float) -> None:
        """A decode step that carried ``equivalents`` token-equivalents of prompt took
        ``seconds``."""
        self._last = equivalents
        self._fused_since_decode += 1
        if not self._decode_s or equivalents <= 0:
            return
        extra = max(seconds - _low(self._decode_s), 0.0)
        self._per_equivalent_s.append(extra / equivalents)


def _low(samples: deque[float]) -> float:
    """The lower quartile of ``samples``."""
    return sorted(samples)[len(samples) // 4]

"""Stop strings matched across streamed chunks."""

from __future__ import annotations


class StopStringMatcher:
    """Finds stop strings across chunk boundaries; holds back a tail that might be the start
    of a stop string.

    Generation stops at the first stop string to *complete*: if one stop string ends before
    another one does, the first wins even when the second would have started earlier. This
    makes the result independent of how the text is split into chunks, and it is what a
    model sees: once a stop string is out, nothing more is generated. When several stop
    strings complete at the same character, the output is cut before the longest.
    """

    __slots__ = ("_held", "_matched", "_prefix_lengths_by_last_char", "_proper_prefixes", "_stops")

    def __init__(self, stops: list[str]) -> None:
        self._stops = tuple(dict.fromkeys(stop for stop in stops if stop))
        self._held = ""
        self._matched = False
        # For each character, the lengths k (longest first) of proper stop prefixes
        # stop[:k] ending in that character: only those can be a suffix of text that ends
        # in it, so most chunks need no prefix check at all.
        lengths: dict[str, set[int]] = {}
        self._proper_prefixes: set[str] = set()
        for stop in self._stops:
            for length in range(1, len(stop)):
                lengths.setdefault(stop[length - 1], set()).add(length)
                self._proper_prefixes.add(stop[:length])
        self._prefix_lengths_by_last_char = {
            char: sorted(found, reverse=True) for char, found in lengths.items()
        }

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, matched). After a match the emitted text ends
        right before the stop string and every later call returns ("", True)."""
        if not self._stops:
            return text, False
        if self._matched:
            return "", True
        buffer = self._held + text if self._held else text
        if not buffer:
            return "", False
        cut = self._first_completed_stop(buffer)
        if cut is not None:
            self._matched = True
            self._held = ""
            return buffer[:cut], True
        held_length = self._longest_stop_prefix_suffix(buffer)
        if held_length:
            self._held = buffer[-held_length:]
            return buffer[:-held_length], False
        self._held = ""
        return buffer, False

    def flush(self) -> str:
        """At the end of the stream: the held-back tail (it never completed a stop string)."""
        held, self._held = self._held, ""
        return held

    def _first_completed_stop(self, buffer: str) -> int | None:
        """Start of the stop string that ends earliest in ``buffer`` (the longest on a tie)."""
        best_end = -1
        best_start = -1
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best_end < 0 or end < best_end or (end == best_end and start < best_start):
                best_end = end
                best_start = start
        return best_start if best_end >= 0 else None

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop."""
        lengths = self._prefix_lengths_by_last_char.get(buffer[-1])
        if lengths is None:
            return 0
        for length in lengths:
            if length <= len(buffer) and buffer[-length:] in self._proper_prefixes:
                return length
        return 0

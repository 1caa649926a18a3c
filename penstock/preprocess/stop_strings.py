"""Stop strings matched across streamed chunks."""

from __future__ import annotations

from weakref import WeakValueDictionary


class _Automaton:
    """Aho-Corasick automaton of a set of stop strings: one node per distinct prefix, so its
    size and build time are linear in the stops' total length.

    Node 0 is the empty prefix. ``depth[node]`` is the length of the node's prefix,
    ``fail[node]`` the node of its longest proper suffix that is also a prefix of a stop, and
    ``match_length[node]`` the length of the longest stop that is a suffix of it (0 if none).
    """

    __slots__ = ("__weakref__", "children", "depth", "fail", "match_length")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.children: list[dict[str, int]] = [{}]
        self.depth = [0]
        complete = [False]
        for stop in stops:
            node = 0
            for char in stop:
                child = self.children[node].get(char)
                if child is None:
                    child = len(self.children)
                    self.children[node][char] = child
                    self.children.append({})
                    self.depth.append(self.depth[node] + 1)
                    complete.append(False)
                node = child
            complete[node] = True
        self.fail = [0] * len(self.children)
        self.match_length = [0] * len(self.children)
        # Breadth first, so a node's fail target (always shallower) is done before it.
        level = list(self.children[0].values())
        for node in level:
            self.match_length[node] = self.depth[node] if complete[node] else 0
        while level:
            next_level = []
            for node in level:
                for char, child in self.children[node].items():
                    target = self.fail[node]
                    while target and char not in self.children[target]:
                        target = self.fail[target]
                    target = self.children[target].get(char, 0)
                    self.fail[child] = target
                    self.match_length[child] = (
                        self.depth[child] if complete[child] else self.match_length[target]
                    )
                    next_level.append(child)
            level = next_level


# The n choices of a request (and concurrent requests with the same stops) share one
# automaton; it is freed with the last matcher that uses it.
_automata: WeakValueDictionary[tuple[str, ...], _Automaton] = WeakValueDictionary()


def _automaton(stops: tuple[str, ...]) -> _Automaton:
    automaton = _automata.get(stops)
    if automaton is None:
        automaton = _automata[stops] = _Automaton(stops)
    return automaton


class StopStringMatcher:
    """Finds stop strings across chunk boundaries; holds back a tail that might be the start
    of a stop string.

    Generation stops at the first stop string to *complete*: if one stop string ends before
    another one does, the first wins even when the second would have started earlier. This
    makes the result independent of how the text is split into chunks, and it is what a
    model sees: once a stop string is out, nothing more is generated. When several stop
    strings complete at the same character, the output is cut before the longest.

    Each character costs amortized constant time, whatever the number and length of the
    stops. The automaton node reached after the text so far is the longest suffix of that
    text that is a prefix of some stop, which is exactly the tail to hold back.
    """

    __slots__ = ("_automaton", "_held", "_matched", "_state", "matched")

    def __init__(self, stops: list[str]) -> None:
        unique = tuple(dict.fromkeys(stop for stop in stops if stop))
        self._automaton = _automaton(unique) if unique else None
        self._state = 0
        self._held = ""
        self._matched = False
        # The stop string that matched ("" before a match), for output that keeps it.
        self.matched = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, matched). After a match the emitted text ends
        right before the stop string and every later call returns ("", True)."""
        automaton = self._automaton
        if automaton is None:
            return text, False
        if self._matched:
            return "", True
        children, fail, match_length = automaton.children, automaton.fail, automaton.match_length
        state = self._state
        for index, char in enumerate(text):
            while state and char not in children[state]:
                state = fail[state]
            state = children[state].get(char, 0)
            if match_length[state]:
                self._matched = True
                end = len(self._held) + index + 1
                through = self._held + text[: index + 1]
                emitted = through[: end - match_length[state]]
                self.matched = through[end - match_length[state] : end]
                self._held = ""
                self._state = 0
                return emitted, True
        self._state = state
        buffer = self._held + text if self._held else text
        keep = automaton.depth[state]
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """At the end of the stream: the held-back tail (it never completed a stop string)."""
        held, self._held = self._held, ""
        self._state = 0
        return held

from __future__ import annotations

import tracemalloc
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from penstock.preprocess import StopStringMatcher

# A small alphabet makes stop strings, partial matches and overlaps frequent.
small_text = st.text(alphabet="abc\n", max_size=40)
stop_strings = st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3)


def cut_at_first_completed_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Reference: the stop that ends first wins (the longest one if several end together)."""
    completed = [
        (text.find(stop) + len(stop), text.find(stop)) for stop in stops if stop and stop in text
    ]
    if not completed:
        return text, False
    _, start = min(completed)
    return text[:start], True


def stream(matcher: StopStringMatcher, chunks: list[str]) -> tuple[str, bool]:
    emitted = []
    for chunk in chunks:
        text, matched = matcher.feed(chunk)
        emitted.append(text)
        if matched:
            return "".join(emitted), True
    return "".join(emitted) + matcher.flush(), False


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    return [text[start:end] for start, end in pairwise(points)]


@settings(max_examples=500, deadline=None)
@given(
    text=small_text,
    stops=stop_strings,
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_streamed_output_is_the_text_cut_before_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    assert stream(StopStringMatcher(stops), split(text, cuts)) == cut_at_first_completed_stop(
        text, stops
    )


# Up to 16 stops built from two letters (plus a few non-ASCII characters) overlap each
# other and themselves in every way, so partial matches fall back through many shorter ones.
overlap_text = st.text(alphabet="ab\u00e9\U0001f389", max_size=200)
many_stops = st.lists(st.text(alphabet="ab\u00e9\U0001f389", min_size=1, max_size=12), max_size=16)


@st.composite
def text_stops_chunks(draw: st.DrawFn) -> tuple[str, list[str], list[str]]:
    text = draw(overlap_text)
    stops = draw(many_stops)
    # Stops taken from the text itself, so that most examples do stop somewhere.
    for _ in range(draw(st.integers(0, 3))):
        start = draw(st.integers(0, len(text)))
        stops.append(text[start : start + draw(st.integers(1, 20))] or "b")
    cuts = draw(st.lists(st.integers(min_value=0, max_value=len(text)), max_size=30))
    return text, stops, split(text, cuts)


@settings(max_examples=500, deadline=None)
@given(case=text_stops_chunks())
def test_many_overlapping_stops_cut_like_a_search_of_the_whole_text(
    case: tuple[str, list[str], list[str]],
) -> None:
    text, stops, chunks = case

    assert stream(StopStringMatcher(stops), chunks) == cut_at_first_completed_stop(text, stops)


def longest_tail_that_may_start_a_stop(text: str, stops: list[str]) -> int:
    """Reference: length of the longest suffix of ``text`` that is a proper stop prefix."""
    return max(
        (k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0
    )


@settings(max_examples=300, deadline=None)
@given(case=text_stops_chunks())
def test_only_a_tail_that_may_start_a_stop_is_held_back(
    case: tuple[str, list[str], list[str]],
) -> None:
    _, stops, chunks = case
    matcher = StopStringMatcher(stops)
    seen = emitted = ""
    for chunk in chunks:
        out, matched = matcher.feed(chunk)
        seen += chunk
        emitted += out
        if matched:
            return
        held = longest_tail_that_may_start_a_stop(seen, stops)
        assert emitted == seen[: len(seen) - held]


@settings(max_examples=200, deadline=None)
@given(text=small_text, stops=stop_strings)
def test_one_character_at_a_time_equals_all_at_once(text: str, stops: list[str]) -> None:
    assert stream(StopStringMatcher(stops), list(text)) == stream(StopStringMatcher(stops), [text])


def test_partial_match_is_held_back_then_released_when_it_does_not_match() -> None:
    matcher = StopStringMatcher(["</answer>"])

    assert matcher.feed("The result </ans") == ("The result ", False)
    assert matcher.feed("wer") == ("", False)
    assert matcher.feed("s are in.") == ("</answers are in.", False)
    assert matcher.flush() == ""


def test_match_across_chunks_drops_the_stop_and_everything_after() -> None:
    matcher = StopStringMatcher(["STOP"])

    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.feed("OP and more") == ("", True)
    assert matcher.feed("later text") == ("", True)


def test_match_inside_one_chunk() -> None:
    assert StopStringMatcher(["\n\n"]).feed("line one\n\nline two") == ("line one", True)


def test_held_tail_is_returned_by_flush_at_end_of_stream() -> None:
    matcher = StopStringMatcher(["Observation:"])

    assert matcher.feed("Thought: done. Obs") == ("Thought: done. ", False)
    assert matcher.flush() == "Obs"
    assert matcher.flush() == ""


def test_stop_that_completes_first_wins_over_one_that_started_earlier() -> None:
    matcher = StopStringMatcher(["abcd", "bc"])

    assert matcher.feed("xabcd") == ("xa", True)


def test_no_stops_pass_text_through_untouched() -> None:
    matcher = StopStringMatcher([])
    chunk = "anything at all"

    assert matcher.feed(chunk)[0] is chunk
    assert matcher.feed("") == ("", False)
    assert matcher.flush() == ""


def test_empty_stop_strings_are_ignored() -> None:
    assert StopStringMatcher(["", "end"]).feed("the end") == ("the ", True)


def test_matchers_with_the_same_stops_stream_independently() -> None:
    first, second = StopStringMatcher(["<end>"]), StopStringMatcher(["<end>"])

    assert first.feed("one <e") == ("one ", False)
    assert second.feed("two <end> more") == ("two ", True)
    assert first.feed("nd> more") == ("", True)
    assert StopStringMatcher(["<end>"]).feed("three <e") == ("three ", False)


def peak_bytes_to_build(stops: list[str]) -> int:
    tracemalloc.start()
    StopStringMatcher(stops)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def test_memory_grows_linearly_with_the_length_of_the_stop_strings() -> None:
    short = peak_bytes_to_build(["xy" * 1000, "yx" * 1000])
    long = peak_bytes_to_build(["xy" * 8000, "yx" * 8000])

    # Eight times the characters: a quadratic matcher would need about 64 times the memory.
    assert long < 12 * short

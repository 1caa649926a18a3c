"""Memory and time of stop-string matching with the longest stop strings a request may carry.

Usage: python bench/stop_strings.py [--length N] [--stops N] [--chars N]

Two workloads, each with ``--stops`` stop strings of ``--length`` characters (by default
the request limits: 16 strings of MAX_STOP_LENGTH characters):

* repetitive: every stop is ``"a" * (length - 1)`` plus one distinct character and the
  text is all ``"a"``, so the longest possible tail is held back after every chunk;
* prose: random stops that never occur in ordinary text.

Text arrives in 4-character chunks, like streamed tokens. Peak memory is over building
alone and over building plus streaming.
"""

from __future__ import annotations

import argparse
import random
import string
import time
import tracemalloc
from collections.abc import Callable

from penstock.preprocess import StopStringMatcher
from penstock.schemas.openai import MAX_STOP_LENGTH

PROSE = (
    "The quick brown fox jumps over the lazy dog. Café, naïve, façade, Größe. "
    "東京の天気は晴れです。 def f(x):\n    return x * 2\n"
)
CHUNK = 4


def peak_mib(action: Callable[[], object]) -> float:
    """Peak memory allocated while ``action`` ran."""
    tracemalloc.start()
    action()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2**20


def seconds(action: Callable[[], object]) -> float:
    # Timed apart from the memory run: tracing allocations slows Python down severalfold.
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def stream(matcher: StopStringMatcher, text: str) -> None:
    for start in range(0, len(text), CHUNK):
        matcher.feed(text[start : start + CHUNK])
    matcher.flush()


def run(label: str, stops: list[str], text: str) -> None:
    # Matchers with the same stops share their automaton while one is alive, so each
    # measurement builds its own and lets it go before the next.
    build_mib = peak_mib(lambda: StopStringMatcher(stops))
    build_s = seconds(lambda: StopStringMatcher(stops))
    stream_mib = peak_mib(lambda: stream(StopStringMatcher(stops), text))
    matcher = StopStringMatcher(stops)
    stream_s = seconds(lambda: stream(matcher, text))
    chunks = -(-len(text) // CHUNK)
    print(
        f"{label:11s} build {build_mib:8.2f} MiB {build_s * 1e3:9.1f} ms   "
        f"build+stream {stream_mib:8.2f} MiB {stream_s / chunks * 1e9:8.0f} ns/chunk"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=MAX_STOP_LENGTH, help="characters per stop")
    parser.add_argument("--stops", type=int, default=16, help="number of stop strings")
    parser.add_argument("--chars", type=int, default=200_000, help="characters streamed")
    args = parser.parse_args()

    rng = random.Random(0)
    distinct = string.ascii_letters + string.digits
    repetitive = ["a" * (args.length - 1) + distinct[i % len(distinct)] for i in range(args.stops)]
    letters = string.ascii_letters + " .\n"
    prose_stops = ["".join(rng.choices(letters, k=args.length)) for _ in range(args.stops)]
    prose = (PROSE * (args.chars // len(PROSE) + 1))[: args.chars]

    print(f"{args.stops} stops of {args.length} characters, {args.chars} characters streamed")
    run("repetitive", repetitive, "a" * args.chars)
    run("prose", prose_stops, prose)


if __name__ == "__main__":
    main()

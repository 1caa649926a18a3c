"""Per-token cost of the streaming text path: IncrementalDetokenizer.step + StopStringMatcher.feed.

Usage: python bench/detokenize.py [--tokenizer FOLDER] [--repeat N]

The text is mixed on purpose (code, prose, accents, CJK, emoji) so that multi-byte
characters split across tokens are part of the measurement.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from penstock.preprocess import Preprocessor, StopStringMatcher

SAMPLE_TOKENIZER = Path(__file__).parents[1] / "penstock/engines/assets/sample-tokenizer"

PARAGRAPH = (
    "def stream(tokens):\n    for token in tokens:\n        yield decode(token)\n\n"
    "The quick brown fox jumps over the lazy dog. Café, naïve, façade, Größe. "
    "東京の天気は晴れです。 서울은 맑습니다. Emoji: 🎉👩\u200d💻🇳🇴 done.\n"
)
STOPS = ["</answer>", "\nObservation:", "<|user|>"]


def time_per_token(preprocessor: Preprocessor, ids: list[int], stops: list[str] | None) -> float:
    detokenizer = preprocessor.new_detokenizer()
    matcher = StopStringMatcher(stops or [])
    started = time.perf_counter_ns()
    if stops is None:
        for token_id in ids:
            detokenizer.step(token_id)
    else:
        for token_id in ids:
            matcher.feed(detokenizer.step(token_id))
    return (time.perf_counter_ns() - started) / len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=SAMPLE_TOKENIZER)
    parser.add_argument("--repeat", type=int, default=200, help="copies of the sample text")
    parser.add_argument("--rounds", type=int, default=5, help="best of this many runs")
    args = parser.parse_args()

    preprocessor = Preprocessor.from_folder(args.tokenizer)
    ids = preprocessor.encode(PARAGRAPH * args.repeat)
    print(f"{len(ids)} tokens, tokenizer {args.tokenizer}")
    for label, stops in (
        ("detokenize only", None),
        ("detokenize + feed, no stops", []),
        (f"detokenize + feed, {len(STOPS)} stops", STOPS),
    ):
        best = min(time_per_token(preprocessor, ids, stops) for _ in range(args.rounds))
        print(f"{label:32s} {best:8.0f} ns/token")


if __name__ == "__main__":
    main()

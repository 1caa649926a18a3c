"""``bench/README.md`` stays a page of current figures a reader can take in: at most 500
lines, and every benchmark script in ``bench/`` named in it, so none runs undocumented.
The sections other documents cite by name keep their headings."""

from __future__ import annotations

from pathlib import Path

from tests.support.server import REPO_ROOT

BENCH = REPO_ROOT / "bench"
README = BENCH / "README.md"
MAX_LINES = 500
# Cited by name from README.md, docs/ and the code's comments.
CITED_HEADINGS = (
    "On-policy logprobs",
    "Metrics folded at collection",
    "Prompts tokenized by pieces and by words",
)


def readme() -> str:
    return README.read_text(encoding="utf-8")


def scripts() -> list[Path]:
    return sorted([*BENCH.glob("*.py"), *BENCH.glob("*.sh")])


def test_the_readme_is_at_most_500_lines() -> None:
    assert len(readme().splitlines()) <= MAX_LINES


def test_every_bench_script_is_named_in_the_readme() -> None:
    text = readme()
    assert scripts(), "no benchmark scripts found"
    assert [path.name for path in scripts() if path.name not in text] == []


def test_the_cited_sections_keep_their_headings() -> None:
    headings = {line.lstrip("#").strip() for line in readme().splitlines() if line.startswith("#")}
    assert [title for title in CITED_HEADINGS if title not in headings] == []

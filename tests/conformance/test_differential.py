"""Penstock against vLLM's own server, request by request: the same statuses, key paths and
types, SSE framing, and for greedy generations the same texts, token ids and logprobs.
Differences Penstock makes on purpose are listed in ``intentional_differences.py``.

(Not named ``test_vllm_*.py``: ai-dynamo's pytest plugin leaves such files uncollected
wherever ``vllm`` does not import, and it does not in the test environment.)"""

from __future__ import annotations

import pytest

from tests.conformance.case import Case
from tests.conformance.compare import Difference, answer_differences
from tests.conformance.conftest import Oracle
from tests.conformance.corpus import all_cases
from tests.conformance.intentional_differences import INTENTIONAL_DIFFERENCES, unlisted

CASES = all_cases()
# Installing vLLM (first run only) and starting both servers happen in the first test.
pytestmark = pytest.mark.timeout(2400)
_seen: dict[str, list[Difference]] = {}


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_penstock_answers_as_vllm_does(oracle: Oracle, case: Case) -> None:
    vllm, penstock = oracle.ask(case)
    differences = answer_differences(vllm, penstock, values=case.values)
    _seen[case.name] = differences
    unexpected = unlisted(case.name, differences)
    assert not unexpected, "\n".join(str(difference) for difference in unexpected)


def test_every_listed_difference_still_occurs() -> None:
    if len(_seen) < len(CASES):
        pytest.skip("only part of the corpus ran")
    stale = [
        entry
        for entry in INTENTIONAL_DIFFERENCES
        if not any(
            entry.covers(case, difference)
            for case, differences in _seen.items()
            for difference in differences
        )
    ]
    assert not stale, "\n".join(f"{entry.case} {entry.kind} {entry.path}" for entry in stale)

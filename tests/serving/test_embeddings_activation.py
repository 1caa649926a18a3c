"""Class probabilities from a pooling engine's logits."""

from __future__ import annotations

import math

from penstock.serving.embeddings import activated


def test_one_class_is_a_sigmoid_that_never_overflows() -> None:
    assert activated([0.0]) == [0.5]
    assert math.isclose(activated([2.0])[0], 1 / (1 + math.exp(-2.0)))
    assert activated([-1000.0])[0] == 0.0
    assert activated([1000.0])[0] == 1.0


def test_several_classes_are_a_softmax() -> None:
    probs = activated([1.0, 2.0, 3.0])
    assert math.isclose(sum(probs), 1.0)
    assert probs == sorted(probs)
    assert math.isclose(probs[2] / probs[1], math.e)
    assert math.isclose(sum(activated([1000.0, 1000.0])), 1.0)

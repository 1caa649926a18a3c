"""How the pooling engine picks its pooling, cuts a request into passes, and what it
advertises to the gateway."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from penstock.engines.context import Context
from penstock.engines.pooling import PoolingCapabilities, pooling_capabilities
from penstock.engines.transformers.pooling import _Waiting, next_pass, pool
from penstock.engines.transformers.pooling_config import choose_pooling
from penstock.engines.transformers.weights.checkpoint import CheckpointError

ENCODER = SimpleNamespace(architectures=["BertModel"])
DECODER = SimpleNamespace(architectures=["LlamaForCausalLM"])


def _sentence_transformers(folder: Path, modules: list[str], **modes: bool) -> Path:
    entries = [
        {"path": "1_Pooling" if kind.endswith("Pooling") else "", "type": kind} for kind in modules
    ]
    (folder / "modules.json").write_text(json.dumps(entries))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    return folder


def test_without_a_sentence_transformers_config_vllm_defaults_apply(tmp_path: Path) -> None:
    assert choose_pooling(tmp_path, DECODER, "auto") == "last"
    assert choose_pooling(tmp_path, ENCODER, "auto") == "cls"
    assert choose_pooling(tmp_path, ENCODER, "mean") == "mean"


@pytest.mark.parametrize(
    ("mode", "pooling"),
    [
        ("pooling_mode_mean_tokens", "mean"),
        ("pooling_mode_lasttoken", "last"),
        ("pooling_mode_cls_token", "cls"),
    ],
)
def test_the_sentence_transformers_pooling_is_used(tmp_path: Path, mode: str, pooling: str) -> None:
    modules = ["sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling"]
    folder = _sentence_transformers(
        tmp_path, modules, **{mode: True, "pooling_mode_max_tokens": False}
    )
    assert choose_pooling(folder, DECODER, "auto") == pooling


def test_a_configuration_it_cannot_reproduce_is_refused(tmp_path: Path) -> None:
    modules = ["sentence_transformers.models.Pooling", "sentence_transformers.models.Dense"]
    folder = _sentence_transformers(tmp_path, modules, pooling_mode_mean_tokens=True)
    with pytest.raises(CheckpointError, match="Dense"):
        choose_pooling(folder, ENCODER, "auto")


def test_two_pooling_modes_at_once_are_refused(tmp_path: Path) -> None:
    folder = _sentence_transformers(
        tmp_path,
        ["sentence_transformers.models.Pooling"],
        pooling_mode_mean_tokens=True,
        pooling_mode_cls_token=True,
    )
    with pytest.raises(CheckpointError, match="exactly one"):
        choose_pooling(folder, ENCODER, "auto")


async def test_passes_take_requests_in_turn_within_the_token_budget() -> None:
    loop = asyncio.get_running_loop()
    first = _Waiting([[0] * 5, [0] * 1, [0] * 9], loop.create_future(), Context())
    second = _Waiting([[0] * 2, [0] * 2], loop.create_future(), Context())
    passes = []
    while picked := next_pass([first, second], max_tokens=6):
        passes.append([("first" if request is first else "second", i) for request, i in picked])
    # The first request's shortest input opens the pass, the second's fill it; an input
    # longer than the budget runs alone.
    assert passes == [
        [("first", 1), ("second", 0), ("second", 1)],
        [("first", 0)],
        [("first", 2)],
    ]


def test_padding_never_reaches_a_pooled_vector() -> None:
    hidden = torch.tensor([[[1.0], [3.0], [100.0]], [[2.0], [-5.0], [6.0]]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    lengths = mask.sum(dim=1)
    assert pool(hidden, mask, lengths, "mean").flatten().tolist() == [2.0, 1.0]
    assert pool(hidden, mask, lengths, "last").flatten().tolist() == [3.0, 6.0]
    assert pool(hidden, mask, lengths, "max").flatten().tolist() == [3.0, 6.0]
    assert pool(hidden, mask, lengths, "cls").flatten().tolist() == [1.0, 2.0]


def test_capabilities_round_trip_and_bad_ones_are_ignored() -> None:
    advertised = PoolingCapabilities(frozenset({"classify"}), 2, ("bad", "good"))
    assert pooling_capabilities({"pooling": advertised.advertise()}) == advertised
    assert pooling_capabilities({"pooling": {"tasks": ["rerank"], "dimensions": 2}}) is None
    assert pooling_capabilities({"pooling": {"tasks": ["embed"], "dimensions": 0}}) is None
    assert pooling_capabilities(None) is None

"""The vllm engine's tensor pushes on disk (no vLLM needed): what the worker reloads is
the base checkpoint with every push since in place, and a bad push is refused first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from penstock.engines.vllm.pushes import PushedTensors
from penstock.engines.vllm.worker_extension import tensors_with_pushes
from penstock.engines.weights.sync import WeightSyncError


def checkpoint(folder: Path, scale: float) -> str:
    folder.mkdir()
    save_file(
        {"a.weight": torch.full((2, 3), scale), "b.weight": torch.full((4,), scale)},
        str(folder / "model-00001.safetensors"),
    )
    save_file({"c.bias": torch.full((3,), scale)}, str(folder / "model-00002.safetensors"))
    return str(folder)


def reloaded(pushed: PushedTensors, staged: Path) -> dict[str, torch.Tensor]:
    return dict(tensors_with_pushes(pushed.base, str(staged)))


def test_every_tensor_is_reloaded_with_every_push_since_the_base_in_place(
    tmp_path: Path,
) -> None:
    pushed = PushedTensors(checkpoint(tmp_path / "base", 1.0))
    first = pushed.stage({"a.weight": torch.zeros(2, 3)})
    pushed.commit(first)
    second = pushed.stage({"c.bias": torch.full((3,), 5.0)})
    pushed.commit(second)
    weights = reloaded(pushed, second)
    assert sorted(weights) == ["a.weight", "b.weight", "c.bias"]
    assert weights["a.weight"].eq(0).all() and weights["c.bias"].eq(5).all()
    assert weights["b.weight"].eq(1).all()
    assert not first.exists()

    pushed.rebase(checkpoint(tmp_path / "next", 2.0))
    assert not second.exists() and pushed.overlay is None
    third = pushed.stage({"b.weight": torch.zeros(4)})
    weights = reloaded(pushed, third)
    assert weights["a.weight"].eq(2).all() and weights["b.weight"].eq(0).all()
    folder = third.parent
    pushed.close()
    assert not folder.exists()


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        ({"d.weight": torch.zeros(1)}, "d.weight: not a tensor of this model"),
        ({"a.weight": torch.zeros(3, 2)}, "shape [3, 2] != the model's [2, 3]"),
        ({"b.weight": torch.zeros(4, dtype=torch.int64)}, "cannot load into"),
        ({"b.weight": torch.tensor([0.0, float("nan"), 0.0, 0.0])}, "NaN or infinite"),
    ],
)
def test_a_push_the_base_cannot_take_is_refused_before_anything_is_written(
    tmp_path: Path, tensors: dict[str, torch.Tensor], reason: str
) -> None:
    pushed = PushedTensors(checkpoint(tmp_path / "base", 1.0))
    with pytest.raises(WeightSyncError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        pushed.check(tensors)
    assert pushed.overlay is None


def test_a_discarded_push_leaves_the_overlay_before_it(tmp_path: Path) -> None:
    pushed = PushedTensors(checkpoint(tmp_path / "base", 1.0))
    kept = pushed.stage({"a.weight": torch.zeros(2, 3)})
    pushed.commit(kept)
    failed = pushed.stage({"b.weight": torch.zeros(4)})
    pushed.discard(failed)
    assert pushed.overlay == kept and not failed.exists()
    assert sorted(load_file(str(kept))) == ["a.weight"]
    pushed.close()

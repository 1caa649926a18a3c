"""Pickled ``update_weights_from_tensor`` payloads on an engine without CUDA: CUDA tensors
(torch's reductions, SGLang's patched ones, inside SGLang's ``LocalSerializedTensor``) are
refused before their rebuild runs, naming the reason; CPU tensors inside a
``LocalSerializedTensor`` load."""

from __future__ import annotations

import base64
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from penstock.engines.weights.sync import UntrustedPayloadError, WeightSyncError
from penstock.engines.weights.tensor_payloads import decode_payload
from penstock.rl.trainer import cuda_ipc_entry
from tests.support.cuda_payloads import (
    CudaTensorReference,
    local_serialized,
    sglang_uuid_cuda_tensor,
    verl_cuda_payload,
)

CPU = torch.device("cpu")


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def shared(tensor: torch.Tensor) -> bytes:
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        return bytes(ForkingPickler.dumps(tensor))
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


@pytest.mark.parametrize(
    "payload",
    [
        b64(pickle.dumps([("lm_head.weight", CudaTensorReference())])),
        b64(pickle.dumps({"lm_head.weight": CudaTensorReference()})),
        verl_cuda_payload(),
        b64(local_serialized([sglang_uuid_cuda_tensor()])),
    ],
    ids=["pairs", "dict", "verl-local-serialized", "sglang-uuid-rebuild"],
)
def test_cuda_tensors_are_refused_on_the_cpu_with_the_reason(payload: str) -> None:
    with pytest.raises(WeightSyncError) as refused:
        decode_payload(payload, trusted=True, device=CPU)
    message = str(refused.value)
    assert "IPC handle" in message
    assert "this engine runs on cpu" in message


def test_an_untrusted_cuda_payload_is_refused_for_being_pickled() -> None:
    with pytest.raises(UntrustedPayloadError, match="--trust-weight-payloads"):
        decode_payload(verl_cuda_payload(), trusted=False, device=CPU)


def test_a_local_serialized_cpu_tensor_loads() -> None:
    head = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for value in (shared(head), b64(shared(head))):
        tensors = decode_payload(b64(local_serialized([value])), trusted=True, device=CPU)
        assert list(tensors) == ["lm_head.weight"]
        assert torch.equal(tensors["lm_head.weight"], head)


def test_a_local_serialized_tensor_for_two_ranks_is_refused() -> None:
    head = shared(torch.zeros(2))
    with pytest.raises(WeightSyncError, match="holds 2 ranks' tensors; this engine has one"):
        decode_payload(b64(local_serialized([head, head])), trusted=True, device=CPU)


def test_a_rank_value_that_is_not_a_pickled_tensor_is_refused() -> None:
    with pytest.raises(WeightSyncError, match="not a pickled tensor"):
        decode_payload(b64(local_serialized([b"plain bytes"])), trusted=True, device=CPU)


def test_the_trainer_sends_only_cuda_tensors_by_ipc() -> None:
    with pytest.raises(ValueError, match="are not on a GPU: use push_tensors"):
        cuda_ipc_entry({"lm_head.weight": torch.zeros(2)})

"""vLLM's packed broadcast cut as its trainer cuts it (``pack_tensors``: a tensor joins the
buffer, then the buffer is sent once its byte total exceeds the size)."""

from __future__ import annotations

from penstock.engines.weights.sync import TensorSpec, packed_buffers


def spec(name: str, dtype: str, count: int) -> TensorSpec:
    return TensorSpec(name, dtype, (count,))


def names(buffers: list[list[TensorSpec]]) -> list[list[str]]:
    return [[s.name for s in buffer] for buffer in buffers]


def test_a_buffer_ends_with_the_tensor_that_crossed_the_size() -> None:
    specs = [spec("a", "float32", 1), spec("b", "bfloat16", 2), spec("c", "float16", 2)]
    # 4 + 4 bytes reach 8 without exceeding it; the third crosses.
    assert names(packed_buffers(specs, 8)) == [["a", "b", "c"]]
    assert names(packed_buffers(specs, 7)) == [["a", "b"], ["c"]]
    assert names(packed_buffers(specs, 1)) == [["a"], ["b"], ["c"]]


def test_a_tensor_larger_than_a_buffer_travels_alone() -> None:
    specs = [spec("small", "float32", 1), spec("big", "float32", 100), spec("last", "int8", 3)]
    assert names(packed_buffers(specs, 16)) == [["small", "big"], ["last"]]

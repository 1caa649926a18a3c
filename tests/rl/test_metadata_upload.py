"""MetadataUploader: per-choice msgpack+zstd files on any fsspec filesystem."""

from __future__ import annotations

from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from penstock.metadata_upload import MetadataUploader, decode_metadata


async def test_uploads_one_compressed_file_per_choice_to_a_local_folder(tmp_path: Path) -> None:
    uploader = MetadataUploader(f"  file://{tmp_path}/run-1  ")
    assert uploader.url == f"file://{tmp_path}/run-1"
    await uploader.upload_choice(
        0,
        {
            "logprobs": torch.tensor([[0.5, -1.0]], dtype=torch.float32),
            "mask": np.array([1, 0, 1], dtype=np.int8),
            "nested": {"steps": (1, 2), "note": "ok"},
        },
    )
    await uploader.upload_choice(1, {})
    assert sorted(p.name for p in (tmp_path / "run-1").iterdir()) == ["choice_0.msgpack.zst"]
    decoded = decode_metadata((tmp_path / "run-1" / "choice_0.msgpack.zst").read_bytes())
    assert decoded["schema_version"] == 1
    tensor = decoded["metadata"]["logprobs"]
    assert tensor["type"] == "tensor" and tensor["dtype"] == "float32" and tensor["shape"] == [1, 2]
    assert np.frombuffer(tensor["data"], dtype=np.float32).tolist() == [0.5, -1.0]
    array = decoded["metadata"]["mask"]
    assert array == {"type": "ndarray", "dtype": "int8", "shape": [3], "data": b"\x01\x00\x01"}
    assert decoded["metadata"]["nested"] == {"steps": [1, 2], "note": "ok"}


async def test_bfloat16_tensors_keep_their_bytes() -> None:
    uploader = MetadataUploader("memory://metadata/bf16")
    await uploader.upload_choice(3, {"x": torch.ones(2, dtype=torch.bfloat16)})
    blob = fsspec.filesystem("memory").cat("/metadata/bf16/choice_3.msgpack.zst")
    tensor = decode_metadata(blob)["metadata"]["x"]
    assert tensor["dtype"] == "bfloat16" and tensor["data"] == b"\x80\x3f\x80\x3f"


@pytest.mark.parametrize(
    ("value", "message"),
    [(5, "metadata_upload.url must be a string"), ("  ", "metadata_upload.url must not be empty")],
)
def test_url_is_checked(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MetadataUploader(value)  # type: ignore[arg-type]


def test_from_settings() -> None:
    assert MetadataUploader.from_settings(None) is None
    assert MetadataUploader.from_settings({"url": "memory://a"}) == MetadataUploader("memory://a")
    with pytest.raises(ValueError, match=r"^metadata_upload.a is not supported$"):
        MetadataUploader.from_settings({"url": "x", "z": 1, "a": 2})
    with pytest.raises(ValueError, match=r"^metadata_upload.url is required$"):
        MetadataUploader.from_settings({})


def test_from_backend_request_looks_in_nvext_then_extra_args() -> None:
    assert MetadataUploader.from_backend_request({}) is None
    direct = {"nvext": {"metadata_upload": {"url": "memory://a"}}}
    assert MetadataUploader.from_backend_request(direct) == MetadataUploader("memory://a")
    nested = {
        "nvext": "not an object",
        "extra_args": {"nvext": {"metadata_upload": {"url": "memory://b"}}},
    }
    assert MetadataUploader.from_backend_request(nested) == MetadataUploader("memory://b")
    skipped = {"nvext": {"metadata_upload": None}}
    assert MetadataUploader.from_backend_request(skipped) is None
    with pytest.raises(ValueError, match=r"^metadata_upload must be an object$"):
        MetadataUploader.from_backend_request({"nvext": {"metadata_upload": "memory://c"}})

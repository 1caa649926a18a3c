"""No S3 filesystem (and so no credential lookup) until an ``s3://`` adapter is actually
used; then s3fs fetches it from a loopback endpoint with dummy credentials."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from penstock.lora import LoRAManager
from tests.support.fake_s3 import aws_environment, fake_s3_endpoint

pytest.importorskip("s3fs", reason="the s3 extra (s3fs) is not installed")

ADAPTER_FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"weights"}
BUCKET = "bucket"
PREFIX = "loras/math/"


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    objects = {PREFIX + name: data for name, data in ADAPTER_FILES.items()}
    with fake_s3_endpoint(BUCKET, objects) as (url, _):
        for name, value in aws_environment(url, tmp_path).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        yield url


async def test_the_s3_filesystem_is_built_only_when_an_s3_adapter_is_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_endpoint: str
) -> None:
    built: list[str] = []
    real_filesystem = fsspec.filesystem

    def counting_filesystem(protocol: str, **kwargs: Any) -> Any:
        built.append(protocol)
        return real_filesystem(protocol, **kwargs)

    monkeypatch.setattr(fsspec, "filesystem", counting_filesystem)

    manager = LoRAManager(tmp_path / "cache")
    local = tmp_path / "local adapter"
    local.mkdir()
    for name, data in ADAPTER_FILES.items():
        (local / name).write_bytes(data)
    assert (await manager.download_lora(local.as_uri()))["local_path"] == str(local)
    assert (await manager.download_lora("hf://org/not-cached"))["status"] == "error"
    assert built == []

    result = await manager.download_lora(f"s3://{BUCKET}/{PREFIX}")
    assert result["status"] == "success", result
    fetched = tmp_path / "cache" / "s3__bucket_loras_math_"
    assert result["local_path"] == str(fetched)
    assert {p.name: p.read_bytes() for p in fetched.iterdir()} == ADAPTER_FILES
    assert built == ["s3"]


async def test_a_missing_s3_prefix_is_not_found(tmp_path: Path, s3_endpoint: str) -> None:
    result = await LoRAManager(tmp_path / "cache").download_lora(f"s3://{BUCKET}/loras/other")
    assert result == {"status": "error", "message": f"LoRA not found at s3://{BUCKET}/loras/other"}


async def test_without_s3fs_an_s3_adapter_fails_naming_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A None entry makes ``import s3fs`` fail as it does where s3fs is not installed, and
    # fsspec forgets the class an earlier test may have imported.
    monkeypatch.setitem(sys.modules, "s3fs", None)
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
    result = await LoRAManager(tmp_path).download_lora(f"s3://{BUCKET}/{PREFIX}")
    assert result["status"] == "error"
    assert "pip install 'penstock[s3]'" in result["message"]

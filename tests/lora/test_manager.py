"""LoRAManager: file://, hf:// (local cache only), s3:// (s3fs, against a loopback
endpoint), custom sources."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import fsspec
import pytest

from penstock.lora import (
    LoRAInfo,
    LoRAManager,
    OnceLock,
    S3Source,
    default_cache_root,
    uri_to_cache_key,
)
from tests.support.fake_s3 import fake_s3_endpoint

ADAPTER_FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"weights"}


def write_files(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def write_adapter(folder: Path) -> Path:
    return write_files(folder, ADAPTER_FILES)


def test_cache_key_and_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert uri_to_cache_key("s3://bucket/path/to/lora") == "s3__bucket_path_to_lora"
    assert uri_to_cache_key("hf://org/a.b") == "hf__org_a_b"
    monkeypatch.setenv("DYN_LORA_PATH", str(tmp_path / "dyn"))
    monkeypatch.delenv("PENSTOCK_LORA_CACHE", raising=False)
    assert default_cache_root() == tmp_path / "dyn"
    monkeypatch.setenv("PENSTOCK_LORA_CACHE", str(tmp_path / "own"))
    assert LoRAManager().cache_root == tmp_path / "own"
    assert LoRAManager(tmp_path / "arg").cache_root == tmp_path / "arg"


async def test_file_uri_uses_the_folder_in_place(tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "adapter")
    manager = LoRAManager(tmp_path / "cache")
    assert await manager.download_lora(adapter.as_uri()) == {
        "status": "success",
        "local_path": str(adapter),
    }


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("no-scheme", "must look like scheme://location"),
        ("ftp://host/x", "unsupported LoRA URI scheme 'ftp' (supported: file, hf, s3)"),
        ("file:///does/not/exist", "LoRA not found at file:///does/not/exist"),
    ],
)
async def test_bad_uris_are_error_dicts(tmp_path: Path, uri: str, message: str) -> None:
    result = await LoRAManager(tmp_path).download_lora(uri)
    assert result["status"] == "error" and message in result["message"]


async def test_a_folder_without_adapter_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = await LoRAManager(tmp_path / "cache").download_lora((tmp_path / "empty").as_uri())
    assert result["status"] == "error" and "adapter_config.json" in result["message"]


async def test_hf_uri_reads_the_local_hub_cache_and_never_downloads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hub = tmp_path / "hub"
    repo = hub / "models--org--math-lora"
    commit = "0123456789abcdef0123456789abcdef01234567"
    write_adapter(repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    manager = LoRAManager(tmp_path / "cache")
    found = await manager.download_lora("hf://org/math-lora")
    assert found == {"status": "success", "local_path": str(repo / "snapshots" / commit)}
    missing = await manager.download_lora("hf://org/not-cached")
    assert missing == {"status": "error", "message": "LoRA not found at hf://org/not-cached"}


async def test_s3_uri_downloads_every_object_under_the_prefix(tmp_path: Path) -> None:
    pytest.importorskip("s3fs", reason="the s3 extra (s3fs) is not installed")
    objects = {f"loras/math/{name}": data for name, data in ADAPTER_FILES.items()}
    objects["loras/mathematics/adapter_config.json"] = b"another adapter"
    with fake_s3_endpoint("bucket", objects) as (url, handler):
        filesystem = fsspec.filesystem(
            "s3",
            endpoint_url=url,
            key="dummy",
            secret="dummy",
            client_kwargs={"region_name": "us-east-1"},
            skip_instance_cache=True,
        )
        manager = LoRAManager(tmp_path / "cache")
        manager.register_custom_source("s3", S3Source(filesystem))
        result = await manager.download_lora("s3://bucket/loras/math")
        local = tmp_path / "cache" / "s3__bucket_loras_math"
        assert result == {"status": "success", "local_path": str(local)}
        assert {p.name: p.read_bytes() for p in local.iterdir()} == ADAPTER_FILES
        assert manager.is_cached("s3://bucket/loras/math")
        # Cached now: no S3 call is made.
        calls = len(handler.requests)
        assert (await manager.download_lora("s3://bucket/loras/math"))["status"] == "success"
        assert len(handler.requests) == calls


class DictSource:
    def __init__(self, adapters: dict[str, dict[str, bytes]]) -> None:
        self.adapters = adapters

    async def exists(self, lora_uri: str) -> bool:
        return lora_uri in self.adapters

    async def download(self, lora_uri: str, dest_path: Path) -> Path:
        return await asyncio.to_thread(write_files, dest_path, self.adapters[lora_uri])


async def test_custom_sources(tmp_path: Path) -> None:
    manager = LoRAManager(tmp_path)
    manager.register_custom_source("mem://", DictSource({"mem://a": ADAPTER_FILES}))
    assert manager.schemes == ["file", "hf", "mem", "s3"]
    assert (await manager.download_lora("mem://a"))["local_path"] == str(tmp_path / "mem__a")
    assert await manager.download_lora("mem://b") == {
        "status": "error",
        "message": "LoRA not found at mem://b",
    }
    with pytest.raises(TypeError):
        manager.register_custom_source("bad", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        manager.register_custom_source("", DictSource({}))


def test_lora_info_is_frozen() -> None:
    info = LoRAInfo(id=1, path="/a")
    with pytest.raises(AttributeError):
        info.id = 2  # type: ignore[misc]
    assert json.dumps(info.__dict__) == '{"id": 1, "path": "/a"}'


def test_once_lock_initialises_once_and_retries_after_a_failure() -> None:
    lock: OnceLock[int] = OnceLock()
    assert lock.get() is None
    calls: list[int] = []

    def failing() -> int:
        calls.append(0)
        raise RuntimeError("not yet")

    with pytest.raises(RuntimeError):
        lock.get_or_init(failing)
    assert lock.get() is None

    def build() -> int:
        calls.append(1)
        return 42

    threads = [threading.Thread(target=lock.get_or_init, args=(build,)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert lock.get() == 42 and calls == [0, 1]

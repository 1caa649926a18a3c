"""No AWS client (and so no credential lookup) until an ``s3://`` adapter is actually used."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

import boto3
import pytest

from penstock.lora import LoRAManager
from tests.support.file_server import serving

ADAPTER_FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"weights"}
BUCKET = "bucket"
PREFIX = "loras/math/"


class FakeS3(BaseHTTPRequestHandler):
    """Path-style ListObjectsV2 and GetObject over one bucket holding one adapter."""

    objects = {PREFIX + name: data for name, data in ADAPTER_FILES.items()}

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        bucket, _, key = url.path.lstrip("/").partition("/")
        if bucket != BUCKET:
            return self._send(404, b"")
        if not key:
            prefix = parse_qs(url.query).get("prefix", [""])[0]
            keys = [k for k in self.objects if k.startswith(prefix)]
            contents = "".join(
                f"<Contents><Key>{escape(k)}</Key><Size>{len(self.objects[k])}</Size></Contents>"
                for k in keys
            )
            listing = (
                '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>'
                f"<Name>{BUCKET}</Name><Prefix>{escape(prefix)}</Prefix>"
                f"<KeyCount>{len(keys)}</KeyCount><IsTruncated>false</IsTruncated>"
                f"{contents}</ListBucketResult>"
            )
            return self._send(200, listing.encode(), "application/xml")
        if key not in self.objects:
            return self._send(404, b"")
        return self._send(200, self.objects[key], "application/octet-stream")

    def _send(self, status: int, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return


@pytest.fixture
def s3_endpoint() -> Iterator[str]:
    with serving(FakeS3) as url:
        yield url


async def test_the_s3_client_is_built_only_when_an_s3_adapter_is_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_endpoint: str
) -> None:
    # Explicit dummy credentials and no config files or instance metadata to fall back on.
    for name, value in {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": "dummy",
        "AWS_SECRET_ACCESS_KEY": "dummy",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
        "HF_HUB_CACHE": str(tmp_path / "hub"),
    }.items():
        monkeypatch.setenv(name, value)
    built: list[tuple[Any, ...]] = []
    real_client = boto3.client

    def counting_client(*args: Any, **kwargs: Any) -> Any:
        built.append(args)
        return real_client(*args, **kwargs)

    monkeypatch.setattr(boto3, "client", counting_client)

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
    assert built == [("s3",)]


async def test_without_boto3_an_s3_adapter_fails_naming_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A None entry makes ``import boto3`` fail as it does where boto3 is not installed.
    monkeypatch.setitem(sys.modules, "boto3", None)
    result = await LoRAManager(tmp_path).download_lora(f"s3://{BUCKET}/{PREFIX}")
    assert result["status"] == "error"
    assert "pip install 'penstock[s3]'" in result["message"]

"""Rollout records go under the operator's ``--metadata-upload-url``; a request names only a
checked key under it, and a failed upload tells the client nothing about the server's disk."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from penstock.metadata_upload import MAX_KEY_LENGTH, decode_metadata
from tests.support.server import REPO_ROOT, ServerProcess, running_server

MODEL = "sample-model"
HELLO = [{"role": "user", "content": "hi"}]
MARKER_ENV = "CREDENTIAL_LOOKUP_MARKER"
# Stands in for boto3 and botocore: importing either (the first step of any AWS credential
# lookup, s3fs included) leaves a marker and fails.
LOUD_IMPORT = f"""import os, pathlib
pathlib.Path(os.environ[{MARKER_ENV!r}]).write_text(__name__)
raise ImportError(__name__ + " imported with no s3 location configured")
"""


@dataclass
class Served:
    server: ServerProcess
    http: httpx.Client
    base: Path
    root: Path
    marker: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("metadata-upload")
    # A space: the file URL carries it as '%20', and the folder must be the decoded name.
    root = base / "roll outs"
    shadow = base / "shadow"
    for name in ("boto3", "botocore"):
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text(LOUD_IMPORT)
    marker = base / "credential-lookup"
    env = {"PYTHONPATH": f"{shadow}:{REPO_ROOT}", MARKER_ENV: str(marker)}
    args = ["--engine", "sample", "--metadata-upload-url", root.as_uri(), "--", "--delay", "0"]
    with (
        running_server(args, base, env=env) as server,
        httpx.Client(base_url=server.base_url, timeout=30) as http,
    ):
        yield Served(server, http, base, root, marker)


def chat(http: httpx.Client, key: str, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3, "return_token_ids": True}
    nvext = {"metadata_upload": {"url": key}}
    return http.post("/v1/chat/completions", json={**body, **fields, "nvext": nvext})


def engine_requests(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "penstock_frontend_requests_total"
    )


def test_records_land_under_the_root_at_the_requested_key(served: Served) -> None:
    response = chat(served.http, "rollout-7/step_1", n=2)
    assert response.status_code == 200, response.text
    payload = response.json()
    folder = served.root / "rollout-7" / "step_1"
    for choice in payload["choices"]:
        blob = (folder / f"choice_{choice['index']}.msgpack.zst").read_bytes()
        record = decode_metadata(blob)["metadata"]
        assert record["token_ids"] == choice["token_ids"]
        assert record["prompt_token_ids"] == payload["prompt_token_ids"]
        assert record["finish_reason"] == "length"
    stream = served.http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": [1, 2, 3],
            "max_tokens": 2,
            "stream": True,
            "nvext": {"metadata_upload": {"url": "completions"}},
        },
    )
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    assert (served.root / "completions" / "choice_0.msgpack.zst").is_file()
    assert not served.marker.exists(), "an AWS client library was imported"


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("../x", "'.' or '..' parts"),
        ("/abs", "not an absolute path"),
        ("http://evil", "not a URL"),
        ("k" * (MAX_KEY_LENGTH + 1), f"at most {MAX_KEY_LENGTH} characters"),
        ("a/./b", "'.' or '..' parts"),
        ("a%2F..%2Fb", "'/'-separated parts"),
    ],
)
def test_unsafe_keys_get_400_before_the_engine_runs(served: Served, key: str, reason: str) -> None:
    before = engine_requests(served.http)
    for stream in (False, True):
        response = chat(served.http, key, stream=stream)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "nvext.metadata_upload.url"
        assert error["code"] == "invalid_upload_key"
        assert reason in error["message"]
    assert engine_requests(served.http) == before
    assert sorted(p.name for p in served.base.iterdir()) == sorted(
        [served.root.name, "shadow", *(p.name for p in served.base.glob("penstock-*.log"))]
    )


def test_malformed_upload_objects_name_the_field(served: Served) -> None:
    cases = [
        ({"path": "/x"}, "metadata_upload.path is not supported"),
        ("rollout", "metadata_upload must be an object"),
        ({"url": 7}, "metadata_upload.url must be a string"),
    ]
    for value, message in cases:
        body = {"model": MODEL, "messages": HELLO, "nvext": {"metadata_upload": value}}
        response = served.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == message
        assert response.json()["error"]["param"] == "nvext.metadata_upload"


def test_a_root_that_cant_be_written_fails_without_telling_where(served: Served) -> None:
    aside = served.root.rename(served.base / "aside")
    served.root.write_text("a file where the folder was")
    try:
        unary = chat(served.http, "blocked")
        stream = chat(served.http, "blocked", stream=True)
        plain = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
        assert served.http.post("/v1/chat/completions", json=plain).status_code == 200
    finally:
        served.root.unlink()
        aside.rename(served.root)
    assert unary.status_code == 500
    errors = [unary.json()["error"]]
    frames = [line[len("data: ") :] for line in stream.text.splitlines() if line.strip()]
    assert stream.status_code == 200 and frames[-1] == "[DONE]"
    errors.append(json.loads(frames[-2])["error"])
    for error in errors:
        assert error["code"] == "metadata_upload_failed"
        assert error["message"] == (
            "the request's metadata upload failed; the server log has the details"
        )
    for text in (unary.text, stream.text):
        assert str(served.base) not in text and "Errno" not in text
    assert f"{served.root}/blocked failed" in served.server.log()

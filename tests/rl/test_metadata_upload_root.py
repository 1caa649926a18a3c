"""The operator's upload root and the relative keys a request may name under it."""

from __future__ import annotations

import os
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import fsspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from penstock.destinations import local_path
from penstock.metadata_upload import (
    MAX_KEY_LENGTH,
    decode_metadata,
    get_fs,
    under_root,
    upload_key,
)
from penstock.settings import Settings
from tests.support.file_server import serving

ROOT = "/srv/rollouts"


@pytest.mark.parametrize("key", ["run-7", "run_7/step.3", "a/b/c", "_x", "0", "A" * MAX_KEY_LENGTH])
def test_plain_relative_keys_are_accepted(key: str) -> None:
    assert upload_key(key) == key
    assert under_root(ROOT + "/", key).url == f"{ROOT}/{key}"


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("../x", "'.' or '..' parts"),
        ("a/../../x", "'.' or '..' parts"),
        ("./x", "'.' or '..' parts"),
        ("/abs", "not an absolute path"),
        ("http://evil", "not a URL"),
        ("file:///etc", "not a URL"),
        ("c:x", "not a URL"),
        ("A" * (MAX_KEY_LENGTH + 1), f"at most {MAX_KEY_LENGTH} characters"),
        ("", "'/'-separated parts"),
        ("a//b", "'/'-separated parts"),
        ("a/", "'/'-separated parts"),
        (".hidden", "'/'-separated parts"),
        ("-rf", "'/'-separated parts"),
        ("a%2F..", "'/'-separated parts"),
        ("a\\..\\b", "'/'-separated parts"),
        ("a b", "'/'-separated parts"),
        ("run\n", "'/'-separated parts"),
        ("caf\u00e9", "'/'-separated parts"),
    ],
)
def test_unsafe_keys_are_refused_with_the_reason(key: str, reason: str) -> None:
    with pytest.raises(ValueError, match=r"^metadata_upload\.url ") as raised:
        upload_key(key)
    assert reason in str(raised.value)


# '/'-joined parts, mostly valid and sometimes '.', '..', empty or escaped (so that about
# half the keys are accepted), plus text over the characters that matter, plus any text.
PARTS = st.sampled_from(["a", "_1", "a.b", "x-", "b..", "9"] * 3 + ["..", ".", "", "%2e", "~"])
KEYS = (
    st.lists(PARTS, min_size=1, max_size=4).map("/".join)
    | st.text(alphabet="ab_-./\\:%~ \x00", max_size=24)
    | st.text(max_size=24)
)


@given(KEYS)
def test_every_accepted_key_resolves_strictly_inside_the_root(key: str) -> None:
    try:
        uploader = under_root(ROOT, key)
    except ValueError:
        return
    target = get_fs(uploader.url).path
    assert os.path.commonpath([ROOT, os.path.normpath(target)]) == ROOT
    assert os.path.normpath(target) != ROOT
    written = os.path.normpath(get_fs(uploader.url)._join("choice_0.msgpack.zst"))
    assert written.startswith(ROOT + "/")


def test_remote_roots_get_the_key_appended() -> None:
    assert under_root("https://store.internal/up", "run-1").url == "https://store.internal/up/run-1"
    assert under_root("s3://bucket/prefix", "a/b").url == "s3://bucket/prefix/a/b"


class PutRecorder(BaseHTTPRequestHandler):
    received: dict[str, bytes] = {}

    def do_PUT(self) -> None:
        self.received[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        return


async def test_an_http_root_receives_each_record_as_a_put() -> None:
    with serving(PutRecorder) as url:
        await under_root(f"{url}/up", "run-1/step_2").upload_choice(0, {"token_ids": [1, 2]})
    blob = PutRecorder.received["/up/run-1/step_2/choice_0.msgpack.zst"]
    assert decode_metadata(blob)["metadata"] == {"token_ids": [1, 2]}


def test_file_urls_are_percent_decoded(tmp_path: Path) -> None:
    folder = tmp_path / "with space%"
    url = folder.as_uri()
    assert "%20" in url
    assert local_path(url) == str(folder)
    assert local_path(f"file://localhost{folder}") == str(folder)
    assert get_fs(url).path == str(folder)
    with pytest.raises(ValueError, match="not host 'elsewhere'"):
        local_path("file://elsewhere/x")


def test_the_root_setting_is_checked_at_startup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    folder = tmp_path / "roll outs"
    assert Settings(metadata_upload_url=folder.as_uri()).metadata_upload_url == str(folder)
    monkeypatch.chdir(tmp_path)
    assert Settings(metadata_upload_url="rel").metadata_upload_url == str(tmp_path / "rel")
    monkeypatch.setenv("PENSTOCK_METADATA_UPLOAD_URL", "https://store.internal/up")
    assert Settings().metadata_upload_url == "https://store.internal/up"
    monkeypatch.setenv("PENSTOCK_METADATA_UPLOAD_URL", "")
    assert Settings().metadata_upload_url is None
    for bad, reason in [
        ("ftp://host/x", "unsupported metadata upload scheme 'ftp'"),
        ("s3:///prefix", "names no host or bucket"),
        ("file://elsewhere/x", "not host 'elsewhere'"),
    ]:
        with pytest.raises(ValidationError, match=reason):
            Settings(metadata_upload_url=bad)


def test_a_remote_root_needs_its_client_library_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    def without_s3fs(protocol: str) -> type:
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "get_filesystem_class", without_s3fs)
    with pytest.raises(ValidationError, match="s3:// metadata uploads need a package: Install"):
        Settings(metadata_upload_url="s3://bucket/prefix")
    monkeypatch.setattr(fsspec, "get_filesystem_class", lambda protocol: object)
    assert Settings(metadata_upload_url="s3://bucket/p/").metadata_upload_url == "s3://bucket/p"

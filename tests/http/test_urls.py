"""The SSRF policy, address class by address class (no network: DNS is faked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from penstock.errors import UrlValidationError
from penstock.http import (
    UrlValidationPolicy,
    describe_media_source,
    is_blocked_ip,
    validate_local_path,
    validate_media_url,
    validate_url,
)
from penstock.http.urls import check_url, legacy_ipv4
from penstock.settings import Settings

HTTP_OK = UrlValidationPolicy(allow_http=True)

BLOCKED = {
    "loopback": "http://127.0.0.1/",
    "loopback elsewhere in 127/8": "http://127.9.9.9/",
    "unspecified": "http://0.0.0.0/",
    "private 10/8": "http://10.0.0.1/",
    "private 172.16/12": "http://172.16.5.4/",
    "private 192.168/16": "http://192.168.1.1/",
    "carrier-grade NAT": "http://100.64.0.1/",
    "link-local": "http://169.254.1.1/",
    "cloud metadata": "http://169.254.169.254/latest/meta-data/",
    "multicast": "http://224.0.0.1/",
    "reserved": "http://240.0.0.1/",
    "broadcast": "http://255.255.255.255/",
    "documentation": "http://192.0.2.1/",
    "v6 loopback": "http://[::1]/",
    "v6 unspecified": "http://[::]/",
    "v6 link-local": "http://[fe80::1]/",
    "v6 link-local with zone": "http://[fe80::1%25eth0]/",
    "v6 unique-local": "http://[fd00::1]/",
    "v6 multicast": "http://[ff02::1]/",
    "IPv4-mapped loopback": "http://[::ffff:127.0.0.1]/",
    "IPv4-mapped metadata, hex form": "http://[::ffff:a9fe:a9fe]/",
    "IPv4-mapped public address": "http://[::ffff:93.184.216.34]/",
    "IPv4-compatible loopback": "http://[::127.0.0.1]/",
    "IPv4-translated loopback": "http://[::ffff:0:127.0.0.1]/",
    "NAT64 well-known prefix": "http://[64:ff9b::a9fe:a9fe]/",
    "NAT64 local-use prefix": "http://[64:ff9b:1::7f00:1]/",
    "decimal spelling": "http://2130706433/",
    "octal spelling": "http://0177.0.0.1/",
    "hex spelling": "http://0x7f.0.0.1/",
    "hex integer": "http://0x7f000001/",
    "short form": "http://127.1/",
    "decimal metadata": "http://2852039166/",
    "non-canonical public address": "http://0x5db8d822/",
    "localhost": "http://localhost/",
    "localhost, upper case, trailing dot": "http://LOCALHOST./",
    "metadata name": "http://metadata.google.internal/computeMetadata/v1/",
    "kubernetes": "https://kubernetes.default.svc/",
    "name resolving to private": "http://internal.test/",
    "name resolving to mapped metadata": "http://mapped.test/",
    "name with one blocked address of two": "http://mixed.test/",
    "name that doesn't resolve": "http://nowhere.test/",
    "file scheme": "file:///etc/passwd",
    "gopher": "gopher://media.test/",
    "ftp": "ftp://media.test/x.png",
    "javascript": "javascript:alert(1)",
    "no scheme": "media.test/x.png",
    "empty": "",
    "no host": "http:///x.png",
    "bad port": "http://media.test:99999/",
}


@pytest.mark.parametrize("url", BLOCKED.values(), ids=BLOCKED.keys())
async def test_blocked_urls_are_refused(url: str) -> None:
    with pytest.raises(UrlValidationError):
        await validate_url(url, HTTP_OK)


@pytest.mark.parametrize(
    "url", ["https://media.test/cat.png", "http://media.test/cat.png", "https://v6.media.test/a"]
)
async def test_public_hosts_pass(url: str) -> None:
    assert await validate_url(url, HTTP_OK) == url


async def test_a_checked_url_carries_the_addresses_to_connect_to() -> None:
    checked = await check_url("https://media.test:8443/cat.png", HTTP_OK)
    assert (checked.host, checked.port, checked.addresses) == (
        "media.test",
        8443,
        ("93.184.216.34",),
    )


async def test_plain_http_needs_the_operator() -> None:
    with pytest.raises(UrlValidationError, match="--media-allow-http"):
        await validate_url("http://media.test/cat.png", UrlValidationPolicy())


async def test_operators_exempt_ranges_and_restrict_domains() -> None:
    internal = UrlValidationPolicy(allow_http=True, allowed_networks=("10.0.0.0/8",))
    assert await validate_url("http://internal.test/a.png", internal)
    assert await validate_url("http://10.9.9.9/a.png", internal)
    with pytest.raises(UrlValidationError):
        await validate_url("http://192.168.0.1/a.png", internal)
    only = UrlValidationPolicy(allowed_domains=("media.test",))
    assert await validate_url("https://v6.media.test/a.png", only)
    with pytest.raises(UrlValidationError, match="allowed media domains"):
        await validate_url("https://evilmedia.test/a.png", only)
    assert await validate_url("http://127.0.0.1/", UrlValidationPolicy(True, True))


async def test_data_urls_are_size_capped() -> None:
    small = UrlValidationPolicy(max_data_url_bytes=64)
    assert await validate_url("data:image/png;base64,AAAA", small)
    with pytest.raises(UrlValidationError, match="over the limit"):
        await validate_url("data:image/png;base64," + "A" * 64, small)


def test_legacy_ipv4_spellings_decode_like_inet_aton() -> None:
    assert str(legacy_ipv4("2130706433")) == "127.0.0.1"
    assert str(legacy_ipv4("0177.0.0.01")) == "127.0.0.1"
    assert str(legacy_ipv4("0x7f.1")) == "127.0.0.1"
    assert str(legacy_ipv4("10.1")) == "10.0.0.1"
    assert legacy_ipv4("media.test") is None and legacy_ipv4("1.2.3.4.5") is None
    assert legacy_ipv4("08.1.1.1") is None


def test_is_blocked_ip_is_false_for_names() -> None:
    assert is_blocked_ip("169.254.169.254") and is_blocked_ip("[::1]")
    assert not is_blocked_ip("media.test") and not is_blocked_ip("93.184.216.34")


def test_media_sources_are_described_without_payloads() -> None:
    assert describe_media_source("data:image/png;base64," + "A" * 500).startswith(
        "data:image/png (522 chars"
    )
    assert describe_media_source("https://x/" + "a" * 300).endswith("... (310 chars)")
    assert describe_media_source(None) == "<non-string media source>"


async def test_local_files_only_under_allowed_roots(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (root / "a b.png").write_bytes(b"x")
    (tmp_path / "secret.txt").write_text("s")
    (root / "escape.png").symlink_to(tmp_path / "secret.txt")
    policy = UrlValidationPolicy(allowed_local_roots=(str(root),))
    uri = await validate_media_url((root / "a b.png").as_uri(), policy)
    assert uri == (root / "a b.png").as_uri()
    for bad in (
        (tmp_path / "secret.txt").as_uri(),
        f"file://{root}/../secret.txt",
        (root / "escape.png").as_uri(),
        (root / "missing.png").as_uri(),
        str(tmp_path / "secret.txt"),
    ):
        with pytest.raises(UrlValidationError) as refused:
            await validate_media_url(bad, policy)
        assert str(root) not in str(refused.value)
    with pytest.raises(UrlValidationError, match="--allowed-local-media-path"):
        validate_local_path(str(root / "a b.png"), UrlValidationPolicy())


def test_the_policy_comes_from_settings(tmp_path: Path) -> None:
    settings = Settings(
        media_allow_http=True,
        allowed_media_domains="media.test, cdn.test",
        allowed_media_networks=["10.0.0.0/8"],
        allowed_local_media_paths=[str(tmp_path)],
        media_max_data_url_mb=1,
    )
    policy = UrlValidationPolicy.from_settings(settings)
    assert policy.allow_http and not policy.allow_private_ips
    assert policy.allowed_domains == ("media.test", "cdn.test")
    assert policy.allowed_networks == ("10.0.0.0/8",)
    assert policy.local_roots == (str(tmp_path),)
    assert policy.max_data_url_bytes == 1024 * 1024
    with pytest.raises(ValueError, match="not a CIDR range"):
        Settings(allowed_media_networks=["10.0.0.0/33"])


def test_the_seed_environment_fills_what_the_settings_leave_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYN_MM_ALLOW_INTERNAL", "1")
    monkeypatch.setenv("DYN_MM_LOCAL_PATH", f" {tmp_path} ")
    monkeypatch.setenv("DYN_MM_MAX_DATA_URL_MB", "2")
    seeded = UrlValidationPolicy.from_env()
    assert seeded.allow_http and seeded.allow_private_ips
    assert seeded.local_roots == (str(tmp_path),)
    assert seeded.max_data_url_bytes == 2 * 1024 * 1024
    monkeypatch.setenv("PENSTOCK_MEDIA_ALLOW_HTTP", "false")
    monkeypatch.setenv("PENSTOCK_ALLOWED_MEDIA_NETWORKS", "10.0.0.0/8")
    monkeypatch.setenv("PENSTOCK_MEDIA_MAX_DATA_URL_MB", "1")
    ours = UrlValidationPolicy.from_env()
    assert not ours.allow_http and not ours.allow_private_ips
    assert ours.max_data_url_bytes == 1024 * 1024


def test_an_unusable_seed_value_falls_back_to_the_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DYN_MM_MAX_DATA_URL_MB", "-3")
    monkeypatch.setenv("DYN_MM_ALLOW_INTERNAL", "yes")
    policy = UrlValidationPolicy.from_env()
    assert policy.max_data_url_bytes == 16 * 1024 * 1024 and not policy.allow_http
    assert "DYN_MM_MAX_DATA_URL_MB" in caplog.text


async def test_the_seed_http_variables_configure_the_client(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from penstock.http import HttpConfigBase, create_http_client
    from penstock.http.aiohttp_client import AiohttpClient

    monkeypatch.setenv("DYN_HTTP_MAX_CONNECTIONS", "7")
    monkeypatch.setenv("DYN_MM_HTTP_READ_TIMEOUT", "12.5")
    monkeypatch.setenv("DYN_HTTP_CONNECT_TIMEOUT", "2")
    monkeypatch.setenv("DYN_HTTP_KEEPALIVE_TIMEOUT", "0")
    monkeypatch.setenv("DYN_HTTP_BACKEND", "aiohttp")
    config = HttpConfigBase.from_settings(Settings())
    assert (config.max_connections, config.timeout, config.connect_timeout) == (7, 12.5, 2.0)
    assert config.keepalive_timeout == 15.0
    assert "DYN_MM_HTTP_READ_TIMEOUT is deprecated" in caplog.text
    assert "DYN_HTTP_KEEPALIVE_TIMEOUT" in caplog.text
    ours = HttpConfigBase.from_settings(Settings(http_max_connections=3))
    assert ours.max_connections == 3
    client = create_http_client(Settings())
    assert isinstance(client, AiohttpClient)
    await client.close()

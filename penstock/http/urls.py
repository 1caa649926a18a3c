"""Which media URLs may be fetched: the SSRF rules, checked before any connection.

:func:`check_url` is the one place a URL is judged. It allows only listed schemes, refuses
blocked host names and non-canonical IP spellings (``2130706433``, ``0177.0.0.1``,
``0x7f.1``: legacy forms that a resolver would quietly turn into an address), resolves the
host once and checks *every* address it resolves to. The addresses it returns are the only
ones the client then connects to (see :mod:`penstock.http.base`), so a name that resolves
elsewhere on a second lookup (DNS rebinding) is never looked up again.

Operators widen the defaults explicitly: ``allowed_networks`` exempts address ranges from
the block (an internal media server), ``allowed_domains`` restricts fetches to listed hosts
and their subdomains, ``allowed_local_roots`` lets ``file://`` read under those folders.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

import penstock.http.env as env
from penstock.errors import UrlValidationError

if TYPE_CHECKING:
    from penstock.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_MAX_DATA_URL_BYTES = 16 * 1024 * 1024

BLOCKED_HOSTNAMES = frozenset(
    {
        "localhost",
        "localhost.localdomain",
        "ip6-localhost",
        "ip6-loopback",
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "kubernetes.default",
        "kubernetes.default.svc",
    }
)

BLOCKED_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(cidr)
    for cidr in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "255.255.255.255/32",
        "::/128",
        "::1/128",
        # IPv4-compatible (deprecated), IPv4-mapped and IPv4-translated addresses, and
        # NAT64 prefixes (well-known and local-use): each can carry an IPv4 address the
        # IPv4 ranges above would block.
        "::/96",
        "::ffff:0:0/96",
        "::ffff:0:0:0/96",
        "64:ff9b::/96",
        "64:ff9b:1::/48",
        "2002::/16",
        "fc00::/7",
        "fe80::/10",
        "ff00::/8",
    )
)

_HTTP_SCHEMES = ("http", "https")
_NUMERIC_HOST = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+))*\.?$", re.IGNORECASE)


@dataclass(frozen=True)
class UrlValidationPolicy:
    """What a fetch may reach. The defaults allow public https hosts only."""

    allow_http: bool = False
    allow_private_ips: bool = False
    allowed_local_path: str | None = None
    allowed_networks: tuple[str, ...] = ()
    allowed_domains: tuple[str, ...] = ()
    allowed_local_roots: tuple[str, ...] = ()
    max_data_url_bytes: int = DEFAULT_MAX_DATA_URL_BYTES
    _networks: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        networks = []
        for cidr in self.allowed_networks:
            try:
                networks.append(ipaddress.ip_network(cidr.strip(), strict=False))
            except ValueError as exc:
                raise ValueError(f"allowed network {cidr!r} is not a CIDR range: {exc}") from exc
        object.__setattr__(self, "_networks", tuple(networks))
        object.__setattr__(
            self,
            "allowed_domains",
            tuple(d.strip().lower().strip(".") for d in self.allowed_domains),
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> UrlValidationPolicy:
        """The policy of the settings; where they leave a rule unset, the seed's variable
        (:mod:`penstock.http.env`): ``DYN_MM_ALLOW_INTERNAL=1`` allows http unless
        ``--media-allow-http`` is given, and any private address unless
        ``--allowed-media-network`` is; ``DYN_MM_LOCAL_PATH`` adds a local folder unless
        ``--allowed-local-media-path`` is given."""
        internal = env.flag("DYN_MM_ALLOW_INTERNAL")
        local_path = (
            None
            if env.given(settings, "allowed_local_media_paths")
            else env.read("DYN_MM_LOCAL_PATH")
        )
        return cls(
            allow_http=settings.media_allow_http
            if env.given(settings, "media_allow_http")
            else internal,
            allow_private_ips=internal and not env.given(settings, "allowed_media_networks"),
            allowed_local_path=local_path,
            allowed_networks=tuple(settings.allowed_media_networks),
            allowed_domains=tuple(settings.allowed_media_domains),
            allowed_local_roots=tuple(settings.allowed_local_media_paths),
            max_data_url_bytes=env.data_url_max_bytes(settings),
        )

    @classmethod
    def from_env(cls) -> UrlValidationPolicy:
        """The policy the environment describes: ``PENSTOCK_*`` settings first, then the
        seed's ``DYN_MM_*`` variables."""
        from penstock.settings import Settings

        return cls.from_settings(Settings())

    @property
    def local_roots(self) -> tuple[str, ...]:
        extra = (self.allowed_local_path,) if self.allowed_local_path else ()
        return extra + self.allowed_local_roots

    def network_key(self) -> tuple[bool, tuple[IPNetwork, ...]]:
        """Policies with equal keys may share pooled connections."""
        return self.allow_private_ips, self._networks

    def address_allowed(self, address: IPAddress) -> bool:
        if self.allow_private_ips or any(address in net for net in self._networks):
            return True
        return not is_blocked_address(address)

    def domain_allowed(self, host: str) -> bool:
        if not self.allowed_domains:
            return True
        return any(host == d or host.endswith("." + d) for d in self.allowed_domains)


@dataclass(frozen=True)
class CheckedUrl:
    """A URL that passed :func:`check_url`, with the only addresses it may connect to."""

    url: str
    host: str
    port: int
    addresses: tuple[str, ...]


def is_blocked_address(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
        address = ipaddress.IPv6Address(str(address).split("%", 1)[0])
    return any(address in net for net in BLOCKED_NETWORKS if net.version == address.version)


def is_blocked_ip(text: str) -> bool:
    """True for an IP literal in a blocked range; False for anything else, names included."""
    try:
        return is_blocked_address(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        return False


def legacy_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """The address a numeric host means to ``inet_aton`` (decimal, octal, hex, short forms)."""
    if not _NUMERIC_HOST.match(host):
        return None
    parts = host.rstrip(".").split(".")
    numbers = []
    for part in parts:
        lowered = part.lower()
        if lowered.startswith("0x"):
            numbers.append(int(lowered[2:] or "0", 16))
        elif len(part) > 1 and part.startswith("0"):
            if not set(part) <= set("01234567"):
                return None
            numbers.append(int(part, 8))
        else:
            numbers.append(int(part))
    if len(numbers) > 4 or any(n > 255 for n in numbers[:-1]):
        return None
    value = 0
    for number in numbers[:-1]:
        value = value * 256 + number
    tail_bits = 8 * (5 - len(numbers))
    if numbers[-1] >= 1 << tail_bits:
        return None
    return ipaddress.IPv4Address((value << tail_bits) | numbers[-1])


def describe_media_source(source: object, limit: int = 120) -> str:
    """A short, log-safe label: data URLs keep only their media type."""
    if not isinstance(source, str):
        return "<non-string media source>"
    if source[:5].lower() == "data:":
        mime = source[5:].split(",", 1)[0].split(";", 1)[0][:40]
        return f"data:{mime} ({len(source)} chars, payload elided)"
    if len(source) > limit:
        return f"{source[:limit]}... ({len(source)} chars)"
    return source


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to. Tests replace this to simulate DNS answers."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _host_of(url: str) -> tuple[str, str, int]:
    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port
    except ValueError as exc:
        raise UrlValidationError(f"Invalid URL {describe_media_source(url)}: {exc}") from exc
    if not host:
        raise UrlValidationError(f"URL has no host: {describe_media_source(url)}")
    return parts.scheme.lower(), host.lower(), port or (443 if parts.scheme == "https" else 80)


def check_scheme_and_size(url: str, policy: UrlValidationPolicy) -> str:
    """The URL's scheme, once it is one the policy allows (data: URLs within their size)."""
    if not url or not url.strip():
        raise UrlValidationError("URL is empty")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        if len(url.encode()) > policy.max_data_url_bytes:
            raise UrlValidationError(
                f"data URL is {len(url.encode())} bytes, over the limit of "
                f"{policy.max_data_url_bytes}"
            )
        return scheme
    if scheme not in _HTTP_SCHEMES:
        raise UrlValidationError(f"URL scheme '{scheme}' not allowed: use https")
    if scheme == "http" and not policy.allow_http:
        raise UrlValidationError(
            "URL scheme 'http' not allowed: use https (operators allow http with "
            "--media-allow-http)"
        )
    return scheme


def check_address(address: IPAddress, host: str, policy: UrlValidationPolicy) -> None:
    if not policy.address_allowed(address):
        shown = host if host == str(address) else f"{host} ({address})"
        raise UrlValidationError(f"host {shown} is a blocked address (private or internal)")


async def check_url(url: str, policy: UrlValidationPolicy) -> CheckedUrl:
    """Judge an http(s) URL and resolve its host; the result's addresses are all allowed."""
    check_scheme_and_size(url, policy)
    if url[:5].lower() == "data:":
        raise UrlValidationError("a data URL is not fetched over the network")
    _, host, port = _host_of(url)
    bare = host.rstrip(".")
    if not policy.domain_allowed(bare):
        raise UrlValidationError(f"host {bare} is not in the allowed media domains")
    if not policy.allow_private_ips and bare in BLOCKED_HOSTNAMES:
        raise UrlValidationError(f"host {bare} is blocked (local or metadata service)")
    try:
        literal: IPAddress | None = ipaddress.ip_address(bare)
    except ValueError:
        literal = None
    if literal is None and (legacy := legacy_ipv4(bare)) is not None:
        raise UrlValidationError(
            f"host {bare} is a non-canonical spelling of {legacy}: write IPs in dotted-decimal"
        )
    if literal is not None:
        check_address(literal, bare, policy)
        return CheckedUrl(url, host, port, (str(literal),))
    try:
        addresses = await resolve_host(bare, port)
    except (OSError, UnicodeError) as exc:
        raise UrlValidationError(f"Could not resolve host {bare}") from exc
    if not addresses:
        raise UrlValidationError(f"Could not resolve host {bare}")
    for text in addresses:
        check_address(ipaddress.ip_address(text), bare, policy)
    return CheckedUrl(url, host, port, tuple(addresses))


async def validate_url(url: str, policy: UrlValidationPolicy) -> str:
    """``url`` unchanged if the policy allows fetching it; else :class:`UrlValidationError`."""
    if url[:5].lower() == "data:":
        check_scheme_and_size(url, policy)
        return url
    await check_url(url, policy)
    return url


def validate_local_path(path: str, policy: UrlValidationPolicy) -> Path:
    """The real path of ``path`` when it lies under an operator-allowed root."""
    if not policy.local_roots:
        raise UrlValidationError(
            "local media files are not allowed (operators allow a folder with "
            "--allowed-local-media-path)"
        )
    try:
        resolved = Path(path).resolve(strict=True)
    except FileNotFoundError as exc:
        raise UrlValidationError("local media file not found") from exc
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UrlValidationError(f"local media file can't be read: {reason}") from exc
    for root in policy.local_roots:
        try:
            real_root = Path(root).resolve(strict=True)
        except (OSError, ValueError):
            continue
        if resolved.is_relative_to(real_root) and resolved.is_file():
            return resolved
    raise UrlValidationError("local media file is outside the allowed folders")


def local_path_of(url: str) -> str | None:
    """The path a ``file://`` URL or bare path names; None for any other URL."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise UrlValidationError(f"a file URL must name a local path, not host {parts.netloc}")
        return unquote(parts.path)
    if scheme == "" or (len(scheme) == 1 and os.name == "nt"):
        return url
    return None


async def validate_media_url(url: str, policy: UrlValidationPolicy) -> str:
    """Like :func:`validate_url`, and local references become a checked ``file://`` URI."""
    path = local_path_of(url) if url else None
    if path is not None:
        return validate_local_path(path, policy).as_uri()
    return await validate_url(url, policy)

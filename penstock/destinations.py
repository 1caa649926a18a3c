"""Where files leave the server for: the local path a ``file://`` URL names, and the
operator's root for rollout metadata uploads (a folder, or an http(s) or s3 URL)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

# Where an operator may send rollout metadata: a local folder, an HTTP(S) PUT target, S3.
METADATA_UPLOAD_SCHEMES = ("file", "http", "https", "s3")


def local_path(url: str) -> str:
    """The path a ``file://`` URL names, percent-decoded; other values are returned as given.

    ``file://localhost/x`` is ``/x``; a URL naming another host is an error, since no
    file URL reaches past this machine.
    """
    if not url.startswith("file://"):
        return url
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"a file URL must name a local path, not host '{parts.netloc}'")
    if parts.query or parts.fragment:
        raise ValueError("a file URL must not have a query or fragment (percent-encode '?', '#')")
    return unquote(parts.path)


def metadata_upload_root(value: str) -> str:
    """The operator's upload root, checked: an absolute folder, or an http(s)/s3 URL."""
    value = value.strip()
    scheme, sep, _ = value.partition("://")
    if not sep or scheme == "file":
        path = local_path(value)
        if not path:
            raise ValueError("a file URL for the metadata upload root must name a folder")
        return str(Path(path).expanduser().absolute())
    if scheme not in METADATA_UPLOAD_SCHEMES:
        raise ValueError(
            f"unsupported metadata upload scheme '{scheme}' "
            f"(supported: a folder, {', '.join(f'{s}://' for s in METADATA_UPLOAD_SCHEMES)})"
        )
    if not urlsplit(value).netloc:
        raise ValueError(f"the metadata upload root {value!r} names no host or bucket")
    import fsspec

    # Loads the client library (s3fs, aiohttp) now, so a missing one stops the start
    # rather than every upload; no connection is made and no credential is looked up.
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        raise ValueError(f"{scheme}:// metadata uploads need a package: {exc}") from exc
    return value.rstrip("/")

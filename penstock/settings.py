"""Gateway settings: CLI flags override ``PENSTOCK_*`` environment variables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import unquote, urlsplit

from pydantic import BeforeValidator, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "penstock"
DEFAULT_ADMIN_TIMEOUT_S = 30.0
DEFAULT_PREPROCESS_WORKERS = 4

# Where the transformers engine keeps converted models; the CLI points it under cache_dir.
MODEL_CACHE_ENV = "PENSTOCK_MODEL_CACHE"


def _split_csv(value: object) -> object:
    """Accept ``a,b`` or a JSON list for list settings given as one string (env vars)."""
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("["):
            return json.loads(stripped)
        return [part.strip() for part in stripped.split(",") if part.strip()]
    return value


CsvList = Annotated[list[str], NoDecode, BeforeValidator(_split_csv)]

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


class Settings(BaseSettings):
    """Everything the gateway process is configured with."""

    model_config = SettingsConfigDict(env_prefix="PENSTOCK_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "transformers"
    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    tool_call_parser: str | None = None
    engine_args: list[str] = Field(default_factory=list)
    log_level: str = "info"
    log_format: Literal["text", "json"] = "text"
    # One line per request on the "penstock.access" logger.
    access_log: bool = True

    api_keys: CsvList = Field(default_factory=list)
    admin_api_keys: CsvList = Field(default_factory=list)
    # Paths reachable without an inference key. Listed here, not implied by a prefix.
    auth_exempt_paths: CsvList = Field(
        default_factory=lambda: ["/health", "/live", "/metrics", "/version"]
    )

    max_body_mb: float = 45.0
    max_concurrency: int = 512
    max_queue: int = 1024
    overload_status: int = 529
    sse_keepalive_s: float = 15.0
    graceful_shutdown_s: float = 30.0
    health_check_payload: str | None = None
    admin_timeout_s: float = Field(DEFAULT_ADMIN_TIMEOUT_S, gt=0)

    allow_unknown_fields: bool = False
    max_n: int = 16
    max_stop_sequences: int = 16

    # Root of the model cache, the media store and the job database.
    cache_dir: Path = DEFAULT_CACHE_DIR
    # Unset: a folder per served model under ``cache_dir``.
    media_store: str | None = None
    # The video job database: a SQLite file or a database URL (postgresql+psycopg://... to
    # share jobs between gateways); unset: next to the media store when it is a local folder.
    media_db: str | None = None
    media_workers: int = 1
    media_max_width: int = 1920
    media_max_height: int = 1920

    # Root under which requests may ask for rollout metadata uploads (relative keys only);
    # unset: a request asking for an upload gets 400.
    metadata_upload_url: str | None = None

    # Media fetched for multimodal requests (penstock.http): what a media URL may reach.
    media_allow_http: bool = False
    # Hosts media may come from (and their subdomains); empty: any public host.
    allowed_media_domains: CsvList = Field(default_factory=list)
    # CIDR ranges exempt from the private/internal address block.
    allowed_media_networks: CsvList = Field(default_factory=list)
    # Folders file:// media may be read from; empty: no local files.
    allowed_local_media_paths: CsvList = Field(default_factory=list)
    media_fetch_timeout_s: float = Field(30.0, gt=0)
    media_fetch_max_mb: float = Field(64.0, gt=0)
    media_max_data_url_mb: float = Field(16.0, gt=0)
    http_backend: Literal["httpx", "aiohttp"] = "httpx"
    http_max_connections: int = Field(100, gt=0)
    # Replaces every fetch's own total timeout when set.
    http_timeout_s: float | None = Field(None, gt=0)
    http_connect_timeout_s: float = Field(5.0, gt=0)
    http_keepalive_timeout_s: float = Field(15.0, gt=0)
    # Media parts of chat requests (image_url, input_audio, audio_url), fetched and decoded
    # by the gateway before the engine sees the request; each item is also bounded by
    # media_fetch_max_mb (downloads) or media_max_data_url_mb (data: URLs).
    media_max_images_per_request: int = Field(16, ge=0)
    media_max_image_pixels: int = Field(4096 * 4096, gt=0)
    media_max_audio_per_request: int = Field(4, ge=0)
    media_max_audio_s: float = Field(600.0, gt=0)

    @field_validator("allowed_media_networks")
    @classmethod
    def _cidr_ranges(cls, value: list[str]) -> list[str]:
        import ipaddress

        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as exc:
                raise ValueError(f"allowed media network {cidr!r} is not a CIDR range") from exc
        return value

    @property
    def media_fetch_max_bytes(self) -> int:
        return int(self.media_fetch_max_mb * 1024 * 1024)

    @field_validator("metadata_upload_url")
    @classmethod
    def _metadata_upload_root(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        return metadata_upload_root(value)

    # Connection hygiene; 0 turns a timeout or the limit off.
    header_timeout_s: float = Field(10.0, ge=0)
    body_timeout_s: float = Field(30.0, ge=0)
    keep_alive_timeout_s: float = Field(5.0, ge=0)
    max_connections: int = Field(2048, ge=0)
    # The OpenAPI schema and its pages without an inference key even when keys are set.
    public_docs: bool = False

    # At most one line per this many seconds sums up the requests refused as overloaded.
    overload_log_interval_s: float = Field(10.0, gt=0)

    # Deadlines of chat and completions requests, in seconds; None: none.
    request_timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    max_request_timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    # Threads that render chat templates and tokenize large inputs off the event loop.
    preprocess_workers: int = Field(DEFAULT_PREPROCESS_WORKERS, ge=1)
    # A prompt longer than context length x this many characters is refused before it is
    # tokenized; None: the longest token of the model's vocabulary, in characters.
    max_chars_per_token: float | None = Field(None, gt=0, allow_inf_nan=False)
    # The event loop the server runs on; auto: uvloop where it is installed.
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"

    @model_validator(mode="after")
    def _default_timeout_within_the_max(self) -> Settings:
        default, cap = self.request_timeout_s, self.max_request_timeout_s
        if default is not None and cap is not None and default > cap:
            raise ValueError(
                f"request_timeout_s ({default:g}) must not exceed max_request_timeout_s ({cap:g})"
            )
        return self

    # OTLP/HTTP collector base URL (``/v1/traces`` is appended); unset: tracing is off
    # unless the standard OTEL_EXPORTER_OTLP_*ENDPOINT variables are set.
    otlp_endpoint: str | None = None
    # Unset: OTEL_SERVICE_NAME, else "penstock".
    otlp_service_name: str | None = None

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_endpoint(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        value = value.strip()
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the OTLP endpoint must be an http:// or https:// URL, got {value!r}")
        return value

    # Unpickle weight payloads (update_weights_from_tensor as verl/slime send them): an
    # admin key is not a licence to run code, so the operator opts in.
    trust_weight_payloads: bool = False

    # --ray: the engine as a Ray Serve deployment of replicas, this process the ingress.
    ray: bool = False
    # Unset: start a local Ray cluster; "auto" or ray://host:port: join an existing one.
    ray_address: str | None = None
    ray_app_name: str = "penstock"
    ray_replicas: int = Field(default=1, ge=1)
    ray_replica_cpus: float = Field(default=1.0, ge=0)
    ray_replica_gpus: float = Field(default=0.0, ge=0)
    # Either bound set: autoscale between them on ongoing requests per replica.
    ray_min_replicas: int | None = Field(default=None, ge=0)
    ray_max_replicas: int | None = Field(default=None, ge=1)
    ray_target_ongoing_requests: float = Field(default=2.0, gt=0)
    # Routing (penstock.ray.routing): a request without a session key is keyed by this many
    # leading prompt tokens (0: not keyed); the replica its key prefers is taken unless it
    # has more than ray_affinity_max_imbalance ongoing requests beyond the least loaded.
    ray_affinity_prefix_tokens: int = Field(default=64, ge=0)
    ray_affinity_max_imbalance: int = Field(default=8, ge=0)

    # A gateway sharing the job database whose beat stops this long is taken for dead: its
    # queued video jobs move to a live gateway, its running ones are failed.
    media_job_lease_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _ray_bounds(self) -> Settings:
        low, high = self.ray_min_replicas, self.ray_max_replicas
        if low is not None and high is not None and low > high:
            raise ValueError(f"ray_min_replicas ({low}) must not exceed ray_max_replicas ({high})")
        return self

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

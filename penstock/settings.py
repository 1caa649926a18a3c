"""Gateway settings: CLI flags override ``PENSTOCK_*`` environment variables.

Each field declares its flag, help and shown default once (:class:`~penstock.options.Option`);
``penstock serve``'s options and the README's settings table are derived from them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from penstock.destinations import metadata_upload_root
from penstock.options import Option, with_also_env
from penstock.setting_types import CsvList, FinitePositive

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "penstock"
DEFAULT_ADMIN_TIMEOUT_S = 30.0
DEFAULT_PREPROCESS_WORKERS = 4

# Where the transformers engine keeps converted models; the CLI points it under cache_dir.
MODEL_CACHE_ENV = "PENSTOCK_MODEL_CACHE"


ReasoningParser = Literal["deepseek_r1", "qwen3"]


class Settings(BaseSettings):
    """Everything the gateway process is configured with."""

    model_config = SettingsConfigDict(env_prefix="PENSTOCK_", extra="ignore")

    host: Annotated[str, Option("bind address", doc="where to listen")] = "127.0.0.1"
    port: Annotated[int, Option("port")] = 8000
    engine: Annotated[str, Option("built-in engine ({engines}) or package.module:Class")] = (
        "transformers"
    )
    model: Annotated[
        str | None, Option("model path or name, forwarded to the engine", default="the engine's")
    ] = None
    tokenizer: Annotated[
        str | None,
        Option("folder with tokenizer.json and chat template", default="the model's folder"),
    ] = None
    served_model_name: Annotated[
        str | None, Option("name clients use in 'model'", default="the engine's")
    ] = None
    tool_call_parser: Annotated[
        str | None,
        Option(
            "turn tool calls the model writes into OpenAI tool_calls",
            default="the engine's, else none",
            choices="tool_call_parsers",
        ),
    ] = None
    reasoning_parser: Annotated[
        ReasoningParser | None,
        Option("split off <think> blocks", default="the engine's, else none"),
    ] = None
    deterministic: Annotated[
        bool,
        Option(
            "the engine's --deterministic mode: a request's tokens and logprobs do not depend "
            "on what runs beside it, and its logprobs equal a trainer's forward pass",
            doc="forwarded to the engine as `--deterministic`, and the engine must declare it "
            "(`deterministic` in `GET /engine/capabilities`) or the server does not start. "
            "The transformers engine then runs one sequence per forward pass and recomputes "
            "every returned logprob with one forward pass over prompt and completion, equal "
            "to a trainer's `log_softmax(model(input_ids).logits.float())` for the same "
            "weights, dtype and kernels (on the CPU: as many threads as `--cpu-threads`); "
            "its cost is in `bench/README.md` (On-policy logprobs)",
        ),
    ] = False
    # The arguments after ``--``, handed to the engine unchanged.
    engine_args: list[str] = Field(default_factory=list)
    log_level: Annotated[
        str,
        Option("lowest level logged", choices=("critical", "error", "warning", "info", "debug")),
    ] = "info"
    log_format: Annotated[
        Literal["text", "json"],
        Option(
            "json: one JSON object per line, fixed keys",
            doc="`json`: every log line is one JSON object with `time`, `level`, `logger`, "
            "`message` (access lines add `method`, `route`, `status`, `duration_ms`, "
            "`request_id`, `prompt_tokens`, `completion_tokens`)",
        ),
    ] = "text"
    access_log: Annotated[
        bool,
        Option(
            "one line per request on the penstock.access logger: method, route, status, "
            "duration, request id, tokens",
            negatable=True,
            doc="one INFO line per finished request on the `penstock.access` logger: method, "
            "route template, status, duration, request id, tokens for chat and completions",
        ),
    ] = True

    api_keys: Annotated[
        CsvList,
        Option(
            "inference key, repeatable",
            default="none, the inference routes are open",
            flag="--api-key",
            metavar="KEY",
            doc="Bearer keys for the inference routes (`PENSTOCK_API_KEYS=a,b`, else vLLM's "
            "`VLLM_API_KEY`); with none on a non-loopback `--host`, startup logs one WARNING "
            "saying anyone who can reach the port can use them",
            also_env="VLLM_API_KEY",
        ),
    ] = Field(default_factory=list)
    admin_api_keys: Annotated[
        CsvList,
        Option(
            "admin key, repeatable",
            default="none, admin routes answer loopback clients only",
            flag="--admin-api-key",
            metavar="KEY",
            doc="Bearer keys for admin routes (accepted on the inference routes too); with "
            "none, admin routes answer loopback clients only",
        ),
    ] = Field(default_factory=list)
    cache_salt_by_key: Annotated[
        bool | None,
        Option(
            "share cached prompt prefixes only between requests of one API key",
            default="on with two or more inference keys",
            negatable=True,
            doc="salt the engine's prefix cache with the caller's API key (and its "
            "`cache_salt`), so a key neither reuses nor learns (by `cached_tokens` or "
            "timing) another key's cached prompts; on by default with two or more "
            "inference keys",
        ),
    ] = None
    # Paths reachable without an inference key. Listed here, not implied by a prefix.
    auth_exempt_paths: Annotated[
        CsvList, Option("paths reachable without an inference key", env_only=True)
    ] = Field(default_factory=lambda: ["/health", "/live", "/ping", "/metrics", "/version"])

    max_body_mb: Annotated[float, Option("larger request bodies get 413")] = 45.0
    max_concurrency: Annotated[
        int,
        Option(
            "engine requests running at once",
            doc="engine requests (one per prompt) running at once; beyond it and "
            "`--max-queue`, requests get `--overload-status` with `Retry-After: 1`, and a "
            "completions batch of more prompts than both together gets 400 "
            '(`param: "prompt"`)',
        ),
    ] = 512
    max_queue: Annotated[int, Option("requests waiting beyond that")] = 1024
    overload_status: Annotated[int, Option("status when both are full")] = 529
    sse_keepalive_s: Annotated[float, Option("idle SSE comment interval; 0 = off")] = 15.0
    graceful_shutdown_s: Annotated[
        float,
        Option(
            "drain budget on SIGTERM; requests still open after it are ended with a "
            "server_shutdown error and the exit status is {exit_requests_cut}",
            doc="on SIGTERM/SIGINT: new requests get 503 while in-flight ones finish; "
            "requests still open when it runs out are cut: a stream ends with a "
            "`server_shutdown` error frame and `data: [DONE]`, a response not yet begun gets "
            "a 503 `server_shutdown` envelope, one WARNING line counts them and the exit "
            "status is {exit_requests_cut}; a second signal exits at once with 128 + its "
            "number",
        ),
    ] = 30.0
    health_check_payload: Annotated[
        str | None,
        Option(
            "canary JSON or @file; replaces the engine's",
            default="the engine's",
            doc="canary sent through the engine when idle (JSON or `@file`); replaces the "
            "engine's whole",
        ),
    ] = None
    admin_timeout_s: Annotated[
        float,
        Option(
            "bound on one admin operation, lock wait included; past it 409",
            doc="bound on one admin operation (lock wait included): past it the call answers "
            "409 with the state and a pause or sleep is undone",
        ),
    ] = Field(DEFAULT_ADMIN_TIMEOUT_S, gt=0)

    allow_unknown_fields: Annotated[
        bool,
        Option(
            "ignore request fields no API defines, as vLLM does (logged, named in the "
            "x-penstock-ignored-fields header); --no-allow-unknown-fields refuses them (400)",
            negatable=True,
        ),
    ] = True
    max_n: Annotated[int, Option("largest n a request may ask for")] = 16
    scheduling_policy: Annotated[
        Literal["fcfs", "priority"],
        Option(
            "fcfs: requests run in arrival order and a non-zero priority is a 400; priority: "
            "lower priority values first, none passed over by two batches of later ones",
        ),
    ] = "fcfs"
    max_stop_sequences: Annotated[
        int, Option("most stop sequences one request may give; more get 400", env_only=True)
    ] = 16

    cache_dir: Annotated[
        Path,
        Option(
            "root of the model cache (<cache-dir>/models, handed to the engine as "
            f"${MODEL_CACHE_ENV} unless that is set), the media store and the job database"
        ),
    ] = DEFAULT_CACHE_DIR
    media_store: Annotated[
        str | None,
        Option(
            "folder or fsspec URL for generated media, with the video job database next to "
            "it when it is a folder",
            default="<cache-dir>/media/<served model name>",
            doc="folder or fsspec URL for generated media; the video job database sits next "
            "to a folder store, so servers of different models keep their jobs apart; a "
            "`memory://` store keeps its jobs in memory too; an existing file stops startup "
            "with one line (exit status 1)",
        ),
    ] = None
    media_db: Annotated[
        str | None,
        Option(
            "the video job database: a SQLite file, or a URL such as "
            "postgresql+psycopg://user:password@host/db that several gateways share (needs "
            "pip install 'penstock[postgres]')",
            default="jobs.sqlite3 next to a folder --media-store, else in memory for "
            "memory://, else <cache-dir>/media-jobs/<served model name>.sqlite3",
            metavar="PATH_OR_URL",
            doc="the video job database: a SQLite file, or "
            "`postgresql+psycopg://user:password@host/db` (`pip install 'penstock[postgres]'`)"
            " for gateways that share their jobs; one that can't be opened stops startup with "
            "one line",
        ),
    ] = None
    media_workers: Annotated[int, Option("video and image generations running at once")] = 1
    media_max_width: Annotated[int, Option("widest video or image size asked", env_only=True)] = (
        1920
    )
    media_max_height: Annotated[int, Option("tallest video or image size asked", env_only=True)] = (
        1920
    )

    metadata_upload_url: Annotated[
        str | None,
        Option(
            "root for rollout records that requests ask for with nvext.metadata_upload: a "
            "folder, file://, http(s):// (PUT) or s3:// URL; a request names only a key under "
            "it",
            default="none, such requests get 400",
        ),
    ] = None

    # Media fetched for multimodal requests (penstock.http): what a media URL may reach.
    media_allow_http: Annotated[
        bool, Option("let media URLs use plain http", default="https only")
    ] = False
    allowed_media_domains: Annotated[
        CsvList,
        Option(
            "host media may come from, with its subdomains, repeatable",
            default="any public host",
            flag="--allowed-media-domain",
            doc="host media may come from, with its subdomains. By default media URLs reach "
            "public https hosts only (private, loopback, link-local, metadata and "
            "IPv4-mapped addresses refused, for every address a name resolves to and at "
            "every redirect hop)",
        ),
    ] = Field(default_factory=list)
    allowed_media_networks: Annotated[
        CsvList,
        Option(
            "CIDR range exempt from the private/internal address block, repeatable",
            flag="--allowed-media-network",
        ),
    ] = Field(default_factory=list)
    allowed_local_media_paths: Annotated[
        CsvList,
        Option(
            "folder file:// media may be read from, repeatable",
            default="none, local files are refused",
            flag="--allowed-local-media-path",
        ),
    ] = Field(default_factory=list)
    media_fetch_timeout_s: Annotated[float, Option("bound on one media fetch")] = Field(30.0, gt=0)
    media_fetch_max_mb: Annotated[
        float, Option("larger media downloads fail, while the body streams")
    ] = Field(64.0, gt=0)
    media_max_data_url_mb: Annotated[float, Option("larger data: URLs are refused")] = Field(
        16.0, gt=0
    )
    http_backend: Annotated[
        Literal["httpx", "aiohttp"],
        Option("media fetch library; aiohttp needs pip install 'penstock[aiohttp]'"),
    ] = "httpx"
    http_max_connections: Annotated[int, Option("media fetch connection pool size")] = Field(
        100, gt=0
    )
    http_timeout_s: Annotated[
        float | None, Option("replaces every media fetch's total timeout")
    ] = Field(None, gt=0)
    http_connect_timeout_s: Annotated[float, Option("media fetch connect timeout")] = Field(
        5.0, gt=0
    )
    http_keepalive_timeout_s: Annotated[float, Option("idle pooled media fetch connection")] = (
        Field(15.0, gt=0)
    )
    # Media parts of chat requests, fetched and decoded before the engine sees the request;
    # each item also within media_fetch_max_mb (downloads) or media_max_data_url_mb (data:).
    media_max_images_per_request: Annotated[
        int, Option("image parts one chat request may carry; more get 400")
    ] = Field(16, ge=0)
    media_max_image_pixels: Annotated[
        int,
        Option(
            "width x height of one image in a request; larger ones get 413 before their "
            "pixels are decoded"
        ),
    ] = Field(4096 * 4096, gt=0)
    media_max_audio_per_request: Annotated[
        int, Option("audio parts one chat request may carry; more get 400")
    ] = Field(4, ge=0)
    media_max_audio_s: Annotated[
        float, Option("seconds of one audio clip in a request; longer ones get 413")
    ] = Field(600.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _also_env(cls, data: object) -> object:
        if isinstance(data, dict):
            return with_also_env(cls, data, os.environ)
        return data

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
    header_timeout_s: Annotated[
        float,
        Option(
            "close a connection that has not sent its request headers this long after it "
            "opened or its request began, with 408 if it sent part of them; 0 = off",
            doc="a connection that has not sent complete request headers this long after it "
            "opened (or after the first byte of a later request) is closed, with a 408 "
            "`header_timeout` envelope if it sent part of them; 0 turns it off. A request "
            "line and headers over 64 KiB get a 431 envelope and the connection is closed",
        ),
    ] = Field(10.0, ge=0)
    body_timeout_s: Annotated[
        float,
        Option(
            "answer 408 and close when a request body stalls this long; 0 = off",
            doc="a request body that stalls this long between two pieces gets a 408 "
            "`body_timeout` envelope and the connection is closed; 0 turns it off",
        ),
    ] = Field(30.0, ge=0)
    body_deadline_s: Annotated[
        float,
        Option(
            "answer 408 and close when a request body has not arrived whole this long after "
            "its headers, however steadily it trickles; 0 = off",
            doc="a request body not received whole this long after its headers (a client "
            "sending a byte now and then included) gets a 408 `body_deadline` envelope and "
            "the connection is closed; 0 turns it off",
        ),
        # The largest body (--max-body-mb) at a few Mbit/s.
    ] = Field(120.0, ge=0)
    keep_alive_timeout_s: Annotated[
        float, Option("close a kept-alive connection idle this long after a response")
    ] = Field(5.0, ge=0)
    max_connections: Annotated[
        int,
        Option(
            "requests arriving while more connections are open get 503 and their "
            "connection closed; 0 = no limit",
            doc="a request arriving while more connections are open gets a 503 "
            "`too_many_connections` envelope and its connection is closed; 0 means no limit. "
            "At startup the soft open-file limit is raised to the hard one",
        ),
    ] = Field(2048, ge=0)
    public_docs: Annotated[
        bool,
        Option(
            "serve /docs, /redoc and /openapi.json without an inference key",
            default="behind the inference key when keys are set",
        ),
    ] = False

    overload_log_interval_s: Annotated[
        float,
        Option(
            "requests refused as overloaded are summed up in one WARNING line at most this "
            "often, not logged one by one"
        ),
    ] = Field(10.0, gt=0)

    request_timeout_s: Annotated[
        FinitePositive | None,
        Option(
            "deadline of a chat or completions request, admission queue included; past it "
            "408 (or an error frame once streaming); a request's X-Request-Timeout header "
            "overrides it",
            doc="deadline of a chat or completions request, counted from when its route "
            "starts (preprocessing and the admission queue included); past it 408, or an "
            "error frame once streaming; a request's `X-Request-Timeout: <seconds>` header "
            "replaces it",
        ),
    ] = None
    max_request_timeout_s: Annotated[
        FinitePositive | None,
        Option(
            "largest X-Request-Timeout honoured; larger values are lowered to it; "
            "--request-timeout-s may not exceed it",
            default="none, any",
        ),
    ] = None
    preprocess_workers: Annotated[
        int,
        Option(
            "threads rendering chat templates and tokenizing large prompts (over 2048 "
            "characters) off the event loop; smaller ones are handled inline"
        ),
    ] = Field(DEFAULT_PREPROCESS_WORKERS, ge=1)
    max_chars_per_token: Annotated[
        FinitePositive | None,
        Option(
            "prompts longer than context length x this many characters get 400 "
            "context_length_exceeded before tokenizing",
            default="the longest token of the model's vocabulary, in characters",
        ),
    ] = None
    event_loop: Annotated[
        Literal["auto", "asyncio", "uvloop"],
        Option(
            "event loop of the server; auto: uvloop where it is installed (it is with "
            "uvicorn[standard]), else asyncio",
            flag="--loop",
        ),
    ] = "auto"

    @model_validator(mode="after")
    def _default_timeout_within_the_max(self) -> Settings:
        default, cap = self.request_timeout_s, self.max_request_timeout_s
        if default is not None and cap is not None and default > cap:
            raise ValueError(
                f"request_timeout_s ({default:g}) must not exceed max_request_timeout_s ({cap:g})"
            )
        return self

    otlp_endpoint: Annotated[
        str | None,
        Option(
            "export traces over OTLP/HTTP to this collector (e.g. http://127.0.0.1:4318; "
            "/v1/traces is appended); OTEL_EXPORTER_OTLP_ENDPOINT also turns tracing on; "
            "needs pip install 'penstock[tracing]'",
            default="off",
            metavar="URL",
        ),
    ] = None
    otlp_service_name: Annotated[
        str | None,
        Option(
            "service.name of the exported spans",
            default="$OTEL_SERVICE_NAME, else {service_name}",
        ),
    ] = None

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

    # Unpickling a weight payload runs code, which an admin key does not license: opt-in.
    trust_weight_payloads: Annotated[
        bool,
        Option(
            "accept pickled update_weights_from_tensor payloads (verl/slime's "
            "MultiprocessingSerializer); unpickling runs code the sender chose, so only for "
            "trainers you trust",
            default="off, safetensors payloads only; pickled ones get 400",
        ),
    ] = False
    weights_dir: Annotated[
        Path | None,
        Option(
            "folder the local checkpoints of delta pulls (/pull_weights, /fetch_weights) must "
            "lie in",
            default="any new or empty folder outside the system's",
        ),
    ] = None

    # --ray: the engine as a Ray Serve deployment of replicas, this process the ingress.
    ray: Annotated[
        bool,
        Option(
            "run the engine as a Ray Serve deployment of replicas behind this gateway; needs "
            "pip install 'penstock[ray]'",
            default="off, the engine runs in this process",
        ),
    ] = False
    ray_address: Annotated[
        str | None,
        Option("Ray cluster to join (auto, or ray://host:10001)", default="start a local one"),
    ] = None
    ray_app_name: Annotated[str, Option("name of the Ray Serve application")] = "penstock"
    ray_replicas: Annotated[
        int, Option("engine replicas, or the initial count when autoscaling")
    ] = Field(default=1, ge=1)
    ray_replica_cpus: Annotated[float, Option("CPUs reserved per replica")] = Field(
        default=1.0, ge=0
    )
    ray_replica_gpus: Annotated[float, Option("GPUs reserved per replica")] = Field(
        default=0.0, ge=0
    )
    ray_min_replicas: Annotated[
        int | None,
        Option(
            "autoscale on ongoing requests, down to this many replicas",
            default="no autoscaling",
        ),
    ] = Field(default=None, ge=0)
    ray_max_replicas: Annotated[
        int | None,
        Option("autoscale on ongoing requests, up to this many replicas", default="no autoscaling"),
    ] = Field(default=None, ge=1)
    ray_target_ongoing_requests: Annotated[
        float, Option("ongoing requests per replica the autoscaler aims for")
    ] = Field(default=2.0, gt=0)
    ray_upscale_delay_s: Annotated[
        float,
        Option("seconds the fleet stays above its target before autoscaling adds a replica"),
    ] = Field(default=30.0, ge=0)
    ray_affinity_prefix_tokens: Annotated[
        int,
        Option(
            "requests without a session key (X-Session-Id header or user field) prefer one "
            "replica per this many leading prompt tokens; 0 turns prefix affinity off"
        ),
    ] = Field(default=64, ge=0)
    ray_affinity_max_imbalance: Annotated[
        int,
        Option(
            "a request leaves its preferred replica for the least-loaded one when the "
            "preferred has more than this many ongoing requests beyond it"
        ),
    ] = Field(default=8, ge=0)

    media_job_lease_s: Annotated[
        float,
        Option(
            "a gateway sharing the job database whose beat stops this long is taken for "
            "dead: its queued jobs run elsewhere, its running ones fail"
        ),
    ] = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _ray_bounds(self) -> Settings:
        low, high = self.ray_min_replicas, self.ray_max_replicas
        if low is not None and high is not None and low > high:
            raise ValueError(f"ray_min_replicas ({low}) must not exceed ray_max_replicas ({high})")
        return self

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

"""``penstock serve``: the command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from penstock.app.logs import configure_logging
from penstock.engines.loading import BUILTIN_ENGINES, engine_options_help
from penstock.errors import (
    EngineLoadError,
    JobDatabaseError,
    ListenError,
    MediaStoreError,
    RaySetupError,
    TracingSetupError,
)
from penstock.preprocess.tool_calls import TOOL_CALL_PARSERS
from penstock.settings import MODEL_CACHE_ENV, Settings
from penstock.tracing import DEFAULT_SERVICE_NAME

# The exit status when the grace period of a shutdown ran out and open requests were cut;
# a second signal exits with 128 + its number instead (130 for SIGINT).
EXIT_REQUESTS_CUT = 3


def _default(field: str) -> object:
    return Settings.model_fields[field].default


def _parser(engine_help: str | None = None) -> argparse.ArgumentParser:
    """``engine_help``: the selected engine's options, listed after the gateway's."""
    parser = argparse.ArgumentParser(
        prog="penstock", description="OpenAI-compatible inference gateway and admin API."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="start the gateway on an engine",
        # Raw: the engine's help keeps its own layout. The description is wrapped by hand.
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Start the gateway. Each option defaults to its PENSTOCK_* environment variable\n"
            "(--max-n: PENSTOCK_MAX_N), then to the default shown. Arguments after '--' go\n"
            "to the engine unchanged; the selected engine's options are listed last."
        ),
        epilog=engine_help,
    )
    serve.add_argument("--host", help=f"bind address (default: {_default('host')})")
    serve.add_argument("--port", type=int, help=f"port (default: {_default('port')})")
    serve.add_argument(
        "--engine",
        help=f"built-in engine ({', '.join(sorted(BUILTIN_ENGINES))}) "
        f"or package.module:Class (default: {_default('engine')})",
    )
    serve.add_argument(
        "--model", help="model path or name, forwarded to the engine (default: the engine's)"
    )
    serve.add_argument(
        "--tokenizer",
        help="folder with tokenizer.json and chat template (default: the model's folder)",
    )
    serve.add_argument(
        "--served-model-name", help="name clients use in 'model' (default: the engine's)"
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="turn tool calls the model writes into OpenAI tool_calls (default: the engine's, "
        "else none)",
    )
    serve.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        metavar="KEY",
        help="inference key, repeatable (default: none, the inference routes are open)",
    )
    serve.add_argument(
        "--admin-api-key",
        dest="admin_api_keys",
        action="append",
        metavar="KEY",
        help="admin key, repeatable (default: none, admin routes answer loopback clients only)",
    )
    serve.add_argument(
        "--max-body-mb",
        type=float,
        help=f"larger request bodies get 413 (default: {_default('max_body_mb'):g})",
    )
    serve.add_argument(
        "--sse-keepalive-s",
        type=float,
        help=f"idle SSE comment interval; 0 = off (default: {_default('sse_keepalive_s'):g})",
    )
    serve.add_argument(
        "--graceful-shutdown-s",
        type=float,
        help="drain budget on SIGTERM; requests still open after it are ended with a "
        f"server_shutdown error and the exit status is {EXIT_REQUESTS_CUT} "
        f"(default: {_default('graceful_shutdown_s'):g})",
    )
    serve.add_argument(
        "--health-check-payload",
        help="canary JSON or @file; replaces the engine's (default: the engine's)",
    )
    serve.add_argument(
        "--admin-timeout-s",
        type=float,
        help="bound on one admin operation, lock wait included; past it 409 "
        f"(default: {_default('admin_timeout_s'):g})",
    )
    serve.add_argument(
        "--allow-unknown-fields",
        action="store_const",
        const=True,
        help="ignore unknown request fields instead of rejecting them (default: reject, 400)",
    )
    serve.add_argument(
        "--max-n", type=int, help=f"largest n a request may ask for (default: {_default('max_n')})"
    )
    serve.add_argument(
        "--max-concurrency",
        type=int,
        help=f"engine requests running at once (default: {_default('max_concurrency')})",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        help=f"requests waiting beyond that (default: {_default('max_queue')})",
    )
    serve.add_argument(
        "--overload-status",
        type=int,
        help=f"status when both are full (default: {_default('overload_status')})",
    )
    serve.add_argument(
        "--cache-dir",
        help="root of the model cache (<cache-dir>/models, handed to the engine as "
        f"${MODEL_CACHE_ENV} unless that is set), the media store and the job database "
        f"(default: {_default('cache_dir')})",
    )
    serve.add_argument(
        "--media-store",
        help="folder or fsspec URL for generated media, with the video job database next to "
        "it when it is a folder (default: <cache-dir>/media/<served model name>)",
    )
    serve.add_argument(
        "--media-db",
        metavar="PATH_OR_URL",
        help="the video job database: a SQLite file, or a URL such as "
        "postgresql+psycopg://user:password@host/db that several gateways share (needs pip "
        "install 'penstock[postgres]') (default: jobs.sqlite3 next to a folder --media-store, "
        "else in memory for memory://, else <cache-dir>/media-jobs/<served model name>.sqlite3)",
    )
    serve.add_argument(
        "--media-job-lease-s",
        type=float,
        help="a gateway sharing the job database whose beat stops this long is taken for "
        "dead: its queued jobs run elsewhere, its running ones fail "
        f"(default: {_default('media_job_lease_s'):g})",
    )
    serve.add_argument(
        "--media-workers",
        type=int,
        help=f"video and image generations running at once (default: {_default('media_workers')})",
    )
    serve.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        help=f"lowest level logged (default: {_default('log_level')})",
    )
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        help=f"json: one JSON object per line, fixed keys (default: {_default('log_format')})",
    )
    serve.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        help="one line per request on the penstock.access logger: method, route, status, "
        "duration, request id, tokens (default: on)",
    )
    serve.add_argument(
        "--metadata-upload-url",
        help="root for rollout records that requests ask for with nvext.metadata_upload: a "
        "folder, file://, http(s):// (PUT) or s3:// URL; a request names only a key under "
        "it (default: none, such requests get 400)",
    )
    serve.add_argument(
        "--header-timeout-s",
        type=float,
        help="close a connection that has not sent its request headers this long after it "
        "opened or its request began, with 408 if it sent part of them; 0 = off "
        f"(default: {_default('header_timeout_s'):g})",
    )
    serve.add_argument(
        "--body-timeout-s",
        type=float,
        help="answer 408 and close when a request body stalls this long; 0 = off "
        f"(default: {_default('body_timeout_s'):g})",
    )
    serve.add_argument(
        "--keep-alive-timeout-s",
        type=float,
        help="close a kept-alive connection idle this long after a response "
        f"(default: {_default('keep_alive_timeout_s'):g})",
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        help="requests arriving while more connections are open get 503 and their "
        f"connection closed; 0 = no limit (default: {_default('max_connections')})",
    )
    serve.add_argument(
        "--public-docs",
        action="store_const",
        const=True,
        help="serve /docs, /redoc and /openapi.json without an inference key (default: "
        "behind the inference key when keys are set)",
    )
    serve.add_argument(
        "--overload-log-interval-s",
        type=float,
        help="requests refused as overloaded are summed up in one WARNING line at most this "
        f"often, not logged one by one (default: {_default('overload_log_interval_s'):g})",
    )
    serve.add_argument(
        "--request-timeout-s",
        type=float,
        help="deadline of a chat or completions request, admission queue included; past it "
        "408 (or an error frame once streaming); a request's X-Request-Timeout header "
        "overrides it (default: none)",
    )
    serve.add_argument(
        "--max-request-timeout-s",
        type=float,
        help="largest X-Request-Timeout honoured; larger values are lowered to it "
        "(default: none, any)",
    )
    serve.add_argument(
        "--preprocess-workers",
        type=int,
        help="threads rendering chat templates and tokenizing large prompts off the event "
        f"loop (default: {_default('preprocess_workers')})",
    )
    serve.add_argument(
        "--max-chars-per-token",
        type=float,
        help="prompts longer than context length x this many characters get 400 before "
        "tokenizing (default: the longest token of the model's vocabulary, in characters)",
    )
    serve.add_argument(
        "--loop",
        dest="event_loop",
        choices=["auto", "asyncio", "uvloop"],
        help="event loop of the server; auto: uvloop where it is installed, else asyncio "
        f"(default: {_default('event_loop')})",
    )
    _add_media_fetch_flags(serve)
    serve.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="export traces over OTLP/HTTP to this collector (e.g. http://127.0.0.1:4318; "
        "/v1/traces is appended); OTEL_EXPORTER_OTLP_ENDPOINT also turns tracing on; needs "
        "pip install 'penstock[tracing]' (default: off)",
    )
    serve.add_argument(
        "--otlp-service-name",
        help="service.name of the exported spans (default: $OTEL_SERVICE_NAME, else "
        f"{DEFAULT_SERVICE_NAME})",
    )
    serve.add_argument(
        "--trust-weight-payloads",
        action="store_const",
        const=True,
        help="accept pickled update_weights_from_tensor payloads (verl/slime's "
        "MultiprocessingSerializer); unpickling runs code the sender chose, so only for "
        "trainers you trust (default: off, safetensors payloads only; pickled ones get 400)",
    )
    _add_ray_flags(serve)
    return parser


def _add_ray_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--ray",
        action="store_const",
        const=True,
        help="run the engine as a Ray Serve deployment of replicas behind this gateway; "
        "needs pip install 'penstock[ray]' (default: off, the engine runs in this process)",
    )
    serve.add_argument(
        "--ray-address",
        help="Ray cluster to join (auto, or ray://host:10001) (default: start a local one)",
    )
    serve.add_argument(
        "--ray-app-name",
        help=f"name of the Ray Serve application (default: {_default('ray_app_name')})",
    )
    serve.add_argument(
        "--ray-replicas",
        type=int,
        help=f"engine replicas, or the initial count when autoscaling "
        f"(default: {_default('ray_replicas')})",
    )
    serve.add_argument(
        "--ray-replica-cpus",
        type=float,
        help=f"CPUs reserved per replica (default: {_default('ray_replica_cpus'):g})",
    )
    serve.add_argument(
        "--ray-replica-gpus",
        type=float,
        help=f"GPUs reserved per replica (default: {_default('ray_replica_gpus'):g})",
    )
    serve.add_argument(
        "--ray-min-replicas",
        type=int,
        help="autoscale on ongoing requests, down to this many replicas (default: no autoscaling)",
    )
    serve.add_argument(
        "--ray-max-replicas",
        type=int,
        help="autoscale on ongoing requests, up to this many replicas (default: no autoscaling)",
    )
    serve.add_argument(
        "--ray-target-ongoing-requests",
        type=float,
        help="ongoing requests per replica the autoscaler aims for "
        f"(default: {_default('ray_target_ongoing_requests'):g})",
    )
    serve.add_argument(
        "--ray-affinity-prefix-tokens",
        type=int,
        help="requests without a session key (X-Session-Id header or user field) prefer "
        "one replica per this many leading prompt tokens; 0 turns prefix affinity off "
        f"(default: {_default('ray_affinity_prefix_tokens')})",
    )
    serve.add_argument(
        "--ray-affinity-max-imbalance",
        type=int,
        help="a request leaves its preferred replica for the least-loaded one when the "
        "preferred has more than this many ongoing requests beyond it "
        f"(default: {_default('ray_affinity_max_imbalance')})",
    )


def _add_media_fetch_flags(serve: argparse.ArgumentParser) -> None:
    """Where media URLs in requests may be fetched from, and how (penstock.http)."""
    serve.add_argument(
        "--media-allow-http",
        action="store_const",
        const=True,
        help="let media URLs use plain http (default: https only)",
    )
    for flag, dest, what in (
        (
            "--allowed-media-domain",
            "allowed_media_domains",
            "host media may come from, with its subdomains, repeatable (default: any public host)",
        ),
        (
            "--allowed-media-network",
            "allowed_media_networks",
            "CIDR range exempt from the private/internal address block, repeatable (default: none)",
        ),
        (
            "--allowed-local-media-path",
            "allowed_local_media_paths",
            "folder file:// media may "
            "be read from, repeatable (default: none, local files are refused)",
        ),
    ):
        serve.add_argument(flag, dest=dest, action="append", metavar="VALUE", help=what)
    for flag, field, what in (
        ("--media-fetch-timeout-s", "media_fetch_timeout_s", "bound on one media fetch"),
        ("--media-fetch-max-mb", "media_fetch_max_mb", "larger media downloads fail"),
        ("--media-max-data-url-mb", "media_max_data_url_mb", "larger data: URLs are refused"),
        ("--http-connect-timeout-s", "http_connect_timeout_s", "media fetch connect timeout"),
        ("--http-keepalive-timeout-s", "http_keepalive_timeout_s", "idle pooled connection"),
    ):
        serve.add_argument(flag, type=float, help=f"{what} (default: {_default(field):g})")
    serve.add_argument(
        "--http-timeout-s",
        type=float,
        help="replaces every media fetch's total timeout (default: none)",
    )
    serve.add_argument(
        "--http-max-connections",
        type=int,
        help=f"media fetch connection pool size (default: {_default('http_max_connections')})",
    )
    serve.add_argument(
        "--http-backend",
        choices=["httpx", "aiohttp"],
        help=f"media fetch library (default: {_default('http_backend')})",
    )
    for flag, field, what in (
        ("--media-max-images-per-request", "media_max_images_per_request", "image parts"),
        ("--media-max-audio-per-request", "media_max_audio_per_request", "audio parts"),
    ):
        serve.add_argument(
            flag,
            type=int,
            help=f"{what} one chat request may carry; more get 400 (default: {_default(field)})",
        )
    serve.add_argument(
        "--media-max-image-pixels",
        type=int,
        help="width x height of one image in a request; larger ones get 413 before their "
        f"pixels are decoded (default: {_default('media_max_image_pixels')})",
    )
    serve.add_argument(
        "--media-max-audio-s",
        type=float,
        help="seconds of one audio clip in a request; longer ones get 413 "
        f"(default: {_default('media_max_audio_s'):g})",
    )


def _engine_help(own: list[str]) -> str | None:
    """The options section of the engine ``serve --help`` is about; None without --help."""
    if own[:1] != ["serve"] or not {"-h", "--help"} & set(own[1:]):
        return None
    choice = argparse.ArgumentParser(add_help=False)
    choice.add_argument("--engine")
    spec = (
        choice.parse_known_args(own[1:])[0].engine
        or os.environ.get("PENSTOCK_ENGINE")
        or str(_default("engine"))
    )
    options = textwrap.indent(engine_options_help(spec), "  ")
    return f"options of --engine {spec} (pass them after --):\n{options}"


def _export_model_cache(settings: Settings) -> None:
    """Put the engine's model cache under a cache folder the user chose, unless they placed
    the model cache themselves; engines read it from the environment."""
    if "cache_dir" in settings.model_fields_set and not os.environ.get(MODEL_CACHE_ENV):
        os.environ[MODEL_CACHE_ENV] = str(Path(settings.cache_dir).expanduser() / "models")


def _split_engine_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    own, engine_args = _split_engine_args(list(sys.argv[1:] if argv is None else argv))
    args = _parser(_engine_help(own)).parse_args(own)
    overrides: dict[str, Any] = {
        key: value for key, value in vars(args).items() if key != "command" and value is not None
    }
    if engine_args:
        overrides["engine_args"] = engine_args
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        print(f"penstock: invalid settings: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    _export_model_cache(settings)
    from penstock.app.server import event_loop_factory, serve

    try:
        loop_factory = event_loop_factory(settings.event_loop)
    except ImportError:
        print("penstock: error: --loop uvloop: uvloop is not installed", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            requests_cut = runner.run(serve(settings))
    except EngineLoadError as exc:
        print(f"penstock: error: {exc}", file=sys.stderr)
        return 2
    except (
        JobDatabaseError,
        ListenError,
        MediaStoreError,
        RaySetupError,
        TracingSetupError,
    ) as exc:
        print(f"penstock: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except SystemExit:
        raise
    except Exception as exc:
        logging.getLogger("penstock").debug("startup failed", exc_info=True)
        print(f"penstock: engine failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return EXIT_REQUESTS_CUT if requests_cut else 0


if __name__ == "__main__":
    sys.exit(main())

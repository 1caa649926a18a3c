"""``penstock serve``: the command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from pydantic import ValidationError

from penstock.app.logs import configure_logging
from penstock.engines.loading import BUILTIN_ENGINES
from penstock.errors import EngineLoadError, ListenError
from penstock.preprocess.tool_calls import TOOL_CALL_PARSERS
from penstock.settings import Settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="penstock", description="OpenAI-compatible inference gateway and admin API."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="start the gateway on an engine",
        description=(
            "Start the gateway. Options default to PENSTOCK_* environment variables. "
            "Arguments after '--' go to the engine unchanged."
        ),
    )
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument(
        "--engine",
        help=f"built-in engine ({', '.join(sorted(BUILTIN_ENGINES))}; default transformers) "
        "or package.module:Class",
    )
    serve.add_argument("--model", help="model path or name, forwarded to the engine")
    serve.add_argument("--tokenizer", help="folder with tokenizer.json and chat template")
    serve.add_argument("--served-model-name", help="name clients use in 'model'")
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="turn tool calls the model writes into OpenAI tool_calls",
    )
    serve.add_argument(
        "--api-key", dest="api_keys", action="append", help="inference key (repeatable)"
    )
    serve.add_argument(
        "--admin-api-key", dest="admin_api_keys", action="append", help="admin key (repeatable)"
    )
    serve.add_argument("--max-body-mb", type=float)
    serve.add_argument("--sse-keepalive-s", type=float, help="idle SSE comment interval; 0 = off")
    serve.add_argument("--graceful-shutdown-s", type=float, help="drain budget on SIGTERM")
    serve.add_argument("--health-check-payload", help="canary JSON or @file; replaces the engine's")
    serve.add_argument(
        "--allow-unknown-fields",
        action="store_const",
        const=True,
        help="ignore unknown request fields instead of rejecting them",
    )
    serve.add_argument("--max-n", type=int)
    serve.add_argument("--max-concurrency", type=int, help="engine requests running at once")
    serve.add_argument("--max-queue", type=int, help="requests waiting beyond that")
    serve.add_argument("--overload-status", type=int, help="status when both are full (529)")
    serve.add_argument("--cache-dir")
    serve.add_argument("--media-store", help="folder or fsspec URL for generated media")
    serve.add_argument("--media-workers", type=int)
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="json: one JSON object per line, fixed keys (default: text)",
    )
    serve.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        help="one line per request on the penstock.access logger: method, route, status, "
        "duration, request id, tokens (default: on)",
    )
    return parser


def _split_engine_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    own, engine_args = _split_engine_args(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_args(own)
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
    from penstock.app.server import serve

    try:
        asyncio.run(serve(settings))
    except EngineLoadError as exc:
        print(f"penstock: error: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())

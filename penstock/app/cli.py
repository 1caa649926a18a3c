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
from penstock.options import add_arguments, markdown_table
from penstock.preprocess.tool_calls import TOOL_CALL_PARSERS
from penstock.settings import MODEL_CACHE_ENV, Settings
from penstock.tracing import DEFAULT_SERVICE_NAME

# The exit status when the grace period of a shutdown ran out and open requests were cut;
# a second signal exits with 128 + its number instead (130 for SIGINT).
EXIT_REQUESTS_CUT = 3


# What the options' help names that only this layer knows.
HELP_CONTEXT: dict[str, object] = {
    "engines": ", ".join(sorted(BUILTIN_ENGINES)),
    "exit_requests_cut": EXIT_REQUESTS_CUT,
    "service_name": DEFAULT_SERVICE_NAME,
    "tool_call_parsers": TOOL_CALL_PARSERS,
}


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
    add_arguments(serve, Settings, HELP_CONTEXT)
    return parser


def settings_table() -> str:
    """The README's settings table, from the same declarations as the options."""
    return markdown_table(Settings, HELP_CONTEXT)


def _engine_help(own: list[str]) -> str | None:
    """The options section of the engine ``serve --help`` is about; None without --help."""
    if own[:1] != ["serve"] or not {"-h", "--help"} & set(own[1:]):
        return None
    choice = argparse.ArgumentParser(add_help=False)
    choice.add_argument("--engine")
    spec = (
        choice.parse_known_args(own[1:])[0].engine
        or os.environ.get("PENSTOCK_ENGINE")
        or str(Settings.model_fields["engine"].default)
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

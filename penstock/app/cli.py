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

from penstock import __version__
from penstock.app.logs import configure_logging
from penstock.app.startup_checks import (
    HubModelNotCached,
    resolve_hub_model,
    unused_key_variables,
)
from penstock.engines.builtin_options import BUILTIN_ENGINES, vllm_only_options
from penstock.engines.engine_options import (
    ENGINE_ARGV,
    MISPLACED,
    add_forwarded_options,
    add_misplaced_options,
    other_engines_options,
)
from penstock.engines.engine_options import markdown_table as engine_markdown_table
from penstock.errors import (
    EngineLoadError,
    JobDatabaseError,
    ListenError,
    MediaStoreError,
    RaySetupError,
    TracingSetupError,
)
from penstock.options import add_arguments, declared_options, markdown_table
from penstock.preprocess.tool_calls import TOOL_CALL_PARSERS
from penstock.settings import MODEL_CACHE_ENV, Settings
from penstock.tracing import DEFAULT_SERVICE_NAME

# The exit status when the grace period of a shutdown ran out and open requests were cut;
# a second signal exits with 128 + its number instead (130 for SIGINT).
EXIT_REQUESTS_CUT = 3
# Where the positional MODEL lands, and the parsed names that are not settings.
MODEL_TAG = "model_tag"
SPECIAL_DESTS = {"command", MODEL_TAG, ENGINE_ARGV, MISPLACED}
DEST_PREFIXES = ("engine.", "misplaced.")


# What the options' help names that only this layer knows.
HELP_CONTEXT: dict[str, object] = {
    "engines": ", ".join(sorted(BUILTIN_ENGINES)),
    "exit_requests_cut": EXIT_REQUESTS_CUT,
    "service_name": DEFAULT_SERVICE_NAME,
    "tool_call_parsers": TOOL_CALL_PARSERS,
}
SERVE_DESCRIPTION = (
    "Start the gateway. Each option defaults to its PENSTOCK_* environment variable\n"
    "(--max-n: PENSTOCK_MAX_N), then to the default shown. The selected engine's options\n"
    "are listed last; they are also accepted after '--', which hands what follows to\n"
    "the engine unchanged."
)


def _parser(spec: str, wants_help: bool) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command line with engine ``spec``'s options: a built-in engine's as options of
    ``serve``, with every other engine's and vLLM's refused by name; a class engine's
    help (asked of the engine, ``wants_help`` only) after the gateway's. Returns the
    command line and its ``serve`` command."""
    parser = argparse.ArgumentParser(
        prog="penstock", description="OpenAI-compatible inference gateway and admin API."
    )
    parser.add_argument("--version", action="version", version=f"penstock {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    builtin = BUILTIN_ENGINES.get(spec)
    serve = commands.add_parser(
        "serve",
        help="start the gateway on an engine",
        usage="%(prog)s [MODEL] [options] [-- ENGINE_ARGUMENTS ...]",
        # Raw: the engine's help keeps its own layout. The description is wrapped by hand.
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=SERVE_DESCRIPTION,
        epilog=_class_engine_help(spec) if wants_help and builtin is None else None,
    )
    serve.add_argument(
        MODEL_TAG,
        nargs="?",
        metavar="MODEL",
        help="model path or Hugging Face hub id, as --model",
    )
    add_arguments(serve, Settings, HELP_CONTEXT)
    # A class engine's options are its own business, after --.
    if builtin is not None:
        taken = _gateway_names()
        add_forwarded_options(serve, builtin, taken)
        taken |= {name for option in builtin.options for name in option.names}
        if not builtin.takes_other_options:
            others = other_engines_options(list(BUILTIN_ENGINES.values()), spec)
            add_misplaced_options(serve, [*others, *vllm_only_options()], taken)
    return parser, serve


def _gateway_names() -> set[str]:
    names = {"-h", "--help"}
    for declared in declared_options(Settings):
        if declared.flag is not None:
            names |= {declared.flag, "--no-" + declared.flag.removeprefix("--")}
    return names


def settings_table() -> str:
    """The README's settings table, from the same declarations as the options."""
    return markdown_table(Settings, HELP_CONTEXT)


def engine_options_table() -> str:
    """The README's engine options table, from the engines' declarations."""
    return engine_markdown_table(list(BUILTIN_ENGINES.values()))


def _chosen_engine(own: list[str]) -> str:
    """The engine the command line, else ``PENSTOCK_ENGINE``, else the default selects."""
    choice = argparse.ArgumentParser(add_help=False)
    choice.add_argument("--engine")
    return (
        choice.parse_known_args(own[1:])[0].engine
        or os.environ.get("PENSTOCK_ENGINE")
        or str(Settings.model_fields["engine"].default)
    )


def _class_engine_help(spec: str) -> str:
    """The options section of a class engine, as the engine prints them."""
    from penstock.engines.loading import engine_options_help

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


def _parse(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The settings given on the command line, and the engine's own arguments: the engine
    options given on ``serve``, then everything after ``--``. A wrong command line prints
    why and exits 2."""
    own, after_dash = _split_engine_args(argv)
    spec = _chosen_engine(own)
    wants_help = own[:1] == ["serve"] and bool({"-h", "--help"} & set(own))
    parser, serve = _parser(spec, wants_help)
    args, unknown = parser.parse_known_args(own)
    refused = getattr(args, MISPLACED, None)
    if refused:
        serve.error("; ".join(refused))
    given = vars(args)
    engine_own: list[str] = []
    if unknown:
        typed = _as_typed(own, unknown, given.get(MODEL_TAG))
        builtin = BUILTIN_ENGINES.get(spec)
        if builtin is None or not builtin.takes_other_options:
            hint = _unknown_hint(spec, typed)
            serve.error(f"unrecognized arguments: {' '.join(typed)}; {hint}")
        if len(typed) > len(unknown):
            # The value of an engine option, taken for MODEL.
            given[MODEL_TAG] = None
        engine_own = typed
    overrides = {
        key: value
        for key, value in given.items()
        if value is not None and key not in SPECIAL_DESTS and not key.startswith(DEST_PREFIXES)
    }
    model_tag = given.get(MODEL_TAG)
    if model_tag is not None:
        if overrides.get("model", model_tag) != model_tag:
            serve.error(f"the model is given twice: {model_tag} and --model {overrides['model']}")
        overrides["model"] = model_tag
    return overrides, [*(getattr(args, ENGINE_ARGV, None) or []), *engine_own, *after_dash]


def _as_typed(own: list[str], unknown: list[str], model_tag: str | None) -> list[str]:
    """The unrecognized arguments as typed: the value after an unknown option was taken
    for the positional MODEL, and belongs back after it."""
    for index, token in enumerate(own[:-1]):
        if token in unknown and "=" not in token and own[index + 1] == model_tag:
            at = unknown.index(token) + 1
            return [*unknown[:at], own[index + 1], *unknown[at:]]
    return unknown


def _unknown_hint(spec: str, unknown: list[str]) -> str:
    if spec in BUILTIN_ENGINES:
        return (
            f"neither the gateway nor the {spec} engine takes them "
            f"(penstock serve --engine {spec} --help lists both)"
        )
    return (
        f"options of the engine {spec} go after --: "
        f"penstock serve --engine {spec} -- {' '.join(unknown)}"
    )


def main(argv: list[str] | None = None) -> int:
    overrides, engine_args = _parse(list(sys.argv[1:] if argv is None else argv))
    if engine_args:
        overrides["engine_args"] = engine_args
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        print(f"penstock: invalid settings: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    try:
        settings = resolve_hub_model(settings, BUILTIN_ENGINES.get(settings.engine))
    except HubModelNotCached as exc:
        print(f"penstock: error: {exc}", file=sys.stderr)
        return 2
    for warning in unused_key_variables(settings, set(overrides), os.environ):
        logging.getLogger("penstock").warning("%s", warning)
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

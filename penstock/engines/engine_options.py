"""Engine options declared once, as data: each built-in engine's own command line, the
options ``penstock serve`` takes for it directly, its part of ``--help``, the README's
engine options table and the error for an option the chosen engine does not take are all
derived from these declarations (:mod:`penstock.engines.builtin_options` holds them).

Nothing here imports an engine: ``penstock serve --help`` reads them without torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class EngineOption:
    """One option of an engine's command line.

    ``kind``: ``value`` takes one argument, ``switch`` turns something on, ``negatable``
    has a ``--no-`` form too. ``shown_default``: the default as the help shows it; unset,
    ``default`` written out. ``exclusive``: options sharing this name may not be given
    together. ``aliases``: other names the engine takes for it (vLLM's, or older ones).
    """

    flag: str
    help: str
    kind: Literal["value", "switch", "negatable"] = "value"
    type: Callable[[str], Any] = str
    default: Any = None
    shown_default: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    required: bool = False
    exclusive: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def names(self) -> tuple[str, ...]:
        """Every spelling typed on a command line, ``--no-`` forms included."""
        names = (self.flag, *self.aliases)
        if self.kind == "negatable":
            names += tuple("--no-" + name.removeprefix("--") for name in names)
        return names

    def default_text(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        if self.required:
            return "required"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return "none" if self.default is None else str(self.default)

    def help_line(self) -> str:
        return f"{self.help} (default: {self.default_text()})"


@dataclass(frozen=True, slots=True)
class BuiltinEngine:
    """A built-in engine: where its class is, and what its command line takes.

    ``loads_checkpoint``: its ``--model`` is a checkpoint folder, so a Hugging Face hub id
    is looked up in the local hub cache. ``takes_other_options``: every option the gateway
    does not take is the engine's (its own parser checks them), so none is refused as
    another engine's or as a vLLM option.
    """

    name: str
    target: str
    description: str
    options: tuple[EngineOption, ...]
    loads_checkpoint: bool = False
    takes_other_options: bool = False

    def option(self, name: str) -> EngineOption | None:
        return next((option for option in self.options if name in option.names), None)


def engine_parser(engine: BuiltinEngine) -> argparse.ArgumentParser:
    """The engine's own command line (what follows ``--``)."""
    parser = argparse.ArgumentParser(
        prog=f"penstock serve --engine {engine.name} --", description=engine.description
    )
    groups: dict[str, Any] = {}
    for option in engine.options:
        target = _exclusive_group(parser, groups, option) or parser
        target.add_argument(
            option.flag,
            *option.aliases,
            dest=option.dest,
            default=option.default,
            help=option.help_line(),
            required=option.required,
            **_value_kind(option),
        )
    return parser


def _exclusive_group(
    container: Any, groups: dict[str, Any], option: EngineOption
) -> argparse._MutuallyExclusiveGroup | None:
    """The group of options ``option`` excludes, made in ``container`` on first use."""
    if option.exclusive is None:
        return None
    if option.exclusive not in groups:
        groups[option.exclusive] = container.add_mutually_exclusive_group()
    group: argparse._MutuallyExclusiveGroup = groups[option.exclusive]
    return group


def _value_kind(option: EngineOption) -> dict[str, Any]:
    if option.kind == "switch":
        return {"action": "store_true"}
    if option.kind == "negatable":
        return {"action": argparse.BooleanOptionalAction}
    kind: dict[str, Any] = {"type": option.type}
    if option.choices is not None:
        kind["choices"] = option.choices
    if option.metavar is not None or option.choices is None:
        kind["metavar"] = option.metavar or option.dest.upper()
    return kind


ENGINE_ARGV = "engine_argv"
MISPLACED = "misplaced_options"


class _ForwardToEngine(argparse.Action):
    """Keeps an engine option given on ``penstock serve`` as the engine reads it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, ENGINE_ARGV, None) or []
        typed = [] if self.nargs == 0 else [str(values)]
        setattr(namespace, ENGINE_ARGV, [*given, str(option_string), *typed])


class _Misplaced(argparse.Action):
    """Remembers an option the chosen engine does not take, with the reason (the help
    slot holds it: these options are hidden from ``--help``)."""

    def __init__(self, *args: Any, reason: str, **kwargs: Any) -> None:
        super().__init__(*args, help=argparse.SUPPRESS, **kwargs)
        self.reason = reason

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        found = getattr(namespace, MISPLACED, None) or []
        setattr(namespace, MISPLACED, [*found, f"{option_string} {self.reason}"])


def add_forwarded_options(
    parser: argparse.ArgumentParser, engine: BuiltinEngine, taken: set[str]
) -> None:
    """``engine``'s options as ``penstock serve`` options, in a section of their own; an
    option given is handed to the engine as typed. Names in ``taken`` (the gateway's own)
    are left to the gateway."""
    section = parser.add_argument_group(
        f"options of --engine {engine.name} (also accepted after --)",
        description=(
            f"every option the gateway does not take goes to the {engine.name} engine, "
            "whose own parser checks it"
            if engine.takes_other_options
            else None
        ),
    )
    groups: dict[str, Any] = {}
    for option in engine.options:
        names = [name for name in (option.flag, *option.aliases) if name not in taken]
        if not names:
            continue
        target = _exclusive_group(section, groups, option) or section
        kind = _value_kind(option)
        if option.kind != "value":
            kind = {"nargs": 0}
            if option.kind == "negatable":
                names += ["--no-" + name.removeprefix("--") for name in names]
        target.add_argument(
            *names,
            dest=f"engine.{option.dest}",
            action=_ForwardToEngine,
            default=None,
            help=option.help_line(),
            **kind,
        )


def add_misplaced_options(
    parser: argparse.ArgumentParser,
    reasons: Iterable[tuple[str, bool, str]],
    taken: set[str],
) -> None:
    """Hidden options that only say why they are refused: ``(name, takes_value,
    reason)``, the first reason for a name kept."""
    for name, takes_value, reason in reasons:
        if name in taken:
            continue
        taken.add(name)
        parser.add_argument(
            name,
            dest=f"misplaced.{name}",
            action=_Misplaced,
            nargs=None if takes_value else 0,
            reason=reason,
        )


def other_engines_options(
    engines: Sequence[BuiltinEngine], chosen: str
) -> Iterable[tuple[str, bool, str]]:
    """Each option of the built-in engines other than ``chosen``, and why it is refused
    here: the engines it belongs to."""
    owners: dict[str, tuple[bool, list[str]]] = {}
    for engine in engines:
        if engine.name == chosen:
            continue
        for option in engine.options:
            for name in option.names:
                owners.setdefault(name, (option.kind == "value", []))[1].append(engine.name)
    for name, (takes_value, names) in owners.items():
        owner = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        yield (
            name,
            takes_value,
            f"is an option of the {owner} engine{'s' if len(names) > 1 else ''}; this "
            f"server runs the {chosen} engine (--engine {names[0]} to use it)",
        )


def markdown_table(engines: Sequence[BuiltinEngine]) -> str:
    """The README's engine options table: one row per option and engine."""
    rows = ["| `--engine` | option | default | meaning |", "|---|---|---|---|"]
    for engine in engines:
        for option in engine.options:
            names = ", ".join(f"`{name}`" for name in option.names)
            meaning = option.help.replace("|", "\\|")
            default = option.default_text().replace("|", "\\|")
            rows.append(f"| {engine.name} | {names} | {default} | {meaning} |")
    return "\n".join(rows) + "\n"

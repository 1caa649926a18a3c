"""Settings declared once: each field of a settings model carries an :class:`Option` that
gives its command-line flag, help and shown default; the command line
(:func:`add_arguments`) and the README's settings table (:func:`markdown_table`) are both
derived from them, with the ``PENSTOCK_*`` environment variable named after the field.

Help texts may name values only the command line knows (``{engines}``); the caller passes
them as ``context``, and both renderings fill them in the same way.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ENV_PREFIX = "PENSTOCK_"


@dataclass(frozen=True, slots=True)
class Option:
    """How one setting is offered to the operator.

    ``default``: the default as the help shows it; unset, it is written from the field's.
    ``flag``: unset, ``--`` and the field's name with dashes; ``env_only``: no flag at all.
    ``choices``: the values the flag takes, or the name of a ``context`` entry holding
    them; unset, a ``Literal`` field's values. ``negatable``: a boolean with ``--no-`` too
    (other booleans are switches that turn a setting on). ``doc``: the README's meaning
    where it says more than the help line. ``also_env``: another variable read when
    neither the flag nor the ``PENSTOCK_*`` one is set (vLLM's name for the setting).
    """

    help: str
    default: str | None = None
    flag: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | str | None = None
    negatable: bool = False
    env_only: bool = False
    doc: str | None = None
    also_env: str | None = None


@dataclass(frozen=True, slots=True)
class DeclaredOption:
    """A field and its :class:`Option`, with everything derived from the two."""

    field: str
    info: FieldInfo
    option: Option

    @property
    def flag(self) -> str | None:
        if self.option.env_only:
            return None
        return self.option.flag or "--" + self.field.replace("_", "-")

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.field.upper()

    @property
    def value_type(self) -> Any:
        """The field's type without ``None``."""
        annotation = self.info.annotation
        if get_origin(annotation) in (Union, types.UnionType):
            kept = [arg for arg in get_args(annotation) if arg is not type(None)]
            return kept[0] if len(kept) == 1 else annotation
        return annotation

    def shown_default(self, context: Mapping[str, Any]) -> str:
        if self.option.default is not None:
            return self.option.default.format(**context)
        value = self.info.get_default(call_default_factory=True)
        if value is None or value == []:
            return "none"
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, float):
            return f"{value:g}"
        if isinstance(value, list):
            return ",".join(str(item) for item in value)
        if isinstance(value, Path):
            return _home_relative(value)
        return str(value)

    def help(self, context: Mapping[str, Any]) -> str:
        """The help line: what the option does, then its default."""
        return f"{self.option.help.format(**context)} (default: {self.shown_default(context)})"

    def choices(self, context: Mapping[str, Any]) -> tuple[str, ...] | None:
        choices = self.option.choices
        if isinstance(choices, str):
            return tuple(context[choices])
        if choices is None and get_origin(self.value_type) is Literal:
            return get_args(self.value_type)
        return choices


def declared_options(model: type[BaseModel]) -> Iterator[DeclaredOption]:
    """The model's fields that carry an :class:`Option`, in declaration order."""
    for name, info in model.model_fields.items():
        option = next((item for item in info.metadata if isinstance(item, Option)), None)
        if option is not None:
            yield DeclaredOption(name, info, option)


def with_also_env(
    model: type[BaseModel], data: dict[str, Any], environ: Mapping[str, str]
) -> dict[str, Any]:
    """``data`` with each unset field that declares ``also_env`` read from that variable."""
    filled = dict(data)
    for declared in declared_options(model):
        name = declared.option.also_env
        if name is not None and declared.field not in filled and environ.get(name, "").strip():
            filled[declared.field] = environ[name]
    return filled


def add_arguments(
    parser: argparse.ArgumentParser, model: type[BaseModel], context: Mapping[str, Any]
) -> None:
    """One flag per declared option; a flag left out parses as None (the field's own
    default, or its environment variable, applies)."""
    for declared in declared_options(model):
        if declared.flag is not None:
            parser.add_argument(
                declared.flag,
                dest=declared.field,
                help=declared.help(context),
                **_argument_kind(declared, context),
            )


def _argument_kind(declared: DeclaredOption, context: Mapping[str, Any]) -> dict[str, Any]:
    option, value_type = declared.option, declared.value_type
    if get_origin(value_type) is list:
        return {"action": "append", "metavar": option.metavar or "VALUE"}
    if value_type is bool:
        if option.negatable:
            return {"action": argparse.BooleanOptionalAction}
        return {"action": "store_const", "const": True}
    kind: dict[str, Any] = {}
    if value_type in (int, float):
        kind["type"] = value_type
    if option.metavar is not None:
        kind["metavar"] = option.metavar
    choices = declared.choices(context)
    if choices is not None:
        kind["choices"] = choices
    return kind


def markdown_table(model: type[BaseModel], context: Mapping[str, Any]) -> str:
    """The README's settings table: every declared option, its variable, default and
    meaning, one row each."""
    rows = ["| option | environment variable | default | meaning |", "|---|---|---|---|"]
    for declared in declared_options(model):
        flag = f"`{declared.flag}`" if declared.flag else "(none)"
        if declared.flag and get_origin(declared.value_type) is list:
            flag += " (repeatable)"
        elif declared.flag and declared.option.negatable:
            flag = f"`{declared.flag}`, `--no-{declared.flag[2:]}`"
        meaning = (declared.option.doc or declared.option.help).format(**context)
        default = declared.shown_default(context)
        variables = f"`{declared.env_var}`"
        if declared.option.also_env is not None:
            variables += f", `{declared.option.also_env}`"
        rows.append(f"| {flag} | {variables} | {_cell(default)} | {_cell(meaning)} |")
    return "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    """``text`` as one table cell: ``|`` escaped, and ``<`` outside code spans, where
    Markdown would take ``<cache-dir>`` for an HTML tag."""
    pieces = text.replace("|", "\\|").split("`")
    pieces[::2] = [piece.replace("<", "\\<") for piece in pieces[::2]]
    return "`".join(pieces)


def _home_relative(path: Path) -> str:
    """A path under the home folder as ``~/...``: the same on every machine."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)

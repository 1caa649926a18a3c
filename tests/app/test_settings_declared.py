"""Each setting is declared once, on its ``Settings`` field: ``penstock serve --help`` and
the README's settings table are derived from the declarations and held against them here."""

from __future__ import annotations

import pytest

from penstock.app.cli import HELP_CONTEXT, engine_options_table, main, settings_table
from penstock.engines.builtin_options import BUILTIN_ENGINES, POOLING_METHODS
from penstock.engines.engine_options import engine_parser
from penstock.options import ENV_PREFIX, declared_options
from penstock.settings import Settings
from tests.e2e.test_cli import option_help
from tests.support.server import REPO_ROOT

README = REPO_ROOT / "README.md"
# Filled from what follows ``--`` on the command line, not an option of its own.
NOT_OPTIONS = {"engine_args"}
REGENERATE = (
    "regenerate it: README's table between '### Settings' and the next blank line is "
    "penstock.app.cli.settings_table()"
)


def readme_table_span(text: str, heading: str = "Settings") -> tuple[int, int]:
    """Where the table under ``### heading`` sits in the README: its first line to past
    its last."""
    section = text.index(f"\n### {heading}\n")
    start = text.index("\n| ", section) + 1
    end = text.index("\n\n", start) + 1
    return start, end


def serve_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--engine", "sample", "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out.split("\noptions:\n", 1)[1].split("\noptions of --engine", 1)[0]


def test_every_setting_is_declared_with_an_option() -> None:
    declared = {option.field for option in declared_options(Settings)}
    assert set(Settings.model_fields) - declared == NOT_OPTIONS
    assert Settings.model_config["env_prefix"] == ENV_PREFIX
    assert all(info.alias is None for info in Settings.model_fields.values())


def test_serve_help_lists_each_declared_flag_with_its_help_and_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    entries = option_help(serve_help(capsys))
    entries.pop("-h, --help")
    by_flag = {names.split(",")[0].split(" ")[0]: text for names, text in entries.items()}
    flagged = [option for option in declared_options(Settings) if option.flag is not None]
    assert sorted(by_flag) == sorted(option.flag for option in flagged)
    for option in flagged:
        help_text = " ".join(option.help(HELP_CONTEXT).split())
        assert by_flag[option.flag] == help_text, option.flag
        assert help_text.endswith(f"(default: {option.shown_default(HELP_CONTEXT)})")


def test_readme_settings_table_is_the_declared_one() -> None:
    text = README.read_text()
    start, end = readme_table_span(text)
    assert text[start:end] == settings_table(), REGENERATE


def test_readme_table_names_every_setting_with_its_variable_and_default() -> None:
    rows = settings_table().splitlines()[2:]
    options = list(declared_options(Settings))
    assert len(rows) == len(options)
    for row, option in zip(rows, options, strict=True):
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        also = [] if option.option.also_env is None else [f"`{option.option.also_env}`"]
        assert cells[1].split(", ") == [f"`{option.env_var}`", *also]
        assert cells[2].replace("\\<", "<") == option.shown_default(HELP_CONTEXT)
        if option.flag is not None:
            assert cells[0].startswith(f"`{option.flag}`")


def test_readme_engine_options_table_is_the_declared_one() -> None:
    text = README.read_text()
    start, end = readme_table_span(text, "Engine options")
    assert text[start:end] == engine_options_table(), (
        "regenerate it: README's table under '### Engine options' is "
        "penstock.app.cli.engine_options_table()"
    )


@pytest.mark.parametrize("name", sorted(BUILTIN_ENGINES))
def test_serve_help_lists_each_declared_engine_option(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["serve", "--engine", name, "--help"])
    heading = f"\noptions of --engine {name} (also accepted after --):\n"
    entries = option_help(capsys.readouterr().out.split(heading, 1)[1])
    by_flag = {names.split(" ")[0].rstrip(","): text for names, text in entries.items()}
    gateway = {option.flag for option in declared_options(Settings)}
    for option in BUILTIN_ENGINES[name].options:
        if option.flag not in gateway:
            # argparse wraps long lines at hyphens too: compared without white space.
            shown = "".join(by_flag[option.flag].split())
            assert shown == "".join(option.help_line().split()), option.flag


@pytest.mark.parametrize("name", sorted(BUILTIN_ENGINES))
def test_each_engine_reads_what_its_declarations_say(name: str) -> None:
    engine = BUILTIN_ENGINES[name]
    parsed = engine_parser(engine).parse_args(
        [arg for option in engine.options if option.required for arg in (option.flag, "x")]
    )
    for option in engine.options:
        if not option.required:
            assert getattr(parsed, option.dest) == option.default, option.flag


def test_the_pooling_methods_declared_are_the_engines() -> None:
    from penstock.engines.transformers.pooling_config import POOLINGS

    assert POOLING_METHODS == ("auto", *POOLINGS)

"""Each setting is declared once, on its ``Settings`` field: ``penstock serve --help`` and
the README's settings table are derived from the declarations and held against them here."""

from __future__ import annotations

import pytest

from penstock.app.cli import HELP_CONTEXT, main, settings_table
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


def readme_table_span(text: str) -> tuple[int, int]:
    """Where the settings table sits in the README: its first line to past its last."""
    section = text.index("\n### Settings\n")
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
        assert cells[1] == f"`{option.env_var}`"
        assert cells[2].replace("\\<", "<") == option.shown_default(HELP_CONTEXT)
        if option.flag is not None:
            assert cells[0].startswith(f"`{option.flag}`")

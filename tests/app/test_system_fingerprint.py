"""The ``system_fingerprint`` a server stamps on its generation answers."""

from __future__ import annotations

from penstock import __version__
from penstock.gateway import system_fingerprint
from penstock.settings import Settings


def test_one_configuration_has_one_fingerprint_naming_penstocks_version() -> None:
    first = system_fingerprint(Settings(engine="sample", model="a"))
    assert first == system_fingerprint(Settings(engine="sample", model="a"))
    assert first.startswith(f"penstock-{__version__}-")


def test_another_model_or_engine_argument_changes_the_fingerprint() -> None:
    base = system_fingerprint(Settings(engine="sample", model="a"))
    assert system_fingerprint(Settings(engine="sample", model="b")) != base
    assert system_fingerprint(Settings(engine="sample", model="a", engine_args=["--x"])) != base

"""The API key variables ``penstock serve`` warns of at startup: set, but no key is read
from them."""

from __future__ import annotations

from penstock.app.startup_checks import unused_key_variables
from penstock.settings import Settings


def test_a_key_variable_penstock_does_not_read_is_named_with_the_ones_it_does() -> None:
    [warning] = unused_key_variables(Settings(), set(), {"PENSTOCK_API_KEY": "k", "HOME": "/"})
    assert warning == (
        "PENSTOCK_API_KEY is set but not read (keys come from --api-key, PENSTOCK_API_KEYS, "
        "VLLM_API_KEY; --admin-api-key, PENSTOCK_ADMIN_API_KEYS); the inference routes are "
        "open"
    )


def test_vllm_api_key_is_unused_beside_penstocks_own_keys() -> None:
    settings = Settings(api_keys=["a"])
    environ = {"VLLM_API_KEY": "v"}
    assert unused_key_variables(settings, {"api_keys"}, environ) == [
        "VLLM_API_KEY is set but not used: --api-key gives the keys"
    ]
    environ["PENSTOCK_API_KEYS"] = "a"
    assert unused_key_variables(settings, set(), environ) == [
        "VLLM_API_KEY is set but not used: PENSTOCK_API_KEYS gives the keys"
    ]


def test_the_key_variables_read_are_not_warned_of() -> None:
    environ = {"VLLM_API_KEY": "v", "PENSTOCK_ADMIN_API_KEYS": "a", "OPENAI_API_KEY": "o"}
    assert unused_key_variables(Settings(api_keys=["v"]), set(), environ) == []

"""The errors a client or operator can see share one hierarchy and one envelope."""

from __future__ import annotations

import pytest

from penstock.errors import (
    EngineLoadError,
    InvalidRequestError,
    MediaParamError,
    MediaPassthroughRejected,
    PenstockError,
    PreprocessorLoadError,
    RLAdminValidationError,
    StartupError,
)
from penstock.rl import RLAdminValidationError as SeedName


def test_a_bad_media_value_is_a_400_naming_the_field() -> None:
    error = MediaParamError("nvext.fps", "999 is out of range: use 1 to 60")
    assert error.status_code == 400
    assert error.envelope()["error"] == {
        "message": "nvext.fps: 999 is out of range: use 1 to 60",
        "type": "invalid_request_error",
        "param": "nvext.fps",
        "code": "invalid_request",
    }


def test_rejected_passthrough_keys_name_the_first_one() -> None:
    error = MediaPassthroughRejected(["model_path", "guardrails"])
    assert error.param == "guardrails"
    assert error.code == "unsupported_field"
    assert error.keys == ["guardrails", "model_path"]


@pytest.mark.parametrize("error_type", [MediaParamError, RLAdminValidationError])
def test_validation_errors_are_also_value_errors(error_type: type[PenstockError]) -> None:
    assert issubclass(error_type, InvalidRequestError)
    assert issubclass(error_type, ValueError)


def test_the_rl_seed_name_is_the_same_class() -> None:
    assert SeedName is RLAdminValidationError


@pytest.mark.parametrize("error_type", [EngineLoadError, PreprocessorLoadError])
def test_startup_failures_are_penstock_errors(error_type: type[StartupError]) -> None:
    error = error_type("tokenizer.json is missing")
    assert isinstance(error, PenstockError)
    assert str(error) == "tokenizer.json is missing"

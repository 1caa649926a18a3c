"""Value types the settings share: lists given as ``a,b`` or JSON, finite positive numbers."""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import BeforeValidator, Field
from pydantic_settings import NoDecode


def _split_csv(value: object) -> object:
    """Accept ``a,b`` or a JSON list for list settings given as one string (env vars)."""
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("["):
            return json.loads(stripped)
        return [part.strip() for part in stripped.split(",") if part.strip()]
    return value


CsvList = Annotated[list[str], NoDecode, BeforeValidator(_split_csv)]
FinitePositive = Annotated[float, Field(gt=0, allow_inf_nan=False)]

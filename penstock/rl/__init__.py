"""The RL admin plane: route registry and validation helpers, and the admin state machine."""

from penstock.errors import RLAdminValidationError
from penstock.rl.admin import (
    TRUE_ENV_VALUES,
    RLRouteHandler,
    RLRouteRegistry,
    env_bool,
    first_endpoint_response,
    require_lora_load_request,
    require_lora_unload_request,
)

__all__ = [
    "TRUE_ENV_VALUES",
    "RLAdminValidationError",
    "RLRouteHandler",
    "RLRouteRegistry",
    "env_bool",
    "first_endpoint_response",
    "require_lora_load_request",
    "require_lora_unload_request",
]

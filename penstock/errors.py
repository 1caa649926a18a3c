"""The gateway's exception hierarchy and its OpenAI error envelope.

Every error a client can see is a :class:`PenstockError`; routers raise it, the handlers in
:mod:`penstock.app.handlers` render it as ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

# Values a client sent (model names, ids, field values) are cut to this in messages, and
# ``param`` too; a whole message to the longer bound, so no input is echoed back whole.
MAX_ECHO_CHARS = 256
MAX_MESSAGE_CHARS = 2048


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``value`` as an error message may show it: at most ``limit`` characters, with an
    ellipsis where it was cut."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


class PenstockError(Exception):
    """Base of every client-visible error."""

    status_code = 500
    error_type = "internal_server_error"
    default_code = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        self.param = clip(param) if param is not None else None
        self.code = code or self.default_code
        self.headers = headers or {}
        self.extra = extra or {}

    def envelope(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.code,
        }
        body.update(self.extra)
        return {"error": body}


class InvalidRequestError(PenstockError):
    status_code = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class AuthenticationError(PenstockError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(PenstockError):
    status_code = 403
    error_type = "permission_error"
    default_code = "permission_denied"


class NotFoundError(PenstockError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFoundError(NotFoundError):
    default_code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{clip(model)}' does not exist", param="model")


class ConflictError(PenstockError):
    status_code = 409
    error_type = "conflict_error"
    default_code = "conflict"


class PayloadTooLargeError(PenstockError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"


class UnsupportedMediaTypeError(PenstockError):
    status_code = 415
    error_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class OverloadedError(PenstockError):
    status_code = 529
    error_type = "overloaded_error"
    default_code = "overloaded"


class ServiceUnavailableError(PenstockError):
    status_code = 503
    error_type = "service_unavailable"
    default_code = "service_unavailable"


class InternalServerError(PenstockError):
    status_code = 500
    error_type = "internal_server_error"
    default_code = "internal_error"

    def __init__(self, message: str = "Internal server error", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)


class EngineError(PenstockError):
    """``generate`` raised or broke the contract; the message is safe to show."""

    status_code = 500
    error_type = "internal_server_error"
    default_code = "engine_error"


class ClientClosedRequest(PenstockError):
    """The client went away before the answer (nginx's 499); nobody reads this response."""

    status_code = 499
    error_type = "request_cancelled"
    default_code = "request_cancelled"


class MediaParamError(InvalidRequestError, ValueError):
    """A media request value the model can't honour; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}", param=param)


class MediaPassthroughRejected(InvalidRequestError, ValueError):
    """Some passthrough keys may not be set by clients; ``keys`` lists them, sorted."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = sorted(keys)
        super().__init__(
            "These fields are not accepted on media requests: " + ", ".join(self.keys),
            param=self.keys[0],
            code="unsupported_field",
        )


class RLAdminValidationError(InvalidRequestError, ValueError):
    """Validation error whose message can be returned directly to RL clients.

    A ``ValueError`` too, as in ``dynamo.common.rl``, so callers written for Dynamo catch it.
    """

    default_code = "invalid_value"


class StartupError(PenstockError):
    """The gateway can't start as configured; the message tells the operator what to fix."""

    error_type = "startup_error"
    default_code = "startup_error"


class EngineLoadError(StartupError):
    """The engine named on the command line can't be used; the message says why."""


class PreprocessorLoadError(StartupError):
    """A tokenizer folder is missing, incomplete or unreadable; the message names the file."""


class MediaStoreError(StartupError):
    """``--media-store`` can't hold generated media (a file, an uncreatable folder)."""


class ListenError(StartupError):
    """The address to serve on can't be bound (a busy port, an unknown host)."""


class MetadataUploadError(PenstockError):
    """A rollout record could not be stored. The message is generic on purpose: paths, URLs
    and OS errors stay in the server log."""

    status_code = 500
    error_type = "internal_server_error"
    default_code = "metadata_upload_failed"

    def __init__(self) -> None:
        super().__init__(
            "the request's metadata upload failed; the server log has the details",
        )


class ServerShutdownError(ServiceUnavailableError):
    """The grace period ran out while the request was still open."""

    default_code = "server_shutdown"

    def __init__(self, message: str = "The server is shutting down", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)


class SlowClientError(PenstockError):
    """The client did not send its request headers or its body in time."""

    status_code = 408
    error_type = "request_timeout"
    default_code = "request_timeout"


class GatewayTimeoutError(PenstockError):
    """The engine (or what it depends on) timed out answering the request."""

    status_code = 504
    error_type = "timeout_error"
    default_code = "gateway_timeout"


class DisaggregatedWorkerError(EngineLoadError):
    """The engine is configured as one stage of a disaggregated pipeline (prefill, decode,
    encode), which one gateway process cannot serve alone."""

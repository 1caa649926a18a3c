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


class HeadersTooLargeError(PenstockError):
    """A request line and headers longer than the server reads."""

    status_code = 431
    error_type = "invalid_request_error"
    default_code = "request_headers_too_large"


class UnsupportedMediaTypeError(PenstockError):
    status_code = 415
    error_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class OverloadedError(PenstockError):
    status_code = 529
    error_type = "overloaded_error"
    default_code = "overloaded"


class NotInstalledError(PenstockError):
    """The request needs an optional package this installation lacks; the message says
    what to install."""

    status_code = 501
    error_type = "not_implemented"
    default_code = "not_installed"


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


class RequestTimeoutError(PenstockError):
    """The request's deadline passed before its answer was complete.

    408, as LiteLLM answers its request timeouts and vLLM its step-barrier timeout: the
    deadline is one the client asked for (or the operator set for every client), not an
    upstream failure a 504 would report.
    """

    status_code = 408
    error_type = "timeout_error"
    default_code = "request_timeout"


class MediaParamError(InvalidRequestError, ValueError):
    """A media request value the model can't honour; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}", param=param)


class FieldValueError(InvalidRequestError, ValueError):
    """A request validator's error about one field (often its clash with another), raised
    inside validation; ``param`` names the field, as the 400 then does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message, param=param)


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


class TracingSetupError(StartupError):
    """Tracing is configured but can't run (the ``tracing`` extra is not installed)."""


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


class UrlValidationError(InvalidRequestError, ValueError):
    """A media URL the SSRF policy refuses, or media over its size limit.

    A ``ValueError`` too, as in ``dynamo.common.http``, so callers written for Dynamo catch it.
    """

    default_code = "invalid_media_url"


class HttpError(PenstockError):
    """A media fetch failed. Callers never see the HTTP library's own exceptions."""

    status_code = 400
    error_type = "invalid_request_error"
    default_code = "media_fetch_failed"


class HttpTimeoutError(HttpError):
    """Connecting, reading or the whole fetch took longer than allowed."""

    status_code = 408
    default_code = "media_fetch_timeout"


class HttpConnectionError(HttpError):
    """The media host could not be reached: DNS, refused, reset, closed early."""


class HttpConfigurationError(HttpError):
    """The deployment is set up wrong; never the client's fault, so never a 4xx."""

    status_code = 500
    error_type = "internal_server_error"
    default_code = "internal_error"


class HttpStatusError(HttpError):
    """The media host answered with a non-2xx status (``status``); a 4xx is passed on to the
    client as is, anything else becomes 502."""

    _MESSAGE_LIMIT = 8192

    def __init__(self, status: int, message: str, url: str) -> None:
        if len(message) > self._MESSAGE_LIMIT:
            marker = f" ... ({len(message)} chars) ... "
            kept = self._MESSAGE_LIMIT - len(marker)
            message = f"{message[: kept - kept // 2]}{marker}{message[-(kept // 2) :]}"
        self.status = status
        self.url = url
        self.status_code = status if 400 <= status < 500 else 502
        label = url if len(url) <= 120 else f"{url[:120]}... ({len(url)} chars)"
        if url[:5].lower() == "data:":
            label = f"data:{url[5:].split(',', 1)[0].split(';', 1)[0][:40]} (payload elided)"
        super().__init__(f"HTTP {status} for {label}: {message}")
        self.message = message

    def envelope(self) -> dict[str, Any]:
        body = super().envelope()
        body["error"]["message"] = str(self)
        return body


class GatewayTimeoutError(PenstockError):
    """The engine (or what it depends on) timed out answering the request."""

    status_code = 504
    error_type = "timeout_error"
    default_code = "gateway_timeout"


class DisaggregatedWorkerError(EngineLoadError):
    """The engine is configured as one stage of a disaggregated pipeline (prefill, decode,
    encode), which one gateway process cannot serve alone."""


class RaySetupError(StartupError):
    """``--ray`` is asked for but can't run (Ray Serve is not installed, the cluster can't
    be reached, the engine deployment failed to start)."""


class ReplicaLostError(ServiceUnavailableError):
    """The engine replica running a request died mid-request; the fleet replaces it, so
    the client may retry."""

    default_code = "replica_lost"


class FleetInconsistentError(InternalServerError):
    """A fleet-wide weight update left replicas that disagree on checksum or version, or a
    replica could not be put back; ``error.replicas`` says what each one holds."""

    default_code = "fleet_inconsistent"


class JobDatabaseError(StartupError):
    """``--media-db`` names no usable job database (another backend, a missing driver, a
    server that can't be reached at startup)."""


class JobStoreUnavailableError(ServiceUnavailableError):
    """The job database stopped answering while serving; the request may be retried."""

    default_code = "job_store_unavailable"

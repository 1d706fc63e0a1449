"""Exceptions a user can act on. The server turns them into HTTP errors in one place (server/errors.py)."""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base class. `status` is the HTTP status the server answers with."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(OrchestratorError):
    """The request cannot be served as given (HTTP 400, OpenAI `invalid_request_error`)."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(OrchestratorError):
    """No API key, or the wrong one, on a server started with --api-key (HTTP 401)."""

    status = 401
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


class Forbidden(OrchestratorError):
    """An endpoint that this server's configuration turns off (HTTP 403), e.g. cache administration without
    --api-key."""

    status = 403
    type = "invalid_request_error"


class PayloadTooLarge(InvalidRequest):
    """The request body exceeds --max-body-size (HTTP 413)."""

    status = 413

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"the request body is larger than {limit_bytes} bytes (--max-body-size MiB)",
                         code="request_too_large")


class UnsupportedMediaType(InvalidRequest):
    """The request body is not declared as JSON (HTTP 415)."""

    status = 415


class ContextOverflow(InvalidRequest):
    """The prompt (plus at least one generated token) does not fit in n_ctx."""

    def __init__(self, n_prompt: int, n_ctx: int) -> None:
        super().__init__(
            f"the prompt is {n_prompt} tokens, but the context holds {n_ctx} (--ctx-size) and at least one "
            f"token must be generated; shorten the messages or restart the server with a larger --ctx-size",
            param="messages", code="context_length_exceeded")


class EngineError(OrchestratorError):
    """llama.cpp reported a failure (decode, state restore). The request fails; the server keeps serving."""

    status = 500
    type = "server_error"


class ModelLoadError(OrchestratorError):
    """The model file cannot be loaded."""


class QueueFull(OrchestratorError):
    """Every slot is busy and --queue-size requests are already waiting (HTTP 429 with Retry-After)."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, n_waiting: int, retry_after: int) -> None:
        super().__init__(f"the server is busy: all slots are serving and {n_waiting} requests are queued "
                         f"(--queue-size); retry in about {retry_after} s", code="queue_full")
        self.retry_after = retry_after


class RequestTimeout(OrchestratorError):
    """The request ran past --timeout seconds (queue wait included) and was stopped (HTTP 504)."""

    status = 504
    type = "timeout_error"

    def __init__(self, elapsed_s: float) -> None:
        super().__init__(f"the request was stopped after {elapsed_s:.1f} s (--timeout); retry later, or raise "
                         f"--timeout on the server", code="timeout")


class RequestCancelled(OrchestratorError):
    """The caller went away (client disconnected) before the request finished (nginx's 499)."""

    status = 499
    type = "cancelled"

    def __init__(self) -> None:
        super().__init__("the request was cancelled", code="cancelled")

"""The one place where exceptions become HTTP errors.

OpenAI-style bodies on the OpenAI routes:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "messages[2].role", "code": null}}

`code` is an OrchestratorError's own code (null if it has none); for a request no route matches it is
`not_found` (404) or `method_not_allowed` (405), the code /metrics counts it under.

Anthropic's shape on the Anthropic route (/v1/messages):

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

`error_status` gives the (status, code) that the server counts and logs for every refused or failed request.
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from orchestrator.errors import OrchestratorError

log = logging.getLogger("orchestrator.server")

OPENAI, ANTHROPIC = "openai", "anthropic"

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                    429: "rate_limit_error", 500: "api_error", 504: "timeout_error"}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def _http_code(exc: HTTPException) -> str:
    """The code of an error Starlette raised (no route matches, wrong method): in the body and in the counter."""
    return _HTTP_CODES.get(exc.status_code, "http_error")


class NotFound(OrchestratorError):
    """A resource that does not exist, e.g. GET /v1/models/{id} with another id (HTTP 404)."""

    status = 404
    type = "invalid_request_error"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_payload(exc: Exception) -> tuple[dict, int]:
    """(OpenAI-style body, HTTP status) for any exception: 4xx for the caller's mistakes, 500 otherwise."""
    if isinstance(exc, OrchestratorError):
        return error_body(exc.message, exc.type, exc.param, exc.code), exc.status
    if isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_body(str(exc.detail), kind, code=_http_code(exc)), exc.status_code
    log.exception("unhandled error", exc_info=exc)
    return error_body(f"internal error: {exc}", "server_error"), 500


def anthropic_payload(exc: Exception) -> tuple[dict, int]:
    """(Anthropic-style body, HTTP status): the same status and message as error_payload."""
    body, status = error_payload(exc)
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}, status


def error_status(exc: Exception) -> tuple[int, str]:
    """(HTTP status, a short reason: the error's code, else its type) of a refused or failed request; status
    499 (code "cancelled") is a client that disconnected."""
    if isinstance(exc, OrchestratorError):
        return exc.status, exc.code or exc.type
    if isinstance(exc, HTTPException):
        return exc.status_code, _http_code(exc)
    return 500, "server_error"


def error_response(exc: Exception, flavor: str = OPENAI) -> JSONResponse:
    """The JSON error response in the route's `flavor`; a QueueFull (429) also carries Retry-After in seconds."""
    body, status = (anthropic_payload if flavor == ANTHROPIC else error_payload)(exc)
    retry_after = getattr(exc, "retry_after", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


async def handle(request: Request, exc: Exception) -> JSONResponse:
    """Errors raised outside a route (no route matches: 404; wrong method: 405), counted like the others."""
    record = getattr(request.app.state, "record_failure", None)
    if record is not None:
        record("unmatched", exc)
    return error_response(exc)


EXCEPTION_HANDLERS = {OrchestratorError: handle, HTTPException: handle}

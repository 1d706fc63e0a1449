"""The one place where exceptions become HTTP errors with OpenAI-style bodies:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "messages[2].role", "code": null}}
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from orchestrator.errors import OrchestratorError

log = logging.getLogger("orchestrator.server")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_payload(exc: Exception) -> tuple[dict, int]:
    """(OpenAI-style body, HTTP status) for any exception: 4xx for the caller's mistakes, 500 otherwise."""
    if isinstance(exc, OrchestratorError):
        return error_body(exc.message, exc.type, exc.param, exc.code), exc.status
    if isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_body(str(exc.detail), kind), exc.status_code
    log.exception("unhandled error", exc_info=exc)
    return error_body(f"internal error: {exc}", "server_error"), 500


def error_response(exc: Exception) -> JSONResponse:
    """The JSON error response; a QueueFull (429) also carries Retry-After in seconds."""
    body, status = error_payload(exc)
    retry_after = getattr(exc, "retry_after", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


async def handle(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


EXCEPTION_HANDLERS = {OrchestratorError: handle, HTTPException: handle}

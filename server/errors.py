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


def error_response(exc: Exception) -> JSONResponse:
    """Map any exception to a JSONResponse (4xx for the caller's mistakes, 500 otherwise)."""
    if isinstance(exc, OrchestratorError):
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status)
    if isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)
    log.exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body(f"internal error: {exc}", "server_error"), status_code=500)


async def handle(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


EXCEPTION_HANDLERS = {OrchestratorError: handle, HTTPException: handle}

"""The one shape of every HTTP error the gateway answers: `{"error": {"code", "message"}}`, with the status
the error class carries (gateway/errors.py, core/errors.py)."""

from __future__ import annotations

from starlette.responses import JSONResponse

from core.errors import RequestError


def error_response(exc: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": exc.code, "message": exc.message}}, status_code=exc.http_status, headers=headers)

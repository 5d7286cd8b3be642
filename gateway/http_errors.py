"""The one shape of every HTTP error the gateway answers: `{"error": {"code", "message"}}`."""

from __future__ import annotations

from starlette.responses import JSONResponse


def error_response(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)

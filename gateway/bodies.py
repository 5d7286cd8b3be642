"""Request bodies read with a bound: refused from Content-Length when it says too much, and while streaming
when it lies or is chunked, so a large body is never buffered whole before the size check."""

from __future__ import annotations

from starlette.requests import Request

from core import RequestError


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes. Raises RequestError `too_large` (413) or `bad_request`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError("Content-Length must be a decimal number", code="bad_request")
        if int(declared) > limit:
            raise RequestError(f"body of {declared} bytes exceeds {limit} bytes", code="too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(f"body exceeds {limit} bytes", code="too_large")
    return bytes(body)

"""Request bodies read with a bound: refused from Content-Length when it says too much, and while streaming
when it lies or is chunked, so a large body is never buffered whole before the size check."""

from __future__ import annotations

from starlette.requests import Request

from core.errors import MessageTooLarge

from ..errors import BadRequest


async def read_body(request: Request, limit: int, key: str = "") -> bytes:
    """The body, at most `limit` bytes (the config key `key`, named in the refusal). Raises MessageTooLarge
    (`too_large`, 413) or BadRequest."""
    bound = f"{limit} bytes ({key})" if key else f"{limit} bytes"
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("Content-Length must be a decimal number")
        if int(declared) > limit:
            raise MessageTooLarge(f"body of {declared} bytes exceeds {bound}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise MessageTooLarge(f"body exceeds {bound}")
    return bytes(body)

"""Bodies read with a bound: refused from Content-Length when it says too much, and while streaming when it
lies or is chunked, so a large body is never buffered whole before the size check. Request bodies of the
gateway's clients (`read_body`), and answers to the gateway's own HTTP calls (`read_answer`: the backend's
hooks, a JWKS URL), read undecoded so that no compressed answer is inflated past the bound."""

from __future__ import annotations

import math

import httpx
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


class AnswerRefused(Exception):
    """An answer that is encoded or longer than its bound; the message says which."""


def content_length(response: httpx.Response) -> float | None:
    """The answer's Content-Length, None without one (chunked, or up to the close)."""
    value = response.headers.get("content-length")
    try:
        return None if value is None else int(value)
    except ValueError:  # h11 checked it is digits; a list of them ("5, 5") is as good as too long
        return math.inf


async def read_answer(response: httpx.Response, limit: int, key: str) -> bytes:
    """A streamed answer's body as it comes, undecoded, at most `limit` bytes (the config key or bound `key`,
    named in the refusal). Raises AnswerRefused for an answer with a Content-Encoding, or one longer than
    `limit` (from its Content-Length, or as it comes): the rest is left unread. Ask with `Accept-Encoding:
    identity`."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise AnswerRefused(f"answered with Content-Encoding {encoding[:40]!r}, not identity")
    too_long = AnswerRefused(f"answered more than {limit} bytes ({key})")
    length = content_length(response)
    if length is not None and length > limit:
        raise too_long
    chunks, size = [], 0
    async for chunk in response.aiter_raw():  # raw: never inflated
        size += len(chunk)
        if size > limit:
            raise too_long
        chunks.append(chunk)
    return b"".join(chunks)

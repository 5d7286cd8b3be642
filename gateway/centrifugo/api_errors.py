"""The Centrifugo server API's errors: `{"error": {"code", "message"}}` with Centrifugo's numeric codes, in an
HTTP 200 answer (cent raises `CentApiResponseError` with them; only a wrong key is an HTTP status, 401)."""

from __future__ import annotations

from typing import Any

from core import RequestError

INTERNAL = 100
UNKNOWN_CHANNEL = 102
PERMISSION_DENIED = 103
METHOD_NOT_FOUND = 104
LIMIT_EXCEEDED = 106
BAD_REQUEST = 107
NOT_AVAILABLE = 108
UNRECOVERABLE_POSITION = 112

#: our error codes (docs/protocol.md) as Centrifugo's; any other is a bad request
_BY_OUR_CODE = {
    "unknown_topic": UNKNOWN_CHANNEL,
    "forbidden": PERMISSION_DENIED,
    "too_large": LIMIT_EXCEEDED,
    "too_many_topics": LIMIT_EXCEEDED,
    "too_many_subscriptions": LIMIT_EXCEEDED,
    "queue_full": LIMIT_EXCEEDED,
    "rate_limited": LIMIT_EXCEEDED,
    "disabled": NOT_AVAILABLE,
    "broker_unavailable": INTERNAL,
    "internal_error": INTERNAL,
}


class ApiError(Exception):
    """A method's refusal, answered as `{"error": {"code", "message"}}`."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def of(cls, exc: RequestError) -> ApiError:
        """Our request error as Centrifugo's, the message keeping our code for the record."""
        return cls(_BY_OUR_CODE.get(exc.code, BAD_REQUEST), f"{exc.code}: {exc.message}")

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}


def bad_request(message: str) -> ApiError:
    return ApiError(BAD_REQUEST, message)


def unsupported(field: str, why: str) -> ApiError:
    """A request field this gateway has no notion of: refused rather than silently ignored."""
    return ApiError(BAD_REQUEST, f"`{field}` is not supported by this gateway: {why} (docs/centrifugo.md)")

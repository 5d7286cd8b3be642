"""Centrifugo's client protocol codes at `centrifugo.path` (docs/centrifugo.md, "Client protocol"): our error
codes as its reply error codes, and our close codes as the ones that make its SDKs do the right thing.

Every SDK reconnects on a close code below 3500 (and on 4000-4499, where all of ours are) and gives up on
3500-3999: a refusal that must not come back in a loop (a bad token, a forced disconnect) is a 35xx code here.
"""

from __future__ import annotations

from .. import close_codes

# -- reply errors -------------------------------------------------------------------------------------------

INTERNAL = 100
UNAUTHORIZED = 101
UNKNOWN_CHANNEL = 102
PERMISSION_DENIED = 103
METHOD_NOT_FOUND = 104
ALREADY_SUBSCRIBED = 105
LIMIT_EXCEEDED = 106
BAD_REQUEST = 107
NOT_AVAILABLE = 108
TOKEN_EXPIRED = 109
TOO_MANY_REQUESTS = 111
UNRECOVERABLE_POSITION = 112

#: our error codes (docs/protocol.md) as Centrifugo's; any other is a bad request
ERRORS = {
    "unknown_topic": UNKNOWN_CHANNEL,
    "forbidden": PERMISSION_DENIED,
    "already_subscribed": ALREADY_SUBSCRIBED,
    "unknown_method": METHOD_NOT_FOUND,
    "too_large": LIMIT_EXCEEDED,
    "too_many_topics": LIMIT_EXCEEDED,
    "too_many_subscriptions": LIMIT_EXCEEDED,
    "too_many_calls": LIMIT_EXCEEDED,
    "queue_full": LIMIT_EXCEEDED,
    "rate_limited": TOO_MANY_REQUESTS,
    "bad_token": UNAUTHORIZED,
    "token_revoked": UNAUTHORIZED,
    "token_expired": TOKEN_EXPIRED,
    "backend_unavailable": INTERNAL,
    "broker_unavailable": INTERNAL,
    "keys_refreshing": INTERNAL,
    "internal_error": INTERNAL,
}
#: errors an SDK retries (`temporary`): the same command may pass later
TEMPORARY = frozenset((INTERNAL, TOO_MANY_REQUESTS))


def error_code(ours: str) -> int:
    return ERRORS.get(ours, BAD_REQUEST)


# -- closes -------------------------------------------------------------------------------------------------

#: Centrifugo's disconnect codes this endpoint sends
CONNECTION_CLOSED = 3000
SHUTDOWN = 3001
INTERNAL_CLOSE = 3004
EXPIRED = 3005
SLOW = 3008
NO_PONG = 3012
TOO_MANY_REQUESTS_CLOSE = 3013
INVALID_TOKEN = 3500
BAD_REQUEST_CLOSE = 3501
STALE = 3502
FORCE_DISCONNECT = 3503
CONNECTION_LIMIT = 3504
PERMISSION_DENIED_CLOSE = 3507
NOT_AVAILABLE_CLOSE = 3508

#: our close codes (gateway/close_codes.py) as Centrifugo's; codes below 3000 (a drain's 1012, 1013, the
#: frame errors) mean the same to the SDKs (reconnect; 1009 terminal) and pass unchanged, as Centrifugo's own
CLOSES = {
    close_codes.KICKED: FORCE_DISCONNECT,
    close_codes.DISCONNECTED: FORCE_DISCONNECT,
    close_codes.BAD_TOKEN: INVALID_TOKEN,
    close_codes.TOKEN_REVOKED: INVALID_TOKEN,
    close_codes.CONNECT_REFUSED: PERMISSION_DENIED_CLOSE,
    close_codes.BAD_CLIENT_ID: BAD_REQUEST_CLOSE,
    close_codes.SLOW_CONSUMER: SLOW,
    close_codes.DIRECT_OVERFLOW: SLOW,
    close_codes.TOKEN_EXPIRED: EXPIRED,
    close_codes.IDLE: CONNECTION_CLOSED,
    close_codes.REPLACED: CONNECTION_LIMIT,
    close_codes.TOO_MANY_TOKEN_CHECKS: TOO_MANY_REQUESTS_CLOSE,
    close_codes.GOING_AWAY: SHUTDOWN,
    close_codes.INTERNAL_ERROR: INTERNAL_CLOSE,
}


def close_code(ours: int) -> int:
    """The code a Centrifugo client is closed with for one of ours: never a 4xxx, which every SDK takes as
    "reconnect"."""
    mapped = CLOSES.get(ours)
    if mapped is not None:
        return mapped
    return ours if ours < 4000 else CONNECTION_CLOSED


def close_reason(reason: str) -> str:
    """A close reason as the SDKs read it: plain text (centrifuge-js parses a JSON-looking one as advice), at
    most 120 bytes."""
    text = reason.lstrip("{[").encode()[:120].decode(errors="ignore")
    return text or "closed"

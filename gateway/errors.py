"""The gateway's protocol errors: one class per error code (docs/protocol.md), with its HTTP status and, when
the error ends a connection, its WebSocket close code. The core's own codes are in core/errors.py; both
kinds are `RequestError`s, and `http_errors.error_response` is the one place that turns one into an HTTP
answer (an `error` entry or an ingest error line carries the same code).
"""

from __future__ import annotations

from core.errors import BadAck as BadAck  # the core's: an `ack` command refused there has the same code
from core.errors import RequestError

from . import close_codes


class BadJson(RequestError):
    code = "bad_json"


class BadCommand(RequestError):
    """JSON, but not a valid command (WebSocket frame, long-poll body)."""

    code = "bad_command"


class BadRecord(RequestError):
    """JSON, but not a valid ingest record."""

    code = "bad_record"


class BadRequest(RequestError):
    """JSON, but not a valid admin API body, or a malformed HTTP request."""

    code = "bad_request"


class Forbidden(RequestError):
    """The client may not subscribe / publish there (topic `anonymous`, `client_publish`, token patterns)."""

    code = "forbidden"
    http_status = 403


class RateLimited(RequestError):
    code = "rate_limited"
    http_status = 429


class TooManyTokenChecks(RateLimited):
    """A `?token=` (or bearer token) not checked: its address is past `auth.rate_per_ip` (gateway/auth/tokens.py)."""

    close_code = close_codes.TOO_MANY_TOKEN_CHECKS


class TooManyCreatedTopics(RequestError):
    """This connection has caused `limits.max_created_topics` creations (the code is the table's own)."""

    code = "too_many_topics"
    http_status = 429


class BadToken(RequestError):
    code = "bad_token"
    http_status = 401
    close_code = close_codes.BAD_TOKEN


class TokenRevoked(BadToken):
    """A token an operator revoked (`POST /api/revocations`, by its `jti` or its user's tokens issued before a
    time): refused as a bad token is, with its own code (close 4010)."""

    code = "token_revoked"
    close_code = close_codes.TOKEN_REVOKED


class TooManyRevocations(RequestError):
    """Admin API: the revocation table holds `auth.max_revocations` live entries."""

    code = "too_many_revocations"
    http_status = 507


class TokenExpired(RequestError):
    code = "token_expired"
    http_status = 401
    close_code = close_codes.TOKEN_EXPIRED


class UnknownMethod(RequestError):
    code = "unknown_method"


class UnknownSession(RequestError):
    code = "unknown_session"
    http_status = 404


class TooManySessions(RequestError):
    """The gateway holds `longpoll.max_sessions` long-poll sessions."""

    code = "too_many_sessions"
    http_status = 503


class TooManySessionsFromAddress(TooManySessions):
    """One address holds `longpoll.max_sessions_per_ip` sessions."""

    http_status = 429


class ForbiddenOrigin(RequestError):
    """A browser request from an `Origin` not in `server.allowed_origins` on /ws, /lp, /sse (gateway/edge/origin.py):
    403 JSON on HTTP; a WebSocket handshake is closed before accept (uvicorn answers it with HTTP 403)."""

    code = "forbidden_origin"
    http_status = 403
    close_code = close_codes.POLICY_VIOLATION


class TooManyConnections(RequestError):
    code = "too_many_connections"
    http_status = 503


class HeadersTooLarge(RequestError):
    """A request head over `server.max_header_bytes` or `server.max_headers` (answered by gateway/edge/netguard.py
    before the app sees the request, and the connection closed)."""

    code = "headers_too_large"
    http_status = 431


class BadHost(RequestError):
    """A `Host` the gateway does not serve (`server.allowed_hosts`, gateway/edge/hosts.py; answered by
    gateway/edge/netguard.py, and the connection closed)."""

    code = "bad_host"
    http_status = 421


class Unauthorized(RequestError):
    """Admin API without the right bearer token; ingest without the right auth line."""

    code = "unauthorized"
    http_status = 401


class UnknownClient(RequestError):
    code = "unknown_client"
    http_status = 404


class TooManyViewers(RequestError):
    """Admin API: `admin.stats_max_viewers` stats streams are open."""

    code = "too_many_viewers"
    http_status = 429


class Disabled(RequestError):
    """The raw TCP broadcaster is disabled."""

    code = "disabled"
    http_status = 404


class NotFound(RequestError):
    code = "not_found"
    http_status = 404


class MethodNotAllowed(RequestError):
    code = "method_not_allowed"
    http_status = 405


class InternalError(RequestError):
    """The gateway failed on this input: a bug, logged; the input is not applied."""

    code = "internal_error"
    http_status = 500
    close_code = close_codes.INTERNAL_ERROR


class Closed(RequestError):
    """Long-poll: the session was closed; the entry carries the `close_code` it stands for."""

    code = "closed"


class BrokerUnavailable(RequestError):
    """With a broker (docs/cluster.md §4): Redis cannot be reached, so the publish cannot be given a seq."""

    code = "broker_unavailable"
    http_status = 503


class ConnectRefused(Forbidden):
    """The backend's connect hook refused the connection ([proxy] connect_url, gateway/hooks/backend.py): close 4003
    with its message on WebSocket, HTTP 403 `forbidden` on long-poll and SSE."""

    close_code = close_codes.CONNECT_REFUSED


class BackendUnavailable(RequestError):
    """A backend hook ([proxy], gateway/hooks/backend.py) did not answer in time, could not be reached or answered
    something that is not a hook answer: a new connection is refused (close 1013, HTTP 503 with Retry-After),
    a command gets this error entry."""

    code = "backend_unavailable"
    http_status = 503
    close_code = close_codes.TRY_AGAIN_LATER


class KeysRefreshing(RequestError):
    """A token names a key the JWKS set (`auth.jwks_url`, gateway/auth/jwks.py) lacks, and the set is being fetched
    again (or is not loaded yet): a passing state, so retry later with the same token (close 1013, HTTP 503
    with Retry-After, the `auth` command's error entry)."""

    code = "keys_refreshing"
    http_status = 503
    close_code = close_codes.TRY_AGAIN_LATER


class TooManyCalls(RequestError):
    """A connection's commands waiting for backend hooks (calls in flight and commands queued behind them on
    their topic, gateway/commands.py) are at `proxy.max_calls_per_connection`: the command is refused at
    once, so one connection cannot take every slot of a hook."""

    code = "too_many_calls"
    http_status = 429


class RpcError(RequestError):
    """The backend's rpc hook ([proxy] rpc_url) answered an `error`: its code and message, as this entry's
    message."""

    code = "rpc_error"

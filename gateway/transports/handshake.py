"""How every client transport opens a client (WebSocket, SSE, long-poll), written once: the per-address and
total bounds, the refused `?id=`, the token (from the query or an `Authorization` header) checked within the
address's token-check rate, and the `ClientIdentity` the transport registers. A refusal is raised as the
`RequestError` docs/protocol.md names; each transport only turns it into its own wire form:

| refusal | WebSocket | SSE | long-poll |
| --- | --- | --- | --- |
| `TooManySessions` (`longpoll.max_sessions`) | - | - | 503, `Retry-After: 5` |
| `TooManySessionsFromAddress` (`*.max_sessions_per_ip`) | - | 429, `Retry-After: 5` | 429, `Retry-After: 5` |
| `ClientIdRefused` (`?id=`) | close 4006 | `close` event 4006 | - (not read) |
| `BadToken`, `TokenExpired` | close 4001, 4011 | `close` event 4001, 4011 | 401, `WWW-Authenticate: Bearer` |
| `TokenRevoked` (a `BadToken`, gateway/revocations.py) | close 4010 | `close` event 4010 | 401, `WWW-Authenticate: Bearer` |
| `TooManyTokenChecks` (`auth.rate_per_ip`) | close 4029 | `close` event 4029 | 429, `Retry-After: 5` |
| `ConnectRefused` (the connect hook said no) | close 4003 | 403 | 403 |
| `BackendUnavailable` (the connect hook did not answer) | close 1013 | 503, `Retry-After` | 503, `Retry-After` |

The last two come after `open_client`, from the backend's connect hook (`[proxy] connect_url`,
gateway/proxy.py), which the transport awaits when `backend_for` names it (docs/integration.md).

The TCP ingest and the raw TCP broadcaster do not open clients: their peers are publishers and byte
receivers checked against one shared secret (`ingest.token`, `rawtcp.token`, a line compared in constant
time), with no JWT, no user, no client id and no per-address client count, so they keep their own line
handshakes (gateway/transports/ingest_parser.py, rawtcp.py).

Also here: the one answer of every route of a transport that is switched off (`TransportOff`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from core.errors import RequestError

from .. import close_codes
from ..errors import BadToken, NotFound, TokenExpired, TooManySessions, TooManySessionsFromAddress, TooManyTokenChecks
from ..http_errors import error_response
from ..identity import ClientIdentity
from ..proxy import Proxy

if TYPE_CHECKING:
    from ..hub import Hub


class ClientIdRefused(RequestError):
    """`?id=` on `/ws` or `/sse`: names chosen by clients could be claimed by anyone, and a private queue
    belongs to a token's `sub`, so the gateway assigns every client id (close 4006; never an error entry)."""

    code = "bad_client_id"
    close_code = close_codes.BAD_CLIENT_ID


@dataclass(frozen=True)
class _Door:
    """One transport's side of the handshake."""

    #: prefix of its client ids (`ws-`, `sse-`, `lp-` and 16 hex digits)
    id_prefix: str
    #: what its per-address refusal calls its clients, and what the log calls them
    per_address_noun: str = ""
    logged_noun: str = ""


_DOORS = {
    "ws": _Door("ws"),
    "sse": _Door("sse", "SSE streams", "streams"),
    "longpoll": _Door("lp", "sessions", "sessions"),
}


def _per_address_limit(hub: Hub, transport: str) -> int:
    """How many clients of `transport` one address may hold (0: no bound; WebSocket: the HTTP port's
    `server.max_connections_per_ip`, checked before the handshake by gateway/netguard.py)."""
    config = hub.config
    if transport == "sse":
        return config.sse.max_sessions_per_ip
    if transport == "longpoll":
        return config.longpoll.max_sessions_per_ip
    return 0


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header; None when there is no header (or an empty one).
    Raises BadToken for another scheme."""
    scheme, _, token = (authorization or "").partition(" ")
    if not scheme:
        return None
    if scheme.lower() != "bearer":
        raise BadToken("the Authorization header must be `Bearer <token>`")
    return token.strip()


def open_client(
    hub: Hub,
    transport: str,
    peer: tuple[str, int] | None,
    *,
    token: str | None = None,
    authorization: str | None = None,
    requested_id: str | None = None,
) -> ClientIdentity:
    """Admit a new client of `transport` ("ws", "sse", "longpoll") from `peer` (host, port) and name it.

    In order: the transport's total bound (long-poll: `longpoll.max_sessions`, `TooManySessions`), its
    per-address bound (`TooManySessionsFromAddress`), `requested_id` (any `?id=`, even empty:
    `ClientIdRefused`), then the token, `token` (a query's `?token=`) or the one of an `authorization` header
    (`bearer_token`), verified within the address's token-check rate (`BadToken`, `TokenExpired`,
    `TooManyTokenChecks`). Returns the identity to register (anonymous without a token); the caller
    registers it with its connection. Refusals of a peer's input are counted and logged at a bounded rate
    (`hub.bad_input`), under the transport's name."""
    door = _DOORS[transport]
    host, port = peer if peer else ("", 0)
    if transport == "longpoll" and hub.sessions.longpoll.full():
        raise TooManySessions("the long-poll session limit is reached")
    per_address = _per_address_limit(hub, transport)
    if per_address and hub.clients.clients_by_ip[(transport, host)] >= per_address:
        hub.bad_input(transport, "%s holds its maximum of %d %s", host, per_address, door.logged_noun)
        raise TooManySessionsFromAddress(f"at most {per_address} {door.per_address_noun} per address")
    if requested_id is not None:
        raise ClientIdRefused("?id= is not accepted: identity comes from ?token=")
    principal = None
    try:
        if authorization is not None:
            token = bearer_token(authorization)
        if token is not None:
            principal = hub.clients.tokens.verify(token, host)
    except TooManyTokenChecks as exc:  # auth.rate_per_ip: not checked at all
        hub.bad_input(transport, "token not checked: %s", exc)
        raise
    except (BadToken, TokenExpired) as exc:
        hub.bad_input(transport, "token refused: %s", exc)
        raise
    identity = ClientIdentity(hub.clients.new_client_id(door.id_prefix), transport, f"{host}:{port}", host, principal)
    if principal is not None and principal.info is not None:
        identity.info = principal.info
    return identity


def backend_for(hub: Hub, identity: ClientIdentity) -> Proxy | None:
    """The proxy whose connect hook this new client must pass (`Proxy.connect`, to await before it is
    registered), or None: no connect hook, or a client with a token without `connect_always`."""
    proxy = hub.proxy
    return proxy if proxy is not None and proxy.wants_connect(identity) else None


async def http_backend_refusal(hub: Hub, identity: ClientIdentity, request: Request) -> Response | None:
    """The connect hook for an HTTP transport (long-poll, SSE), when this client must pass it: None once the
    backend admitted it, else the answer: 403 `forbidden` (refused), 503 `backend_unavailable` with
    `Retry-After` (no answer in time)."""
    proxy = backend_for(hub, identity)
    if proxy is None:
        return None
    try:
        await proxy.connect(identity, request.headers.getlist)
    except RequestError as exc:
        return error_response(exc, proxy.retry_after if exc.http_status == 503 else None)
    return None


def close_reason(exc: RequestError) -> str:
    """A refusal's message as a WebSocket close reason: at most 120 bytes of UTF-8 (a close frame's reason
    takes at most 123), cut on a character boundary."""
    return exc.message.encode()[:120].decode(errors="ignore")


class TransportOff:
    """The endpoint of every route of a transport that is switched off (`websocket.enabled`,
    `longpoll.enabled`, `sse.enabled`): an HTTP request gets `404 not_found` naming the key; a WebSocket
    handshake is closed before it is accepted, which uvicorn answers with HTTP 403 (docs/protocol.md)."""

    def __init__(self, name: str, key: str) -> None:
        self.refusal = NotFound(f"the {name} transport is disabled ({key})")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1000, "reason": ""})
            return
        await error_response(self.refusal)(scope, receive, send)

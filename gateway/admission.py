"""How every client transport opens a client (WebSocket, SSE, long-poll), written once: the per-address and
total bounds, the refused `?id=`, the token (from the query or an `Authorization` header) checked within the
address's token-check rate, and the `ClientIdentity` the transport registers. A refusal is raised as the
`RequestError` docs/protocol.md names; `ClientSession.begin` (gateway/session.py) runs it for every
transport, and each transport only turns a refusal into its own wire form:

| refusal | WebSocket | SSE | long-poll |
| --- | --- | --- | --- |
| `TooManySessions` (`longpoll.max_sessions`) | - | - | 503, `Retry-After: 5` |
| `TooManySessionsFromAddress` (`*.max_sessions_per_ip`) | - | 429, `Retry-After: 5` | 429, `Retry-After: 5` |
| `ClientIdRefused` (`?id=`) | close 4006 | `close` event 4006 | - (not read) |
| `BadToken`, `TokenExpired` | close 4001, 4011 | `close` event 4001, 4011 | 401, `WWW-Authenticate: Bearer` |
| `TokenRevoked` (a `BadToken`, gateway/auth/revocations.py) | close 4010 | `close` event 4010 | 401, `WWW-Authenticate: Bearer` |
| `TooManyTokenChecks` (`auth.rate_per_ip`) | close 4029 | `close` event 4029 | 429, `Retry-After: 5` |
| `TooManyPendingConnects` (`proxy.max_pending_connects_per_ip`) | close 1013 | 429, `Retry-After` | 429, `Retry-After` |
| `ConnectRefused` (the connect hook said no) | close 4003 | 403 | 403 |
| `BackendUnavailable` (the connect hook did not answer) | close 1013 | 503, `Retry-After` | 503, `Retry-After` |
| `LateRefusal` (revoked, user disconnected, drain, meanwhile) | close 4010, 4005, 1012 | `close` event | 401, 403, 503 |

The last four come after `open_client`, from the client's `Admission` (`admit`): the backend's connect hook
(`[proxy] connect_url`, gateway/hooks/base.py), which the transport awaits when `awaits_hook` says so
(docs/integration.md), and what the admin API or the drain did before the client registered
(gateway/pending_connects.py). The `Admission` holds the client's place in its transport's bounds until it
registers, so the clients awaiting the hook count against them.

The TCP ingest and the raw TCP broadcaster do not open clients: their peers are publishers and byte
receivers checked against one shared secret (`ingest.token`, `rawtcp.token`, a line compared in constant
time), with no JWT, no user, no client id and no per-address client count, so they keep their own line
handshakes (gateway/transports/ingest_parser.py, rawtcp.py).

How each transport writes a refusal (an HTTP answer, a close frame) is its own: gateway/transports/handshake.py
for the HTTP ones, gateway/transports/ws_handshake.py for the WebSocket.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.errors import RequestError

from . import close_codes
from .auth.identity import ClientIdentity
from .errors import (
    BadToken,
    RateLimited,
    TokenExpired,
    TooManySessions,
    TooManySessionsFromAddress,
    TooManyTokenChecks,
)
from .pending_connects import LateRefusal

if TYPE_CHECKING:
    from .session_services import SessionServices


class ClientIdRefused(RequestError):
    """`?id=` on `/ws` or `/sse`: names chosen by clients could be claimed by anyone, and a private queue
    belongs to a token's `sub`, so the gateway assigns every client id (close 4006; never an error entry)."""

    code = "bad_client_id"
    close_code = close_codes.BAD_CLIENT_ID


class TooManyPendingConnects(RateLimited):
    """The client's address has `proxy.max_pending_connects_per_ip` clients awaiting the connect hook: the
    hook's slots serve everyone, so one address may not hold them all. Try again later: close 1013 on
    WebSocket, 429 `rate_limited` with `Retry-After` (`proxy.retry_after_s`) on long-poll and SSE."""

    close_code = close_codes.TRY_AGAIN_LATER


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
    # Centrifugo's client protocol on the WebSocket (gateway/centrifugo/client_session.py): bounded as `ws`
    "centrifugo": _Door("cf"),
}


def _per_address_limit(services: SessionServices, transport: str) -> int:
    """How many clients of `transport` one address may hold (0: no bound; WebSocket: the HTTP port's
    `server.max_connections_per_ip`, checked before the handshake by gateway/edge/netguard.py)."""
    config = services.config
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
    services: SessionServices,
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
    (`services.bad_input`), under the transport's name."""
    door = _DOORS[transport]
    host, port = peer if peer else ("", 0)
    if transport == "longpoll" and services.sessions.longpoll.full():
        raise TooManySessions("the long-poll session limit is reached")
    per_address = _per_address_limit(services, transport)
    if per_address and services.clients.clients_by_ip[(transport, host)] >= per_address:
        services.bad_input(transport, "%s holds its maximum of %d %s", host, per_address, door.logged_noun)
        raise TooManySessionsFromAddress(f"at most {per_address} {door.per_address_noun} per address")
    if requested_id is not None:
        raise ClientIdRefused("?id= is not accepted: identity comes from ?token=")
    principal = None
    tenant = services.clients.tenancy.tenant_of(None)
    try:
        if authorization is not None:
            token = bearer_token(authorization)
        if token is not None:
            principal = services.clients.tokens.verify(token, host)
            tenant = services.clients.tenancy.tenant_of(principal)
    except TooManyTokenChecks as exc:  # auth.rate_per_ip: not checked at all
        services.bad_input(transport, "token not checked: %s", exc, peer=host)
        raise
    except (BadToken, TokenExpired) as exc:
        services.bad_input(transport, "token refused: %s", exc, peer=host)
        raise
    identity = ClientIdentity(
        services.clients.new_client_id(door.id_prefix), transport, f"{host}:{port}", host, principal, tenant
    )
    if principal is not None and principal.info is not None:
        identity.info = principal.info
    return identity


class Admission:
    """A new client from its handshake to its registration, which the transport makes in the same step of the
    event loop as `settle`. Until then (the connect hook, `pass_backend`; SSE's response head) it holds its
    place in its transport's bounds: per address in `clients_by_ip` (shared with the other workers), in the
    long-poll total (`SessionTable.reserved`), and while it awaits the hook one of its address's
    `proxy.max_pending_connects_per_ip`. It hears of the revocations, user disconnects and drain made
    meanwhile (`ClientRegistry.pending`). `release` gives every place back; `settle` and a failed
    `pass_backend` call it, and a transport whose client goes away before either."""

    __slots__ = ("services", "identity", "hooks", "awaits_hook", "granted", "_pending", "_address_key", "_longpoll", "_hook_ip")

    def __init__(self, services: SessionServices, identity: ClientIdentity) -> None:
        self.services = services
        self.identity = identity
        self.hooks = services.hooks
        #: it must pass the connect hook (`pass_backend`) before it registers: there is one, and the client
        #: has no token or `connect_always` is on
        self.awaits_hook = self.hooks.wants_connect(identity)
        #: the connect hook admitted it: the backend hears of its end, whenever that is
        self.granted = False
        self._hook_ip: str | None = None
        if self.awaits_hook:
            self._wait_for_hook(services.clients.pending.hooks_by_ip, services.config.proxy.max_pending_connects_per_ip)
        self._pending = services.clients.pending.add(identity)
        self._address_key: tuple[str, str] | None = None
        if _per_address_limit(services, identity.transport):
            self._address_key = (identity.transport, identity.ip)
            services.clients.clients_by_ip[self._address_key] += 1
        self._longpoll = identity.transport == "longpoll"
        if self._longpoll:
            services.sessions.longpoll.reserved += 1

    def _wait_for_hook(self, waiting: Counter[str], limit: int) -> None:
        ip = self.identity.ip
        if limit and waiting[ip] >= limit:
            self.services.bad_input(
                self.identity.transport, "%s has its maximum of %d clients awaiting the connect hook", ip, limit
            )
            raise TooManyPendingConnects(
                f"{limit} connections from this address await the backend already"
                " (proxy.max_pending_connects_per_ip): retry later"
            )
        waiting[ip] += 1
        self._hook_ip = ip

    def _hook_done(self) -> None:
        ip = self._hook_ip
        if ip is not None:
            self._hook_ip = None
            waiting = self.services.clients.pending.hooks_by_ip
            waiting[ip] -= 1
            if waiting[ip] <= 0:
                del waiting[ip]

    async def pass_backend(self, header_values: Callable[[str], list[str]]) -> tuple[str, ...]:
        """The connect hook, when this client must pass it (`awaits_hook`): the server-side subscriptions it
        granted. Raises ConnectRefused, BackendUnavailable (every place released: the client is refused)."""
        if not self.awaits_hook:
            return ()
        try:
            granted = await self.hooks.connect(self.identity, header_values)
        except BaseException:
            self.release()
            raise
        finally:
            self._hook_done()
        self.granted = True
        return granted

    def settle(self) -> LateRefusal | None:
        """Give every place back, and say how the client must be closed instead of registered (a revocation,
        a disconnect or the drain came first: gateway/pending_connects.py), or None: register it now, in this
        step of the event loop."""
        refusal = self.services.clients.pending.refusal(self._pending)
        self.release()
        if refusal is not None and self.granted:
            self.hooks.disconnected(self.identity, refusal.cause)  # the backend admitted it: it hears of its end
        return refusal

    def release(self) -> None:
        """Give every place back (again: nothing more)."""
        services = self.services
        self._hook_done()
        services.clients.pending.remove(self._pending)
        key = self._address_key
        if key is not None:
            self._address_key = None
            counts = services.clients.clients_by_ip
            counts[key] -= 1
            if not counts[key]:
                del counts[key]
        if self._longpoll:
            self._longpoll = False
            services.sessions.longpoll.reserved -= 1


def admit(
    services: SessionServices,
    transport: str,
    peer: tuple[str, int] | None,
    *,
    token: str | None = None,
    authorization: str | None = None,
    requested_id: str | None = None,
) -> Admission:
    """`open_client`, then the new client's `Admission` (raises its refusals, and TooManyPendingConnects)."""
    identity = open_client(services, transport, peer, token=token, authorization=authorization, requested_id=requested_id)
    return Admission(services, identity)

"""One client connection of any transport (WebSocket, SSE, long-poll), from its handshake to its end: the one
object its transport talks to, as centrifuge's `Client`.

The open is written once, for every transport, in this order:

    session = ClientSession.begin(services, "sse", peer, token=...)  # the bounds, ?id=, the token: RequestError
    if session.awaits_hook:
        await session.pass_backend(header_values)              # the connect hook: ConnectRefused, BackendUnavailable
    session.open(connection)                                   # LateRefused, or registered

`begin` runs the handshake (gateway/admission.py: the transport's bounds, the refused `?id=`, the
token) and holds the client's places in the bounds until `open` or `gone`; `open` registers the connection
in the same step of the event loop as it learns whether a revocation, a user's disconnect or the drain came
first (gateway/pending_connects.py), which it raises as `LateRefused`. A transport that must answer before
the registration (the WebSocket's 101, SSE's response head) does so before `open`, so a refusal comes after it.

Once open, the transport hands it the client's messages (`handle`) and tells it of its write state
(`blocked`, `drained`; long-poll: `ready`, `idle`, `acked`) and of its loss (`gone`); `close` ends it.
What a message means is its client protocol's (`protocol`, gateway/client_protocol.py: ours is JSON): it
reads the message into typed commands, which gateway/commands.py runs over the session, answering through
`reply` and `refuse`; the session's core knows no frame. What the connection spends (rate buckets, hook
calls, the idle clock) is its `state`; all it reaches of the gateway is its `services`
(gateway/session_services.py), never the hub.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from core.client import Client
from core.entries import encode_reply
from core.errors import DirectQueueFull, RequestError

from . import close_codes
from .admission import Admission, admit
from .client_protocol import JSON_PROTOCOL, ClientProtocol, decode_value
from .errors import BadToken, Closed
from .pending_connects import LateRefusal

if TYPE_CHECKING:
    import asyncio

    from .auth.identity import ClientIdentity
    from .auth.tokens import Principal
    from .config import GatewayConfig
    from .edge.ratelog import TokenBucket
    from .scheduler import Connection, Scheduler
    from .session_services import SessionServices
    from .session_store import SessionStore

log = logging.getLogger("gateway.session")

T = TypeVar("T")


class LateRefused(Closed):
    """The client was closed as it would register: a revocation, a user's disconnect or the drain came while
    it awaited the connect hook (gateway/pending_connects.py). `close_code`, the message and `retry_ms` (a
    drain's reconnect hint) are those a registered client gets for the same cause."""

    def __init__(self, refusal: LateRefusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal
        self.close_code = refusal.code
        self.retry_ms = refusal.retry_ms


class SessionState:
    """What a connection spends and holds while it lives, written by its commands (gateway/commands.py)
    and read by the registry's idle check; its `ClientIdentity` says only who it is."""

    __slots__ = ("publish_bucket", "subscribe_bucket", "costly_bucket", "hook_calls", "waiting", "last_command", "granted")

    def __init__(self) -> None:
        #: client publishes (limits.publish_rate / publish_burst); made on first publish
        self.publish_bucket: TokenBucket | None = None
        #: subscribe and unsubscribe commands (limits.subscribe_rate / subscribe_burst); made on first use
        self.subscribe_bucket: TokenBucket | None = None
        #: `auth`, `presence` and `rpc topics` (auth.rate_per_connection / burst_per_connection); made on first use
        self.costly_bucket: TokenBucket | None = None
        #: hook calls in flight for its commands plus commands waiting behind them, bounded by
        #: proxy.max_calls_per_connection
        self.hook_calls = 0
        #: topics with a hooked command of this connection in flight, each with the commands waiting behind it
        #: (a connection's commands on a topic take effect in the order sent); made on its first hooked command
        self.waiting: dict[str, deque[Any]] | None = None
        #: monotonic time of the last command, for the idle timeout
        self.last_command = time.monotonic()
        #: server-side subscriptions the connect hook granted, made as the connection opens
        self.granted: tuple[str, ...] = ()


class ClientSession:
    """One client connection (module docstring). `identity` is who the client is; `state` what it spends;
    `connection` is its transport's `Connection` once open; `services` the gateway it reaches
    (gateway/session_services.py); `protocol` how its messages are read (gateway/client_protocol.py)."""

    __slots__ = ("identity", "state", "connection", "services", "protocol", "_admission")

    def __init__(self, services: SessionServices, admission: Admission, protocol: ClientProtocol = JSON_PROTOCOL) -> None:
        self.services = services
        self._admission: Admission | None = admission
        self.identity: ClientIdentity = admission.identity
        self.state = SessionState()
        self.connection: Connection | None = None
        self.protocol = protocol

    @property
    def config(self) -> GatewayConfig:
        return self.services.config

    @property
    def scheduler(self) -> Scheduler:
        return self.services.scheduler

    @property
    def store(self) -> SessionStore:
        return self.services.sessions

    # -- the open ------------------------------------------------------------------------------------------

    @classmethod
    def begin(
        cls,
        services: SessionServices,
        transport: str,
        peer: tuple[str, int] | None,
        *,
        token: str | None = None,
        authorization: str | None = None,
        requested_id: str | None = None,
        protocol: ClientProtocol = JSON_PROTOCOL,
    ) -> ClientSession:
        """The handshake of a new client of `transport` ("ws", "sse", "longpoll", "centrifugo") from `peer`:
        its bounds, `requested_id` (any `?id=` is refused), the token of the query or of an `Authorization`
        header. Raises the refusal (`RequestError`, gateway/admission.py's table); the session holds the
        client's places in its bounds until `open` or `gone`."""
        admission = admit(services, transport, peer, token=token, authorization=authorization, requested_id=requested_id)
        return cls(services, admission, protocol)

    @property
    def awaits_hook(self) -> bool:
        """It must pass the connect hook (`pass_backend`) before it opens."""
        return self._admission is not None and self._admission.awaits_hook

    async def pass_backend(self, header_values: Callable[[str], list[str]]) -> None:
        """The backend's connect hook, when the client must pass it (`awaits_hook`), given the handshake's
        headers; its server-side subscriptions are made as the session opens. Raises ConnectRefused,
        BackendUnavailable: the client's places are given back, it is gone."""
        admission = self._opening()
        try:
            self.state.granted = await admission.pass_backend(header_values)
        except BaseException:
            self._admission = None  # released
            raise

    def spawn(self, opening: Coroutine[Any, Any, None]) -> None:
        """Run the transport's rest of the open in the background (the WebSocket awaits the connect hook
        without a task of its own); cancelled with the hooks' calls at shutdown."""
        self.services.hooks.spawn(opening)

    def open(self, connection: Connection, *, ready: bool = True) -> None:
        """Register `connection` as this client's (`ready`: it can take a batch now; long-poll: once it polls),
        then subscribe it to what the connect hook granted (`state.granted`: no command, no permission check;
        a refusal is its error entry). Raises LateRefused when a revocation, a user's disconnect or the drain
        came first: the client is not registered, and its transport closes it as that refusal says."""
        refusal = self._opening().settle()
        self._admission = None
        if refusal is not None:
            raise LateRefused(refusal)
        self.connection = connection
        self.services.clients.register(connection, ready=ready)
        granted, self.state.granted = self.state.granted, ()
        for name in granted:
            if not self.live:
                break  # cut by an earlier one (direct queue)
            try:
                self.services.catalog.grant(self.identity.client_id, name)
            except RequestError as exc:
                self.send_error(exc)

    def _opening(self) -> Admission:
        admission = self._admission
        if admission is None:
            raise RuntimeError(f"session {self.identity.client_id} is not opening (opened or gone)")
        return admission

    # -- while open ----------------------------------------------------------------------------------------

    @property
    def live(self) -> bool:
        """Registered and not closed since."""
        connection = self.connection
        return connection is not None and self.services.clients.conns.get(self.identity.client_id) is connection

    def handle(self, payload: bytes | str) -> int:
        """Run the commands of one message of the client (a frame, a body), as its protocol reads them;
        returns how many. A failure is our bug, not the peer's: this client is closed with 1011, nobody else
        is disturbed."""
        if not self.live:
            return 0
        try:
            return self.services.commands.handle(self, payload)
        except Exception:
            log.exception("%s client %s: a command failed", self.identity.transport, self.identity.client_id)
            self.close(close_codes.INTERNAL_ERROR, "internal error", "error")
            return 0

    def command(self, value: Any) -> None:
        """Run one command the transport makes for the client (SSE: the subscriptions its request names),
        not counted against the client's subscribe rate; a refusal is the client's error entry."""
        if self.live:
            self.services.commands.run_decoded(self, decode_value(value))

    def authenticate(self, principal: Principal) -> Principal:
        """Make `principal` (verified) the client's: a first token makes an anonymous connection its user's,
        a later one (or an operator's refresh) renews the same user's (expiry, patterns). The one way the
        identity of a registered client changes. Raises BadToken."""
        identity = self.identity
        current = identity.principal
        if current is not None and current.user != principal.user:
            raise BadToken("the token is for another user than the connection's")
        clients = self.services.clients
        tenant = clients.tenancy.tenant_of(principal)
        if current is not None and tenant != identity.tenant:
            raise BadToken(f"tenant mismatch: the connection is tenant {identity.tenant!r}'s, the token {tenant!r}'s")
        if current is None:
            clients.claim_owner(identity.client_id, principal.user)
            identity.tenant = tenant
            clients.assign_tenant(identity.client_id, tenant, principal.user)
        identity.principal = principal
        if principal.info is not None and (current is None or principal.info is not current.info):
            identity.info = principal.info
        clients.authenticated(identity.client_id, principal, first=current is None)
        return principal

    def reply(self, request_id: Any, result: Any) -> None:
        """The `reply` entry of a request, through the client's direct queue (ordered with its data)."""
        self.services.clients.send_direct(self.identity.client_id, encode_reply(request_id, result))

    def send(self, entry: bytes) -> None:
        """An entry the client's protocol made itself, through its direct queue."""
        self.services.clients.send_direct(self.identity.client_id, entry)

    def refuse(self, exc: RequestError, request_id: Any = None) -> None:
        """The error entry of a refused request; a client that does not read its replies (its direct queue
        full) is closed instead."""
        if isinstance(exc, DirectQueueFull):
            self.services.clients.kick(self.identity.client_id, close_codes.DIRECT_OVERFLOW, "direct queue overflow", exc.code)
        else:
            self.services.clients.send_error(self.identity.client_id, exc, request_id)

    def reply_when_done(self, request_id: Any, future: asyncio.Future[T], result: Callable[[T], Any], what: str) -> None:
        """The reply of a request whose outcome is `future` (now, or when the broker answers)."""
        self.services.clients.reply_when_done(self.identity.client_id, request_id, future, result, what)

    def send_error(self, exc: RequestError) -> None:
        """An error entry on the client's stream, with no request id (a refusal of its request's parts)."""
        if self.live:
            self.services.clients.send_error(self.identity.client_id, exc)

    def bad_input(self, message: str, *args: object) -> None:
        """Count and log (at a bounded rate) a refused input of the client, under its transport's name."""
        self.services.bad_input(self.identity.transport, message, *args)

    def client_state(self) -> Client:
        """The engine's state of this client (its subscriptions and cursors), to read: SSE's positions."""
        return self.services.topics.client(self.identity.client_id)

    # -- what the transport tells of its writes -------------------------------------------------------------

    def blocked(self) -> None:
        """A write left the transport above its high-water mark: the client is not ready and the watchdog
        watches it (the connection's `blocked_since`) until `drained`."""
        if self.connection is not None:
            self.scheduler.write_blocked(self.identity.client_id, self.connection)

    def drained(self) -> None:
        """The blocked write drained: the client is ready again."""
        self.scheduler.write_drained(self.identity.client_id)

    def ready(self) -> None:
        """Long-poll: a poll waits, the next batch may go."""
        self.scheduler.mark_ready(self.identity.client_id)

    def idle(self) -> None:
        """Long-poll: the poll ended with nothing; no batch goes until the next one."""
        if self.live:
            self.scheduler.mark_idle(self.identity.client_id)

    def acked(self) -> None:
        """Long-poll: the client acknowledged the batch it was given (its private entries are committed)."""
        self.scheduler.commit(self.identity.client_id)

    # -- the end -------------------------------------------------------------------------------------------

    def gone(self, reason: str = "closed") -> None:
        """The transport lost the client (or it expired): nothing more is written, and it is forgotten
        (`reason`: the disconnect reason of the metrics and of the backend's disconnect event). Before `open`,
        its places in the bounds are given back. Again: nothing more."""
        admission, self._admission = self._admission, None
        if admission is not None:
            admission.release()
            return
        if self.connection is None:  # refused as it would open: never registered
            return
        client_id = self.identity.client_id
        self.scheduler.write_unwatched(client_id)
        if self.live:
            self.services.clients.unregister(client_id, reason)

    def close(self, code: int, reason: str, cause: str = "closed") -> None:
        """End the client: its transport writes what is staged, then the close (`code`, `reason`), and it is
        forgotten (`cause`: the disconnect reason)."""
        if self.live:
            self.services.clients.kick(self.identity.client_id, code, reason, cause)


def session_store(services: SessionServices) -> SessionStore:
    """The session transports' tables (gateway/session_store.py), for their endpoints that find a
    session by its secret: the one part of the gateway they reach without a `ClientSession`."""
    return services.sessions

"""One client connection of any transport (WebSocket, SSE, long-poll), from its handshake to its end: the one
object its transport talks to, as centrifuge's `Client`.

The open is written once, for every transport, in this order:

    session = ClientSession.begin(hub, "sse", peer, token=...)   # the bounds, ?id=, the token: RequestError
    if session.awaits_hook:
        await session.pass_backend(header_values)              # the connect hook: ConnectRefused, BackendUnavailable
    session.open(connection)                                   # LateRefused, or registered

`begin` runs the handshake (gateway/auth/admission.py: the transport's bounds, the refused `?id=`, the
token) and holds the client's places in the bounds until `open` or `gone`; `open` registers the connection
in the same step of the event loop as it learns whether a revocation, a user's disconnect or the drain came
first (gateway/pending_connects.py), which it raises as `LateRefused`. A transport that must answer before
the registration (the WebSocket's 101, SSE's response head) does so before `open`, so a refusal comes after it.

Once open, the transport hands it the client's messages (`handle`) and tells it of its write state
(`blocked`, `drained`; long-poll: `ready`, `idle`, `acked`) and of its loss (`gone`); `close` ends it.
What a message means is the client protocol's (`commands`: ours is JSON, gateway/commands.py `handle`): a
second protocol plugs in there, and the session's core knows no frame.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from core.client import Client
from core.errors import RequestError

from . import close_codes, commands
from .auth.admission import Admission, admit
from .errors import Closed
from .pending_connects import LateRefusal

if TYPE_CHECKING:
    from .auth.identity import ClientIdentity
    from .config import GatewayConfig
    from .hub import Hub
    from .scheduler import Connection, Scheduler
    from .transports.sessions import SessionStore

log = logging.getLogger("gateway.session")

#: a client protocol's reading of one message of the client (a frame, a body): runs its commands, returns
#: how many (ours: gateway/commands.py `handle`)
CommandReader = Callable[["ClientSession", bytes | str], int]


class LateRefused(Closed):
    """The client was closed as it would register: a revocation, a user's disconnect or the drain came while
    it awaited the connect hook (gateway/pending_connects.py). `close_code`, the message and `retry_ms` (a
    drain's reconnect hint) are those a registered client gets for the same cause."""

    def __init__(self, refusal: LateRefusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal
        self.close_code = refusal.code
        self.retry_ms = refusal.retry_ms


class ClientSession:
    """One client connection (module docstring). `identity` is who the client is; `connection` is its
    transport's `Connection` once open; `config`, `scheduler` (the round's staging) and `store` (the session
    transports' tables) are what its transport's objects are given. One per connection, so small: five slots."""

    __slots__ = ("identity", "connection", "commands", "_hub", "_admission")

    def __init__(self, hub: Hub, admission: Admission, reader: CommandReader | None = None) -> None:
        self._hub = hub
        self._admission: Admission | None = admission
        self.identity: ClientIdentity = admission.identity
        self.connection: Connection | None = None
        #: the client protocol's reader of messages (`CommandReader`)
        self.commands: CommandReader = reader or commands.handle

    @property
    def config(self) -> GatewayConfig:
        return self._hub.config

    @property
    def scheduler(self) -> Scheduler:
        return self._hub.scheduler

    @property
    def store(self) -> SessionStore:
        return self._hub.sessions

    # -- the open ------------------------------------------------------------------------------------------

    @classmethod
    def begin(cls, hub: Hub, transport: str, peer: tuple[str, int] | None, *, token: str | None = None,
              authorization: str | None = None, requested_id: str | None = None,
              reader: CommandReader | None = None) -> ClientSession:
        """The handshake of a new client of `transport` ("ws", "sse", "longpoll") from `peer`: its bounds,
        `requested_id` (any `?id=` is refused), the token of the query or of an `Authorization` header.
        Raises the refusal (`RequestError`, gateway/auth/admission.py's table); the session holds the
        client's places in its bounds until `open` or `gone`."""
        admission = admit(hub, transport, peer, token=token, authorization=authorization, requested_id=requested_id)
        return cls(hub, admission, reader)

    @property
    def awaits_hook(self) -> bool:
        """It must pass the connect hook (`pass_backend`) before it opens."""
        return self._admission is not None and self._admission.awaits_hook

    @property
    def hub(self) -> Hub:
        """The hub, for the commands (gateway/commands.py); a transport uses the session's verbs."""
        return self._hub

    async def pass_backend(self, header_values: Callable[[str], list[str]]) -> None:
        """The backend's connect hook, when the client must pass it (`awaits_hook`), given the handshake's
        headers. Raises ConnectRefused, BackendUnavailable: the client's places are given back, it is gone."""
        admission = self._opening()
        try:
            await admission.pass_backend(header_values)
        except BaseException:
            self._admission = None  # released
            raise

    def spawn(self, opening: Coroutine[Any, Any, None]) -> None:
        """Run the transport's rest of the open in the background (the WebSocket awaits the connect hook
        without a task of its own); cancelled with the hooks' calls at shutdown."""
        self._hub.hooks.spawn(opening)

    def open(self, connection: Connection, *, ready: bool = True) -> None:
        """Register `connection` as this client's (`ready`: it can take a batch now; long-poll: once it polls).
        Raises LateRefused when a revocation, a user's disconnect or the drain came first: the client is not
        registered, and its transport closes it as that refusal says."""
        refusal = self._opening().settle()
        self._admission = None
        if refusal is not None:
            raise LateRefused(refusal)
        self.connection = connection
        self._hub.clients.register(connection, ready=ready)

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
        return connection is not None and self._hub.clients.conns.get(self.identity.client_id) is connection

    def handle(self, payload: bytes | str) -> int:
        """Run the commands of one message of the client (a frame, a body); returns how many. A failure is
        our bug, not the peer's: this client is closed with 1011, nobody else is disturbed."""
        if not self.live:
            return 0
        try:
            return self.commands(self, payload)
        except Exception:
            log.exception("%s client %s: a command failed", self.identity.transport, self.identity.client_id)
            self.close(close_codes.INTERNAL_ERROR, "internal error", "error")
            return 0

    def command(self, value: Any) -> None:
        """Run one command the transport makes for the client (SSE: the subscriptions its request names),
        not counted against the client's subscribe rate; a refusal is the client's error entry."""
        if self.live:
            commands.run_command(self, value)

    def send_error(self, exc: RequestError) -> None:
        """An error entry on the client's stream, with no request id (a refusal of its request's parts)."""
        if self.live:
            self._hub.clients.send_error(self.identity.client_id, exc)

    def bad_input(self, message: str, *args: object) -> None:
        """Count and log (at a bounded rate) a refused input of the client, under its transport's name."""
        self._hub.bad_input(self.identity.transport, message, *args)

    def client_state(self) -> Client:
        """The engine's state of this client (its subscriptions and cursors), to read: SSE's positions."""
        return self._hub.topics.client(self.identity.client_id)

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
            self._hub.clients.unregister(client_id, reason)

    def close(self, code: int, reason: str, cause: str = "closed") -> None:
        """End the client: its transport writes what is staged, then the close (`code`, `reason`), and it is
        forgotten (`cause`: the disconnect reason)."""
        if self.live:
            self._hub.clients.kick(self.identity.client_id, code, reason, cause)


def session_store(hub: Hub) -> SessionStore:
    """The session transports' tables (gateway/transports/sessions.py), for their endpoints that find a
    session by its secret: the one part of the hub they reach without a `ClientSession`."""
    return hub.sessions

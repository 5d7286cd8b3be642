"""The session transports' one store, `Hub.sessions`: the live long-poll sessions and SSE streams by their
secret, and what outlives a session (gateway/session_tables.py): the final body of a long-poll session closed
between two polls, and the checkpoints of SSE's compact `id:` form. Every table is bounded:

- `longpoll`: the live long-poll sessions (gateway/transports/longpoll.py); at most `longpoll.max_sessions`
  (the handshake, gateway/admission.py, refuses one more with 503; a client awaiting the connect
  hook holds its place from the handshake on) and `longpoll.max_sessions_per_ip` per address;
- `sse`: the live SSE streams (gateway/transports/sse.py); at most `sse.max_sessions_per_ip` per address,
  and each is one of the HTTP port's bounded connections;
- `closed`: the final bodies of long-poll sessions closed while no poll waited; `longpoll.session_ttl_s`
  and `longpoll.max_sessions` of them (`ClosedSessions`);
- `checkpoints`: the checkpoints of SSE's compact `id:` form; 2 per stream, kept 60 s after it ends, 4,096
  ended streams (`Checkpoints`).

A session is in its table from when its transport opens it until it ends (kick, expiry, `DELETE`, its
connection lost); the hub's registration of its client spans the same time.
"""

from __future__ import annotations

import secrets
from typing import Generic, Protocol, TypeVar

from .config import GatewayConfig
from .session_tables import CHECKPOINT_TTL_S, Checkpoints, ClosedSessions


def new_secret(prefix: str = "") -> str:
    """A session id of the URLs: 128 random bits (secrets), the only credential a session's requests carry;
    with several workers after a public `w{index}.` prefix naming the one that holds it (docs/cluster.md §5)."""
    return prefix + secrets.token_urlsafe(16)


class Session(Protocol):
    """A table holds anything with a secret; its transport narrows what `get` gives to its own class (the
    store knows neither transport, so the hub can hold it without importing them)."""

    @property
    def secret(self) -> str: ...


S = TypeVar("S", bound=Session)


class SessionTable(Generic[S]):
    """The live sessions of one transport by their secret; `limit`: how many it may hold (None: no bound of
    its own), asked by the handshake before a session is made (`full`), counting the places `reserved` by
    new clients that await the connect hook (gateway/admission.py, `Admission`)."""

    __slots__ = ("limit", "reserved", "_by_secret")

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.reserved = 0
        self._by_secret: dict[str, S] = {}

    def full(self) -> bool:
        return self.limit is not None and len(self._by_secret) + self.reserved >= self.limit

    def add(self, session: S) -> None:
        self._by_secret[session.secret] = session

    def get(self, secret: str) -> S | None:
        return self._by_secret.get(secret)

    def discard(self, session: S) -> None:
        """Forget `session` (only it: not another one held under the same secret)."""
        if self._by_secret.get(session.secret) is session:
            del self._by_secret[session.secret]

    def __len__(self) -> int:
        return len(self._by_secret)

    def secrets(self) -> list[str]:
        return list(self._by_secret)

    def __contains__(self, secret: object) -> bool:
        return secret in self._by_secret


class SessionStore:
    """Both session transports' tables (module docstring), made with the hub."""

    __slots__ = ("longpoll", "sse", "closed", "checkpoints")

    def __init__(self, config: GatewayConfig) -> None:
        lp = config.longpoll
        self.longpoll: SessionTable[Session] = SessionTable(lp.max_sessions)
        self.sse: SessionTable[Session] = SessionTable()
        #: the final body of long-poll sessions closed between two polls, for their next poll
        self.closed = ClosedSessions(lp.session_ttl_s, lp.max_sessions)
        #: the checkpoints of SSE streams' compact `id:` form (gateway/transports/sse.py, `IdLine`)
        self.checkpoints = Checkpoints(CHECKPOINT_TTL_S)

"""New clients on their way from the handshake to their registration (`ClientRegistry.pending`; the
handshake's `Admission`, gateway/admission.py), which the backend's connect hook can make last
up to `proxy.timeout_s`:

- per address, how many wait for the connect hook (`hooks_by_ip`, bounded by
  `proxy.max_pending_connects_per_ip`): the hook's slots (`proxy.max_concurrent`) serve every client, so one
  address holding them all would make every other client's handshake time out (1013);
- what the admin API and the drain did while they waited. A revocation, a user's disconnect and a drain close
  the registered clients they name; a client not registered yet would escape them (admitted after the
  admin API answered `disconnected: 0`, or served after the drain told everyone to go), so each records them
  here and is refused as it would register (`refusal`), with the close code they give (4010, 4005, 1012).

Bounds: an entry per client between its handshake and its registration (a connection of the HTTP port
each); what an entry records is what the operators did while it waited.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from . import close_codes
from .auth.identity import ClientIdentity
from .auth.revocations import Revocation
from .auth.tokens import Principal


@dataclass(frozen=True, slots=True)
class LateRefusal:
    """How a client is closed at the moment it would register: its close code and reason (those the gateway
    gives a registered client for the same cause), the disconnect reason (`fanout_disconnects`, the backend's
    disconnect event) and, for a drain, the reconnect hint in milliseconds."""

    code: int
    reason: str
    cause: str
    retry_ms: int | None = None


REVOKED = LateRefusal(close_codes.TOKEN_REVOKED, "token revoked", "token_revoked")
DISCONNECTED = LateRefusal(close_codes.DISCONNECTED, "disconnected by admin", "disconnected")


def drained(spread_s: float) -> LateRefusal:
    """A drain's close, with a hint of its own uniform in [0, spread_s] (as `ClientRegistry.drain` gives)."""
    retry_ms = random.randint(0, int(spread_s * 1000))
    return LateRefusal(close_codes.SERVICE_RESTART, f"restarting: reconnect in {retry_ms} ms", "drain", retry_ms)


class PendingConnect:
    """One client on its way: its identity (whose principal the connect hook may replace), the token it came
    with, and the revocations and user disconnects made since."""

    __slots__ = ("identity", "token", "revocations", "disconnected_users")

    def __init__(self, identity: ClientIdentity) -> None:
        self.identity = identity
        self.token = identity.principal
        self.revocations: list[Revocation] = []
        self.disconnected_users: set[str] = set()

    def principals(self) -> list[Principal]:
        """The token it came with and what it holds now (the connect hook's grant keeps the token's jti and iat)."""
        return [p for p in (self.token, self.identity.principal) if p is not None]


class PendingConnects:
    """Every client of this process between handshake and registration (module docstring)."""

    def __init__(self) -> None:
        self._waiting: dict[str, PendingConnect] = {}
        #: clients waiting for the connect hook, per peer address (`proxy.max_pending_connects_per_ip`)
        self.hooks_by_ip: Counter[str] = Counter()
        #: `server.drain_spread_s` once the process drains: every client still on its way is refused 1012
        self.drain_spread_s: float | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, identity: ClientIdentity) -> PendingConnect:
        pending = PendingConnect(identity)
        self._waiting[identity.client_id] = pending
        return pending

    def remove(self, pending: PendingConnect) -> None:
        if self._waiting.get(pending.identity.client_id) is pending:
            del self._waiting[pending.identity.client_id]

    # -- what happened meanwhile -----------------------------------------------------------------------

    def revoked(self, entry: Revocation) -> None:
        """A revocation is in force (this node's `ClientRegistry.revoke`)."""
        for pending in self._waiting.values():
            pending.revocations.append(entry)

    def disconnected(self, user: str) -> None:
        """An operator disconnected `user` (this node's `ControlCommands.disconnect_user`)."""
        for pending in self._waiting.values():
            pending.disconnected_users.add(user)

    def drain(self, spread_s: float) -> None:
        self.drain_spread_s = spread_s

    def refusal(self, pending: PendingConnect) -> LateRefusal | None:
        """How `pending` must be closed instead of registered, or None: what a registered client holding its
        token or its grant would have got."""
        principals = pending.principals()
        if any(entry.names(p) for entry in pending.revocations for p in principals):
            return REVOKED
        if any(p.user in pending.disconnected_users for p in principals):
            return DISCONNECTED
        if self.drain_spread_s is not None:
            return drained(self.drain_spread_s)
        return None

"""The lifetime of each connection's token: its expiry and the grace after it, or its refresh through the
backend's refresh hook (docs/integration.md), on one timer wheel for all clients.

An expired token gets a `token_expired` error entry and `auth.expired_grace_s` to send a fresh one, then the
connection is closed (4011). A token the connect hook granted with an expiry is refreshed
`proxy.refresh_before_s` before it; a refusal closes the connection, no answer is tried once more.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Hashable, Mapping

from core import RequestError

from . import close_codes
from .auth.tokens import Principal
from .config import GatewayConfig
from .errors import BackendUnavailable, TokenExpired
from .hooks.base import Hooks, Refused
from .scheduler import Connection
from .timerwheel import TimerWheel

#: the token timers' tick (gateway/timerwheel.py): an expiry, its grace or a refresh is at most this late
TOKEN_RESOLUTION_S = 0.25
#: what a client's token deadline does (the value of its entry on the wheel, with the principal and the try)
REFRESH, EXPIRED, GRACE_OVER = 0, 1, 2


class TokenLifetimes:
    def __init__(
        self,
        config: GatewayConfig,
        hooks: Hooks,
        conns: Mapping[Hashable, Connection],
        kick: Callable[[Hashable, int, str, str], bool],
        send_error: Callable[[Hashable, RequestError], None],
    ) -> None:
        self.config = config
        self.hooks = hooks
        #: the registry's connections, read-only here
        self.conns = conns
        #: the registry's `kick` and `send_error`
        self.kick = kick
        self.send_error = send_error
        #: per client: the deadline of its token's expiry, of the grace after it, or of a refresh (a loop timer
        #: per connection held ~0.6 KiB)
        self._wheel: TimerWheel[Hashable, tuple[int, Principal, int]] = TimerWheel(self._due, TOKEN_RESOLUTION_S)

    def cancel(self, client_id: Hashable) -> None:
        self._wheel.cancel(client_id)

    def close(self) -> None:
        self._wheel.close()

    def arm(self, client_id: str, principal: Principal) -> None:
        self._wheel.cancel(client_id)
        if principal.expires_at == math.inf:  # granted by the connect hook without an expiry
            return
        if principal.proxied and self.hooks.refreshes:
            now = time.time()
            delay = principal.expires_at - self.config.proxy.refresh_before_s - now
            if delay <= 0:  # within refresh_before_s already: half way to the expiry
                delay = max(0.0, (principal.expires_at - now) / 2)
            self._wheel.schedule(client_id, delay, (REFRESH, principal, 0))
            return
        delay = max(0.0, principal.expires_at + self.config.auth.leeway_s - time.time())
        self._wheel.schedule(client_id, delay, (EXPIRED, principal, 0))

    def _due(self, client_id: Hashable, due: tuple[int, Principal, int]) -> None:
        action, principal, attempt = due
        assert isinstance(client_id, str)
        if action == REFRESH:
            self._refresh(client_id, principal, attempt)
        elif action == EXPIRED:
            self._expired(client_id, principal)
        else:
            self._grace_over(client_id, principal)

    def _expired(self, client_id: str, principal: Principal) -> None:
        grace = self.config.auth.expired_grace_s
        self.send_error(client_id, TokenExpired(f"the token has expired: send auth with a fresh token within {grace:g} s"))
        self._wheel.schedule(client_id, grace, (GRACE_OVER, principal, 0))

    def _grace_over(self, client_id: str, principal: Principal) -> None:
        conn = self.conns.get(client_id)
        if conn is not None and conn.identity.principal is principal:  # not refreshed meanwhile
            self.kick(client_id, close_codes.TOKEN_EXPIRED, "token expired", "token_expired")

    def _refresh(self, client_id: str, principal: Principal, attempt: int) -> None:
        self.hooks.spawn(self._refreshing(client_id, principal, attempt))

    async def _refreshing(self, client_id: str, principal: Principal, attempt: int) -> None:
        """Ask the refresh hook to extend a proxy-granted expiry: a new `expires_at` re-arms the timer; a
        refusal closes the connection with 4011; no answer is tried once more, half way to the expiry, and
        past the expiry the connection is closed with 4011 (docs/integration.md)."""
        conn = self.conns.get(client_id)
        if conn is None or conn.identity.principal is not principal:
            return
        try:
            expires_at = await self.hooks.refresh(conn.identity)
        except Refused as exc:
            if self._still(client_id, principal):
                self.kick(client_id, close_codes.TOKEN_EXPIRED, f"refresh refused: {exc.message}"[:120], "token_expired")
            return
        except BackendUnavailable:
            if not self._still(client_id, principal):
                return
            left = principal.expires_at - time.time()
            if left <= 0:
                self.kick(client_id, close_codes.TOKEN_EXPIRED, "expired: the backend did not refresh it", "token_expired")
            elif attempt == 0:
                self._wheel.schedule(client_id, left / 2, (REFRESH, principal, 1))
            else:
                self._wheel.schedule(client_id, left, (REFRESH, principal, 1))
            return
        if not self._still(client_id, principal):
            return
        if expires_at <= time.time():
            self.kick(client_id, close_codes.TOKEN_EXPIRED, "expired: the backend did not extend it", "token_expired")
            return
        # through the session, the one writer of a registered client's identity; it re-arms the expiry
        self.conns[client_id].session.authenticate(dataclasses.replace(principal, expires_at=expires_at))

    def _still(self, client_id: str, principal: Principal) -> bool:
        """Whether the client is connected with that principal still (no `auth` replaced it meanwhile)."""
        conn = self.conns.get(client_id)
        return conn is not None and conn.identity.principal is principal

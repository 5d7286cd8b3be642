"""The client registry: who is connected, through which transport, from which address, as which user.

It registers and unregisters the transports' connections (with the engine, through the scheduler's engine,
and with the broker for the topics they leave), verifies tokens for connected clients, and owns the timers
that end a connection: the token's expiry and its grace, the idle check, and the watchdog of write-blocked
clients. `kick` is the one way a connection is closed by the gateway.

It also answers the operators' control commands (`on_control`, docs/integration.md, "User control"): kick a client,
disconnect a user, revoke tokens, list clients. The admin API sends them through the broker
(`Broker.control`), which runs them here and, with Redis, on every node (gateway/broker/control.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from core import CoreUsageError, RequestError
from core.entries import encode_reply

from . import close_codes
from .auth import Principal, TokenVerifier
from .broker import Broker
from .config import GatewayConfig
from .errors import BackendUnavailable, BadRequest, BadToken, InternalError, TokenExpired
from .hooks import Hooks, Refused
from .identity import ClientIdentity
from .pending_connects import PendingConnects
from .revocations import Revocation
from .scheduler import Connection, Scheduler
from .timerwheel import TimerWheel

log = logging.getLogger("gateway")

T = TypeVar("T")

#: the token timers' tick (gateway/timerwheel.py): an expiry, its grace or a refresh is at most this late
TOKEN_RESOLUTION_S = 0.25
#: what a client's token deadline does (the value of its entry on the wheel, with the principal and the try)
REFRESH, EXPIRED, GRACE_OVER = 0, 1, 2
#: the kicks an operator asked for, each logged (the others are counted: fanout_disconnects_total{reason};
#: a drain's or an idle sweep's thousands would flood the log)
LOGGED_KICKS = frozenset({"kicked", "disconnected", "token_revoked"})


class ClientRegistry:
    def __init__(self, config: GatewayConfig, scheduler: Scheduler, broker: Broker,
                 conns: dict[Hashable, Connection], hooks: Hooks) -> None:
        self.config = config
        self.scheduler = scheduler
        self.broker = broker
        #: the connections by client id (the scheduler reads the same dict)
        self.conns = conns
        self.tokens = TokenVerifier(config.auth)
        #: registered clients per (transport, peer IP), for per-address limits (shared memory with workers)
        self.clients_by_ip: Counter[tuple[str, str]] = Counter()
        self.by_transport: Counter[str] = Counter()
        self.disconnects: Counter[tuple[str, str]] = Counter()
        #: called on every arrival and departure (the GC policy counts them)
        self.on_arrival: Callable[[], None] = lambda: None
        self.on_departure: Callable[[], None] = lambda: None
        #: per client: the deadline of its token's expiry (or of the grace after it, or of a refresh), and of its
        #: idle check, each on one wheel for all clients (a loop timer per connection held ~0.6 KiB)
        self._token_timers: TimerWheel[Hashable, tuple[int, Principal, int]] = TimerWheel(
            self._token_due, TOKEN_RESOLUTION_S)
        idle = config.limits.idle_timeout_s
        self._idle_timers: TimerWheel[Hashable, None] = TimerWheel(
            self._idle_due, min(1.0, idle / 10) if idle > 0 else 1.0)
        self._watchdog: asyncio.TimerHandle | None = None
        #: the backend hooks (gateway/hooks.py): the disconnect event, the refresh of granted connections
        self.hooks = hooks
        #: each user's connections on this node, oldest first (dict order): O(1) per register / unregister
        self.by_user: dict[str, dict[Hashable, None]] = {}
        #: new clients not registered yet (awaiting the connect hook): revocations, disconnects and the drain
        #: reach them too (gateway/pending_connects.py)
        self.pending = PendingConnects()
        scheduler.kick = self.kick
        broker.control_handler = self.on_control

    def start(self) -> None:
        self._schedule_watchdog()

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._token_timers.close()
        self._idle_timers.close()

    def close_all(self) -> None:
        for client_id in list(self.conns):
            self.kick(client_id, close_codes.GOING_AWAY, "server shutting down", "shutdown")

    def drain(self, spread_s: float) -> int:
        """A graceful drain (SIGTERM): close every client with 1012 and its own reconnect hint, uniform in
        [0, spread_s] (so that a restart does not make a thundering herd). Returns how many were closed."""
        self.pending.drain(spread_s)  # and the clients on their way are refused as they come
        drained = 0
        for client_id in list(self.conns):
            retry_ms = random.randint(0, int(spread_s * 1000))
            drained += self.kick(client_id, close_codes.SERVICE_RESTART, f"restarting: reconnect in {retry_ms} ms",
                                 "drain", retry_ms)
        return drained

    # -- arrivals and departures ---------------------------------------------------------------------------

    def new_client_id(self, prefix: str) -> str:
        """64 random bits: ids are not secrets (nothing can be claimed by naming one), but never collide."""
        return f"{prefix}-{secrets.token_hex(8)}"

    def register(self, conn: Connection, *, ready: bool) -> None:
        identity = conn.identity
        cid = identity.client_id
        self.scheduler.engine.connect(cid, ready=ready, info=identity, owner=identity.owner)
        self.conns[cid] = conn
        self.clients_by_ip[(identity.transport, identity.ip)] += 1
        self.by_transport[identity.transport] += 1
        self.on_arrival()
        if identity.principal is not None:
            self._arm_token_expiry(cid, identity.principal)
            self._add_user_connection(identity.principal.user, cid)
        if self.config.limits.idle_timeout_s > 0:
            self._arm_idle(cid, self.config.limits.idle_timeout_s)
        if identity.proxy_topics:  # the connect hook's server-side subscriptions: no command, no permission check
            for name in identity.proxy_topics:
                if cid not in self.conns:
                    break  # cut by an earlier one (direct queue)
                try:
                    self.broker.subscribe(cid, name, since=None, request_id=None, creator=identity)
                except RequestError as exc:
                    self.send_error(cid, exc)

    def unregister(self, client_id: Hashable, reason: str) -> None:
        """Forget a connection everywhere. Every step runs even when one before it failed (each failure is
        logged): a half-done departure would leave counts, topic holders or the backend's events wrong."""
        conn = self.conns.pop(client_id, None)
        if conn is None:
            return
        identity = conn.identity
        steps: tuple[Callable[[], None], ...] = (
            lambda: self._forget_address_and_user(client_id, identity), lambda: self._leave_topics(client_id),
            lambda: self._count_departure(identity, reason), self.on_departure, self.scheduler.space)
        for step in steps:
            try:
                step()
            except Exception:
                log.exception("unregistering %s: a step failed (the others ran)", client_id)

    def _forget_address_and_user(self, client_id: Hashable, identity: ClientIdentity) -> None:
        key = (identity.transport, identity.ip)
        self.clients_by_ip[key] -= 1
        if not self.clients_by_ip[key]:
            del self.clients_by_ip[key]
        if identity.principal is not None:
            mine = self.by_user.get(identity.principal.user)
            if mine is not None:
                mine.pop(client_id, None)
                if not mine:
                    del self.by_user[identity.principal.user]
        self._token_timers.cancel(client_id)
        self._idle_timers.cancel(client_id)
        self.scheduler.write_unwatched(client_id)

    def _leave_topics(self, client_id: Hashable) -> None:
        """The engine forgets the client, then each of its topics is left (presence, the broker's holders)."""
        engine = self.scheduler.engine
        client = engine.client(client_id)
        names, owner = list(client.subs), client.owner
        engine.disconnect(client_id)
        presence = self.scheduler.presence
        for name in names:
            try:
                presence.left(client_id, name)
            finally:
                self.broker.left(name, owner, unsubscribed=False)

    def _count_departure(self, identity: ClientIdentity, reason: str) -> None:
        self.by_transport[identity.transport] -= 1
        self.disconnects[(identity.transport, reason)] += 1
        self.hooks.disconnected(identity, reason)

    def kick(self, client_id: Hashable, code: int, reason: str, metric_reason: str,
             retry_ms: int | None = None) -> bool:
        conn = self.conns.get(client_id)
        if conn is None:
            return False
        conn.kick(code, reason, retry_ms)
        if metric_reason in LOGGED_KICKS:
            log.info("kicked %s (%s): %s, close %d", client_id, metric_reason, reason, code,
                     extra={"client": str(client_id), "user": conn.identity.user, "reason": metric_reason,
                            "transport": conn.identity.transport, "code": code})
        self.unregister(client_id, metric_reason)
        return True

    def send_direct(self, client_id: Hashable, entry: bytes) -> None:
        self.scheduler.send_direct(client_id, entry)

    def send_error(self, client_id: Hashable, exc: RequestError, request_id: object = None) -> None:
        self.scheduler.send_error(client_id, exc, request_id)

    def reply_when_done(self, client_id: Hashable, request_id: Any, future: asyncio.Future[T],
                        result: Callable[[T], Any], what: str) -> None:
        """Answer a command whose outcome is `future` (now, or when the broker answers): its `reply` with
        `result(value)`, or its error entry; nothing once the client is gone."""

        def answer(done: asyncio.Future[T]) -> None:
            if client_id not in self.conns:
                return
            exc = done.exception()
            if isinstance(exc, RequestError):
                self.send_error(client_id, exc, request_id)
            elif exc is not None:
                self.send_error(client_id, InternalError(f"{what} failed: {exc}"), request_id)
            else:
                self.send_direct(client_id, encode_reply(request_id, result(done.result())))

        if future.done():
            answer(future)
        else:
            future.add_done_callback(answer)

    # -- identity ------------------------------------------------------------------------------------------

    def authenticate(self, client_id: str, token: object) -> Principal:
        """Verify a token for a connected client: a first token makes an anonymous connection its user's,
        a later one refreshes the same user's token (new expiry and patterns). Raises BadToken, TokenExpired."""
        principal = self.tokens.verify(token)
        identity = self.conns[client_id].identity
        if identity.principal is not None and identity.principal.user != principal.user:
            raise BadToken("the token is for another user than the connection's")
        if identity.principal is None:
            try:
                self.scheduler.engine.set_owner(client_id, principal.user)
            except CoreUsageError:
                raise BadToken("this connection holds private queues of its own: reconnect with the token") from None
        anonymous = identity.principal is None
        identity.principal = principal
        if principal.info is not None:
            identity.info = principal.info
        self._arm_token_expiry(client_id, principal)
        if anonymous:
            self._add_user_connection(principal.user, client_id)
        return principal

    def _add_user_connection(self, user: str, client_id: Hashable) -> None:
        """Index the connection under its user; past `limits.max_connections_per_user` on this node the
        user's oldest connections give way (4013): a client reconnecting after a network change is never
        locked out by its own half-open connection, which would hold its place until a ping timed out."""
        mine = self.by_user.setdefault(user, {})
        mine[client_id] = None
        limit = self.config.limits.max_connections_per_user
        while 0 < limit < len(mine):
            oldest = next(iter(mine))
            if not self.kick(oldest, close_codes.REPLACED, "replaced by a newer connection", "replaced"):
                mine.pop(oldest, None)  # not registered (cannot happen): never loop

    # -- operators' control commands (the admin API, through Broker.control) -------------------------------

    def on_control(self, command: dict[str, Any]) -> dict[str, Any]:
        """Run one control command on this node: `kick` (`client`), `disconnect` (`user`), `revoke`
        (`entry`, a `Revocation.as_dict`), `list` (`limit`). Returns this node's answer. Raises a
        RequestError for a malformed command (and TooManyRevocations)."""
        op = command.get("op")
        if op == "kick":
            return {"kicked": self.kick(str(command.get("client")), close_codes.KICKED, "kicked by admin", "kicked")}
        if op == "disconnect":
            return {"disconnected": self.disconnect_user(str(command.get("user")))}
        if op == "revoke":
            entry, closed = self.revoke(Revocation.from_dict(command.get("entry")))
            return {"disconnected": closed, "entry": entry.as_dict()}
        if op == "list":
            limit = command.get("limit")
            if not isinstance(limit, int) or limit < 0:
                raise BadRequest("`limit` must be a non-negative integer")
            return {"clients": self.describe(limit), "total": len(self.conns)}
        raise BadRequest(f"unknown control command {str(op)[:32]!r}")

    def disconnect_user(self, user: str) -> int:
        """Close every connection of `user` on this node (4005). Returns how many."""
        self.pending.disconnected(user)  # a client on its way is refused as it registers
        closed = 0
        for client_id in list(self.by_user.get(user, ())):
            closed += self.kick(client_id, close_codes.DISCONNECTED, "disconnected by admin", "disconnected")
        return closed

    def revoke(self, entry: Revocation) -> tuple[Revocation, int]:
        """Add `entry` to the revocation table and close the connections on this node that hold a token it
        names (4010). Returns the entry in force (an earlier one may be wider) and how many were closed. A
        `jti` entry looks at every authenticated connection (revocations are rare; a user entry only at the
        user's)."""
        entry = self.tokens.revocations.add(entry)
        self.pending.revoked(entry)  # a client on its way is refused as it registers
        if entry.user is not None:
            candidates = list(self.by_user.get(entry.user, ()))
        else:
            candidates = [cid for ids in self.by_user.values() for cid in ids]
        closed = 0
        for client_id in candidates:
            conn = self.conns.get(client_id)
            principal = conn.identity.principal if conn is not None else None
            if principal is not None and entry.names(principal):
                closed += self.kick(client_id, close_codes.TOKEN_REVOKED, "token revoked", "token_revoked")
        return entry, closed

    def describe(self, limit: int) -> list[dict[str, Any]]:
        """At most `limit` of this node's clients as `GET /api/clients` lists them."""
        clients: list[dict[str, Any]] = []
        for client_id, conn in self.conns.items():
            if len(clients) >= limit:
                break
            client = self.scheduler.engine.client(client_id)
            clients.append({
                "id": client.id,
                "user": conn.identity.user,
                "state": client.state.value,
                "subscriptions": sorted(client.subs),
                "direct_queued": client.queued(),
                "active_handles": len(client.active),
                **conn.describe(),
            })
        return clients

    def _arm_token_expiry(self, client_id: str, principal: Principal) -> None:
        self._token_timers.cancel(client_id)
        if principal.expires_at == math.inf:  # granted by the connect hook without an expiry
            return
        if principal.proxied and self.hooks.refreshes:
            now = time.time()
            delay = principal.expires_at - self.config.proxy.refresh_before_s - now
            if delay <= 0:  # within refresh_before_s already: half way to the expiry
                delay = max(0.0, (principal.expires_at - now) / 2)
            self._token_timers.schedule(client_id, delay, (REFRESH, principal, 0))
            return
        delay = max(0.0, principal.expires_at + self.config.auth.leeway_s - time.time())
        self._token_timers.schedule(client_id, delay, (EXPIRED, principal, 0))

    def _token_due(self, client_id: Hashable, due: tuple[int, Principal, int]) -> None:
        action, principal, attempt = due
        assert isinstance(client_id, str)
        if action == REFRESH:
            self._refresh(client_id, principal, attempt)
        elif action == EXPIRED:
            self._token_expired(client_id, principal)
        else:
            self._grace_over(client_id, principal)

    def _token_expired(self, client_id: str, principal: Principal) -> None:
        grace = self.config.auth.expired_grace_s
        self.send_error(client_id, TokenExpired(f"the token has expired: send auth with a fresh token within {grace:g} s"))
        self._token_timers.schedule(client_id, grace, (GRACE_OVER, principal, 0))

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
                self._token_timers.schedule(client_id, left / 2, (REFRESH, principal, 1))
            else:
                self._token_timers.schedule(client_id, left, (REFRESH, principal, 1))
            return
        if not self._still(client_id, principal):
            return
        if expires_at <= time.time():
            self.kick(client_id, close_codes.TOKEN_EXPIRED, "expired: the backend did not extend it", "token_expired")
            return
        renewed = dataclasses.replace(principal, expires_at=expires_at)
        self.conns[client_id].identity.principal = renewed
        self._arm_token_expiry(client_id, renewed)

    def _still(self, client_id: str, principal: Principal) -> bool:
        """Whether the client is connected with that principal still (no `auth` replaced it meanwhile)."""
        conn = self.conns.get(client_id)
        return conn is not None and conn.identity.principal is principal

    # -- timers --------------------------------------------------------------------------------------------

    def _arm_idle(self, client_id: str, delay: float) -> None:
        self._idle_timers.schedule(client_id, delay, None)

    def _idle_due(self, client_id: Hashable, _: None) -> None:
        assert isinstance(client_id, str)
        self._check_idle(client_id)

    def _check_idle(self, client_id: str) -> None:
        # One deadline per connection, re-armed lazily: commands only stamp `last_command`.
        conn = self.conns.get(client_id)
        if conn is None:
            return
        limit = self.config.limits.idle_timeout_s
        quiet = time.monotonic() - conn.identity.last_command
        if self.scheduler.engine.client(client_id).subs:
            self._arm_idle(client_id, limit)
        elif quiet < limit:
            self._arm_idle(client_id, limit - quiet)
        else:
            self.kick(client_id, close_codes.IDLE, "idle: no subscription and no command", "idle")

    def _schedule_watchdog(self) -> None:
        period = min(1.0, self.config.websocket.blocked_timeout_s / 4)
        self._watchdog = asyncio.get_running_loop().call_later(period, self._on_watchdog)

    def _on_watchdog(self) -> None:
        # Cost: O(write-blocked clients) only.
        limit = self.config.websocket.blocked_timeout_s
        now = time.monotonic()
        for client_id, conn in list(self.scheduler.blocked.items()):
            if conn.blocked_since is not None and now - conn.blocked_since > limit:
                log.info("disconnecting %s: write-blocked for more than %.1f s", client_id, limit)
                self.kick(client_id, close_codes.SLOW_CONSUMER, "slow consumer", "slow_consumer")
        self._schedule_watchdog()

    # -- metrics -------------------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        clients = GaugeMetricFamily("fanout_clients", "connected clients", labels=["transport"])
        for transport, count in sorted(self.by_transport.items()):
            clients.add_metric([transport], count)
        yield clients
        disconnects = CounterMetricFamily("fanout_disconnects", "disconnects by reason", labels=["transport", "reason"])
        for (transport, reason), count in sorted(self.disconnects.items()):
            disconnects.add_metric([transport, reason], count)
        yield disconnects
        yield CounterMetricFamily("fanout_auth_rate_limited", "token checks refused past auth.rate_per_ip",
                                  value=self.tokens.per_address.refused)

"""The client registry: who is connected, through which transport, from which address, as which user.

It registers and unregisters the transports' connections (with the engine, through the scheduler's verbs,
and with the broker for the topics they leave), verifies tokens for connected clients, and owns the timers
that end a connection: the token's expiry and its grace, the idle check, and the watchdog of write-blocked
clients. `kick` is the one way a connection is closed by the gateway. The operators' control commands use
it (gateway/control_commands.py).
"""

from __future__ import annotations

import asyncio
import logging
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
from .auth.identity import ClientIdentity
from .auth.tokens import Principal, TokenVerifier
from .broker.base import Broker
from .config import GatewayConfig
from .edge.ratelog import RateLog
from .errors import BadToken, InternalError
from .hooks.base import Hooks
from .ops.tracing import NO_TRACING, Tracing
from .pending_connects import PendingConnects
from .scheduler import Connection, Scheduler
from .timerwheel import TimerWheel
from .token_lifetimes import TokenLifetimes

log = logging.getLogger("gateway")

T = TypeVar("T")

#: the kicks an operator asked for, each logged (the others are counted: fanout_disconnects_total{reason};
#: a drain's or an idle sweep's thousands would flood the log)
LOGGED_KICKS = frozenset({"kicked", "disconnected", "token_revoked"})


class ClientRegistry:
    def __init__(
        self,
        config: GatewayConfig,
        scheduler: Scheduler,
        broker: Broker,
        conns: dict[Hashable, Connection],
        hooks: Hooks,
        *,
        tracing: Tracing = NO_TRACING,
        on_arrival: Callable[[], None] = lambda: None,
        on_departure: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        #: the scheduler's verbs on clients and subscriptions: the registry's only way to change the engine
        self.membership = scheduler.membership
        self.broker = broker
        #: the connections by client id (the scheduler reads the same dict)
        self.conns = conns
        self.tokens = TokenVerifier(config.auth, tracing, tenant_claim=config.fairness.tenant_claim)
        #: tenants (gateway/tenancy.py): the scheduler's, which gives the engine their weights
        self.tenancy = scheduler.tenancy
        #: registered clients per (transport, peer IP), for per-address limits (shared memory with workers)
        self.clients_by_ip: Counter[tuple[str, str]] = Counter()
        self.by_transport: Counter[str] = Counter()
        self.disconnects: Counter[tuple[str, str]] = Counter()
        #: called on every arrival and departure (the GC policy counts them)
        self.on_arrival = on_arrival
        self.on_departure = on_departure
        #: per client: its token's expiry, grace or refresh (gateway/token_lifetimes.py), and its idle check,
        #: each on one wheel for all clients (a loop timer per connection held ~0.6 KiB)
        self.token_lifetimes = TokenLifetimes(config, hooks, conns, self.kick, self.send_error)
        idle = config.limits.idle_timeout_s
        self._idle_timers: TimerWheel[Hashable, None] = TimerWheel(self._idle_due, min(1.0, idle / 10) if idle > 0 else 1.0)
        self._watchdog: asyncio.TimerHandle | None = None
        #: slow-consumer cuts: each counted (fanout_disconnects_total{reason="slow_consumer"}), 1 line/s logged, burst 5
        self.slow_log = RateLog(log, 1.0, 5)
        #: the backend hooks (gateway/hooks/base.py): the disconnect event, the refresh of granted connections
        self.hooks = hooks
        #: each user's connections on this node, oldest first (dict order): O(1) per register / unregister
        self.by_user: dict[str, dict[Hashable, None]] = {}
        #: new clients not registered yet (awaiting the connect hook): revocations, disconnects and the drain
        #: reach them too (gateway/pending_connects.py)
        self.pending = PendingConnects()

    def start(self) -> None:
        self._schedule_watchdog()

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.token_lifetimes.close()
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
            drained += self.kick(
                client_id, close_codes.SERVICE_RESTART, f"restarting: reconnect in {retry_ms} ms", "drain", retry_ms
            )
        return drained

    # -- arrivals and departures ---------------------------------------------------------------------------

    def new_client_id(self, prefix: str) -> str:
        """64 random bits: ids are not secrets (nothing can be claimed by naming one), but never collide."""
        return f"{prefix}-{secrets.token_hex(8)}"

    def register(self, conn: Connection, *, ready: bool) -> None:
        identity = conn.identity
        cid = identity.client_id
        self.membership.connect(conn, ready=ready)
        self.conns[cid] = conn
        self.clients_by_ip[(identity.transport, identity.ip)] += 1
        self.by_transport[identity.transport] += 1
        self.on_arrival()
        if identity.principal is not None:
            self.token_lifetimes.arm(cid, identity.principal)
            self._add_user_connection(identity.principal.user, cid)
        if self.config.limits.idle_timeout_s > 0:
            self._arm_idle(cid, self.config.limits.idle_timeout_s)

    def unregister(self, client_id: Hashable, reason: str) -> None:
        """Forget a connection everywhere. Every step runs even when one before it failed (each failure is
        logged): a half-done departure would leave counts, topic holders or the backend's events wrong."""
        conn = self.conns.pop(client_id, None)
        if conn is None:
            return
        identity = conn.identity
        steps: tuple[Callable[[], None], ...] = (
            lambda: self._forget_address_and_user(client_id, identity),
            lambda: self._leave_topics(client_id),
            lambda: self._count_departure(identity, reason),
            self.on_departure,
            self.scheduler.space,
        )
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
        self.token_lifetimes.cancel(client_id)
        self._idle_timers.cancel(client_id)
        self.scheduler.write_unwatched(client_id)

    def _leave_topics(self, client_id: Hashable) -> None:
        """The engine forgets the client, then each of its topics is left (presence, the broker's holders)."""
        names, owner = self.membership.disconnect(client_id)
        presence = self.scheduler.presence
        presence.forget(client_id)
        for name in names:
            try:
                presence.left(client_id, name)
            finally:
                self.broker.left(name, owner, unsubscribed=False)

    def _count_departure(self, identity: ClientIdentity, reason: str) -> None:
        self.by_transport[identity.transport] -= 1
        self.disconnects[(identity.transport, reason)] += 1
        self.hooks.disconnected(identity, reason)

    def kick(self, client_id: Hashable, code: int, reason: str, metric_reason: str, retry_ms: int | None = None) -> bool:
        conn = self.conns.get(client_id)
        if conn is None:
            return False
        conn.kick(code, reason, retry_ms)
        if metric_reason in LOGGED_KICKS:
            log.info(
                "kicked %s (%s): %s, close %d",
                client_id,
                metric_reason,
                reason,
                code,
                extra={
                    "client": str(client_id),
                    "user": conn.identity.user,
                    "reason": metric_reason,
                    "transport": conn.identity.transport,
                    "code": code,
                },
            )
        self.unregister(client_id, metric_reason)
        return True

    def send_direct(self, client_id: Hashable, entry: bytes) -> None:
        self.membership.send_direct(client_id, entry)

    def direct_room(self, client_id: Hashable) -> int:
        return self.membership.direct_room(client_id)

    def send_error(self, client_id: Hashable, exc: RequestError, request_id: object = None) -> None:
        self.membership.send_error(client_id, exc, request_id)

    def reply_when_done(
        self, client_id: Hashable, request_id: Any, future: asyncio.Future[T], result: Callable[[T], Any], what: str
    ) -> None:
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

    def claim_owner(self, client_id: str, user: str) -> None:
        """An anonymous connection becomes `user`'s (its first token, `ClientSession.authenticate`): its
        private queues, if any, are its own. Raises BadToken when it holds private queues already."""
        try:
            self.membership.set_owner(client_id, user)
        except CoreUsageError:
            raise BadToken("this connection holds private queues of its own: reconnect with the token") from None

    def assign_tenant(self, client_id: str, tenant: str, user: str) -> None:
        """The connection's service counts to `user` of `tenant` (its first token)."""
        self.membership.set_tenant(client_id, tenant, user)

    def authenticated(self, client_id: str, principal: Principal, *, first: bool) -> None:
        """The connection holds `principal` now (`ClientSession.authenticate`): its expiry is armed, and a
        `first` one indexes the connection under its user."""
        self.token_lifetimes.arm(client_id, principal)
        if first:
            self._add_user_connection(principal.user, client_id)

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
        quiet = time.monotonic() - conn.session.state.last_command
        if self.scheduler.topics.client(client_id).subs:
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
                self.slow_log("disconnecting %s: write-blocked for more than %.1f s", client_id, limit)
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
        yield CounterMetricFamily(
            "fanout_auth_rate_limited", "token checks refused past auth.rate_per_ip", value=self.tokens.per_address.refused
        )

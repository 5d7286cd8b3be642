"""The hub: one core engine, the connections of every transport, and the scheduler task that drives it.

Transports are adapters: each connection object implements `Connection` and the hub never knows more of
it. The scheduler task runs `run_cycle` whenever there is work (an event set by publish, subscribe, ready),
hands each batch to its connection without awaiting it, and sleeps when idle.

The hub is the transports' only door to the engine for anything that changes it: each hub method makes
the engine call and the wake-up or bookkeeping it needs, so no transport can forget a wake (a silent
stall). Transports may read the engine (`hub.engine.topics()`, `topic_config`, counters) directly.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Hashable, Protocol

from core import Batch, CoreUsageError, Engine, Published, QueueFull, RequestError, TopicKind
from core.entries import encode_error, encode_reply

from . import close_codes
from .auth import Principal, TokenVerifier
from .broker import Broker, make_broker
from .config import GatewayConfig
from .deliverylog import DeliveryLog
from .errors import BadToken, InternalError, TokenExpired
from .gcpolicy import GcPolicy
from .identity import ClientIdentity
from .metrics import Metrics
from .ratelog import BadInputLog
from .topic_budget import CreationBudget
from .transports.rawtcp import RawBroadcastServer
from .transports.sessions import SessionStore

log = logging.getLogger("gateway")

#: a linger due within this much is ended now: the loop's timers tick in milliseconds and may fire early
LINGER_SLACK_S = 0.001


class Connection(Protocol):
    identity: ClientIdentity

    def deliver(self, batch: Batch, frame: bytes) -> bool:
        """Start writing one batch; True if the write completed at once (the client is ready again)."""

    def kick(self, code: int, reason: str) -> None:
        """Close the connection with a protocol close code and reason."""

    def describe(self) -> dict[str, Any]:
        """State for the admin API."""


class Hub:
    def __init__(self, config: GatewayConfig, *, instance_id: str | None = None) -> None:
        self.config = config
        self.instance_id = instance_id or secrets.token_hex(4)
        self.engine = Engine(config.engine_config(), instance_id=self.instance_id)
        self.conns: dict[Hashable, Connection] = {}
        self.gc = GcPolicy(config.server.gc_full_interval_s)
        self.bad_input = BadInputLog(config.limits.bad_input_log_per_s)
        self.metrics = Metrics(self)
        self._work = asyncio.Event()
        #: connections with frames staged in the current round (`_flush_staged` writes them)
        self.staged: dict[Any, None] = {}
        #: those of them whose client is caught up: written after the cycle, not at the round's end
        self.caught_up: dict[Any, None] = {}
        #: a round runs up to this many cycles (or `coalesce_s`) while work remains, then writes once per client
        self.coalesce_cycles = config.scheduler.write_coalesce_cycles
        self.coalesce_s = config.scheduler.write_coalesce_ms / 1000
        #: rounds run, and write calls of staged data (`/metrics`: batches written / writes = what rounds save)
        self.rounds = 0
        self.staged_writes = 0
        #: staged bytes per connection at which it is written before the round ends (gateway/transports/staging.py)
        self.stage_limit = config.websocket.write_high_water
        self._task: asyncio.Task | None = None
        self._tick: asyncio.TimerHandle | None = None
        self.tokens = TokenVerifier(config.auth)
        #: topic creations by clients: per connection, per address, in total (gateway/topic_budget.py)
        self.creations = CreationBudget(config.limits, lambda: self.engine.topic_count)
        #: registered clients per (transport, peer IP), for per-address limits
        self.clients_by_ip: Counter[tuple[str, str]] = Counter()
        #: per client: the timer of its token's expiry (or of the grace after it), and of its idle check
        self._token_timers: dict[Hashable, asyncio.TimerHandle] = {}
        self._idle_timers: dict[Hashable, asyncio.TimerHandle] = {}
        #: publishers waiting for space in a private queue: (topic, client) -> futures
        self._space_waiters: dict[tuple[str, Hashable], list[asyncio.Future]] = {}
        #: connections whose last write has not drained (not ready), watched for the blocked timeout
        self.blocked: dict[Hashable, Any] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        #: armed while a topic lingers (`TopicConfig.linger`): wakes its held subscribers when it is due
        self._linger: asyncio.TimerHandle | None = None
        self._linger_due = 0.0
        #: long-poll sessions and SSE streams by their secret, and what outlives them (gateway/transports/sessions.py)
        self.sessions = SessionStore(config)
        self.raw: RawBroadcastServer | None = None  # the raw TCP broadcaster, when enabled
        self.ingest = None
        #: called when the server shuts down, after the clients were closed: streams that are not clients
        #: (the admin stats stream) end too, so shutdown never waits for them
        self.closing_hooks: list[Callable[[], None]] = []
        #: the sampled delivery log ([deliverylog], gateway/deliverylog.py), when enabled
        self.delivery_log: DeliveryLog | None = None
        if config.deliverylog.enabled:
            self.delivery_log = DeliveryLog(config.deliverylog, self)
        #: where topics live: this engine (default) or Redis shared with other nodes (docs/cluster.md)
        self.broker: Broker = make_broker(self)
        #: with a broker, private queues live in Redis and commits are acknowledged there (docs/cluster.md §8)
        self.engine.report_commits = self.broker.distributed

    # -- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.broker.start()
        self._task = asyncio.get_running_loop().create_task(self._scheduler(), name="fanout-scheduler")
        self._schedule_tick()
        self._schedule_watchdog()
        self.gc.start()

    async def stop(self) -> None:
        self.gc.stop()
        for timer in (self._tick, self._watchdog, self._linger, *self._token_timers.values(), *self._idle_timers.values()):
            if timer:
                timer.cancel()
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.close_all_clients()
        await self.broker.stop()

    def close_all_clients(self) -> None:
        for client_id in list(self.conns):
            self.kick(client_id, close_codes.GOING_AWAY, "server shutting down", "shutdown")
        for hook in self.closing_hooks:
            hook()

    def _schedule_tick(self) -> None:
        period = self.config.scheduler.hole_tick_ms / 1000
        loop = asyncio.get_running_loop()
        self._tick = loop.call_later(period, self._on_tick)

    def _on_tick(self) -> None:
        # Cost: O(topics that hold an out-of-order hole), nothing when there is none; reclaim costs
        # O(topics that became unused + topics whose time is up).
        now = time.monotonic()
        if self.engine.tick(now):
            self.wake()
        ttl = self.config.limits.topic_ttl_s
        if ttl > 0:
            self.engine.reclaim(now, ttl, self.config.limits.topic_history_ttl_s)
        self._schedule_tick()

    def _schedule_watchdog(self) -> None:
        period = min(1.0, self.config.websocket.blocked_timeout_s / 4)
        self._watchdog = asyncio.get_running_loop().call_later(period, self._on_watchdog)

    def _on_watchdog(self) -> None:
        # Cost: O(write-blocked clients) only.
        limit = self.config.websocket.blocked_timeout_s
        now = time.monotonic()
        for client_id, conn in list(self.blocked.items()):
            if conn.blocked_since is not None and now - conn.blocked_since > limit:
                log.info("disconnecting %s: write-blocked for more than %.1f s", client_id, limit)
                self.kick(client_id, close_codes.SLOW_CONSUMER, "slow consumer", "slow_consumer")
        self._schedule_watchdog()

    # -- connections -----------------------------------------------------------------------------------

    def new_client_id(self, prefix: str) -> str:
        """64 random bits: ids are not secrets (nothing can be claimed by naming one), but never collide."""
        return f"{prefix}-{secrets.token_hex(8)}"

    def register(self, conn: Connection, *, ready: bool) -> None:
        identity = conn.identity
        cid = identity.client_id
        self.engine.connect(cid, ready=ready, info=identity, owner=identity.owner)
        self.conns[cid] = conn
        self.clients_by_ip[(identity.transport, identity.ip)] += 1
        self.metrics.connected(identity.transport)
        self.gc.arrived()
        if identity.principal is not None:
            self._arm_token_expiry(cid, identity.principal)
        if self.config.limits.idle_timeout_s > 0:
            self._arm_idle(cid, self.config.limits.idle_timeout_s)

    def unregister(self, client_id: Hashable, reason: str) -> None:
        conn = self.conns.pop(client_id, None)
        if conn is None:
            return
        identity = conn.identity
        key = (identity.transport, identity.ip)
        self.clients_by_ip[key] -= 1
        if not self.clients_by_ip[key]:
            del self.clients_by_ip[key]
        for timers in (self._token_timers, self._idle_timers):
            timer = timers.pop(client_id, None)
            if timer is not None:
                timer.cancel()
        self.blocked.pop(client_id, None)
        names = list(self.engine.client(client_id).subs) if self.broker.distributed else ()
        owner = self.engine.client(client_id).owner
        self.engine.disconnect(client_id)
        for name in names:
            if self.queued_in_broker(name):
                self.broker.queues.released(name, owner)  # type: ignore[attr-defined]  # RedisBroker
            else:
                self.broker.release(name)
        self.metrics.disconnected(identity.transport, reason)
        self.gc.departed()
        self._wake_space_waiters()

    # -- identity ------------------------------------------------------------------------------------

    def authenticate(self, client_id: str, token: object) -> Principal:
        """Verify a token for a connected client: a first token makes an anonymous connection its user's,
        a later one refreshes the same user's token (new expiry and patterns). Raises BadToken, TokenExpired."""
        principal = self.tokens.verify(token)
        identity = self.conns[client_id].identity
        if identity.principal is not None and identity.principal.user != principal.user:
            raise BadToken("the token is for another user than the connection's")
        if identity.principal is None:
            try:
                self.engine.set_owner(client_id, principal.user)
            except CoreUsageError:
                raise BadToken("this connection holds private queues of its own: reconnect with the token") from None
        identity.principal = principal
        self._arm_token_expiry(client_id, principal)
        return principal

    def _arm_token_expiry(self, client_id: str, principal: Principal) -> None:
        old = self._token_timers.pop(client_id, None)
        if old is not None:
            old.cancel()
        delay = max(0.0, principal.expires_at + self.config.auth.leeway_s - time.time())
        loop = asyncio.get_running_loop()
        self._token_timers[client_id] = loop.call_later(delay, self._token_expired, client_id, principal)

    def _token_expired(self, client_id: str, principal: Principal) -> None:
        grace = self.config.auth.expired_grace_s
        self.send_error(client_id, TokenExpired(f"the token has expired: send auth with a fresh token within {grace:g} s"))
        loop = asyncio.get_running_loop()
        self._token_timers[client_id] = loop.call_later(grace, self._grace_over, client_id, principal)

    def _grace_over(self, client_id: str, principal: Principal) -> None:
        conn = self.conns.get(client_id)
        if conn is not None and conn.identity.principal is principal:  # not refreshed meanwhile
            self._token_timers.pop(client_id, None)
            self.kick(client_id, close_codes.TOKEN_EXPIRED, "token expired", "token_expired")

    def _arm_idle(self, client_id: str, delay: float) -> None:
        self._idle_timers[client_id] = asyncio.get_running_loop().call_later(delay, self._check_idle, client_id)

    def _check_idle(self, client_id: str) -> None:
        # One timer per connection, re-armed lazily: commands only stamp `last_command`.
        conn = self.conns.get(client_id)
        if conn is None:
            return
        limit = self.config.limits.idle_timeout_s
        quiet = time.monotonic() - conn.identity.last_command
        if self.engine.client(client_id).subs:
            self._arm_idle(client_id, limit)
        elif quiet < limit:
            self._arm_idle(client_id, limit - quiet)
        else:
            self._idle_timers.pop(client_id, None)
            self.kick(client_id, close_codes.IDLE, "idle: no subscription and no command", "idle")

    def kick(self, client_id: Hashable, code: int, reason: str, metric_reason: str) -> bool:
        conn = self.conns.get(client_id)
        if conn is None:
            return False
        conn.kick(code, reason)
        self.unregister(client_id, metric_reason)
        return True

    # -- the core's verbs, with the wake-up the scheduler needs --------------------------------------------

    def wake(self) -> None:
        if self.engine.lingering:
            self._arm_linger()
        if self.engine.has_work:
            self._work.set()

    def _arm_linger(self) -> None:
        """The timer goes off at the earliest linger's end: a topic with a shorter linger held after one
        with a longer may end first."""
        due = self.engine.next_release()
        if due is None or (self._linger is not None and self._linger_due <= due):
            return
        if self._linger is not None:
            self._linger.cancel()
        self._linger_due = due
        self._linger = asyncio.get_running_loop().call_later(max(0.0, due - time.monotonic()), self._on_linger)

    def _on_linger(self) -> None:
        self._linger = None
        self.engine.release(time.monotonic() + LINGER_SLACK_S)
        self.wake()

    def write_blocked(self, client_id: str, conn: Any) -> None:
        """A write did not drain at once: the client is not ready, and the watchdog watches it."""
        self.blocked[client_id] = conn

    def write_drained(self, client_id: str) -> None:
        """The blocked write drained: the client is ready again."""
        self.blocked.pop(client_id, None)
        self.write_done(client_id)

    def write_unwatched(self, client_id: str) -> None:
        """The connection is gone: stop watching its write (the hub unregisters it separately)."""
        self.blocked.pop(client_id, None)

    def write_done(self, client_id: str) -> None:
        if client_id in self.conns:
            self.engine.write_done(client_id)
            self._wake_space_waiters()
            self.wake()

    def commit(self, client_id: str) -> None:
        self.engine.commit(client_id)
        self._wake_space_waiters()

    def mark_ready(self, client_id: str) -> None:
        self.engine.mark_ready(client_id)
        self.wake()

    def mark_idle(self, client_id: str) -> None:
        self.engine.mark_idle(client_id)

    def create_topic(self, name: str, config: Any) -> Any:
        return self.engine.create_topic(name, config)

    def resolve(self, name: str) -> Any:
        """The topic, created on first use by a rule."""
        return self.engine.resolve(name)

    def creating(self, identity: ClientIdentity, name: str) -> bool:
        """Whether a client's subscribe or publish on `name` creates a topic here (then the caller charges
        `creations` once it did); raises `TooManyCreatedTopics` when the client may create no more. A topic
        that goes through a broker is created in Redis, which alone knows whether it exists: the broker asks
        `creations` itself and charges only a creation that happened (docs/cluster.md §2)."""
        if self.engine.has_topic(name) or self.via_broker(name):
            return False
        self.creations.check(identity)
        return True

    def subscribe(self, client_id: str, topic: str, *, since: tuple[str, int] | None = None, request_id: Any = None) -> None:
        """Subscribe now, or, with a broker, once the topic is attached (its answer, `subscribed` or an
        error entry, then comes from the attach)."""
        if self.queued_in_broker(topic):
            self.broker.queues.subscribe(client_id, topic, request_id)  # type: ignore[attr-defined]  # RedisBroker
            return
        if self.via_broker(topic):
            if not self.broker.attached(topic):
                self.broker.attach(topic, creator=self.conns[client_id].identity).add_done_callback(
                    lambda ready: self._subscribe_attached(ready, client_id, topic, since, request_id))
                return
            self.broker.hold(topic)
        self.engine.subscribe(client_id, topic, since=since, request_id=request_id)
        self.wake()

    def _subscribe_attached(
        self, ready: asyncio.Future, client_id: str, topic: str, since: tuple[str, int] | None, request_id: Any
    ) -> None:
        if client_id not in self.conns:
            self.broker.release(topic)
            return
        try:
            exc = ready.exception()
            if isinstance(exc, RequestError):
                raise exc
            if exc is not None:
                raise InternalError(f"subscribing to {topic!r} failed: {exc}")
            self.broker.hold(topic)
            self.engine.subscribe(client_id, topic, since=since, request_id=request_id)
        except RequestError as err:
            self.send_error(client_id, err, request_id)
        self.wake()

    def unsubscribe(self, client_id: str, topic: str, *, request_id: Any = None) -> None:
        owner = self.engine.client(client_id).owner
        self.engine.unsubscribe(client_id, topic, request_id=request_id)
        if self.queued_in_broker(topic):
            self.broker.queues.unsubscribed(topic, owner)  # type: ignore[attr-defined]  # RedisBroker
        else:
            self.broker.release(topic)
        self.wake()

    def queued_in_broker(self, topic: str) -> bool:
        """Whether `topic` is private and its queues live in the broker (Redis, docs/cluster.md §8)."""
        if not self.broker.distributed:
            return False
        config = self.engine.topic_config(topic)
        return config is not None and config.kind is TopicKind.PRIVATE

    def via_broker(self, topic: str) -> bool:
        """Whether `topic`'s publishes and subscribes go through a distributed broker: shared kinds with
        one configured (private queues go through `queued_in_broker` instead, docs/cluster.md §8)."""
        if not self.broker.distributed:
            return False
        config = self.engine.topic_config(topic)
        return config is None or config.kind is not TopicKind.PRIVATE

    async def create_topic_async(self, name: str, config: Any) -> Any:
        """Create a topic (cluster-wide with a broker); returns its INFO."""
        if self.broker.distributed and config.kind is not TopicKind.PRIVATE:
            await self.broker.create(name, config)
            info = self.engine.topic(name).info() if self.engine.has_topic(name) else await self.broker.topic_info(name)
            return info
        return self.engine.create_topic(name, config).info()

    async def delete_topic_async(self, name: str) -> int:
        """Remove a topic (cluster-wide with a broker). Returns how many local subscribers were told."""
        if self.via_broker(name):
            subs = len(self.engine.topic(name).subs) if self.engine.has_topic(name) else 0
            await self.broker.delete(name)
            self.wake()
            return subs
        return self.delete_topic(name)

    async def topics_info(self) -> list[dict[str, Any]]:
        """INFO of every topic: the cluster's (from the broker), else this engine's."""
        listed = await self.broker.topics()
        if listed is None:
            return [t.info() for t in self.engine.topics()]
        names = {info["name"] for info in listed}
        return listed + [t.info() for t in self.engine.topics() if t.name not in names]

    async def topic_info(self, name: str) -> dict[str, Any]:
        if self.engine.has_topic(name):
            return self.engine.topic(name).info()
        info = await self.broker.topic_info(name)
        if info is None:
            return self.engine.topic(name).info()  # raises UnknownTopic
        return info

    def delete_topic(self, name: str) -> int:
        """Remove a topic; its subscribers get `closed`. Returns how many there were."""
        count = self.engine.delete_topic(name)
        self.wake()
        return count

    def send_direct(self, client_id: str, entry: bytes) -> None:
        try:
            self.engine.send_direct(client_id, entry)
        except RequestError:  # DirectQueueFull: the client does not read its replies
            self.kick(client_id, close_codes.DIRECT_OVERFLOW, "direct queue overflow", "direct_queue_full")
            return
        self.wake()

    def send_error(self, client_id: str, exc: RequestError, request_id: Any = None) -> None:
        self.send_direct(client_id, encode_error(exc.code, exc.message, request_id))

    def publish(self, topic: str, data: Any, *, seq: int | None = None, owner: Hashable = None) -> Published:
        """Publish now or raise (QueueFull is back-pressure: see `publish_wait`). `owner`: the user whose
        private queue gets it (private topics). With a broker, shared topics go through `publish_later`."""
        if self.broker.distributed and (self.via_broker(topic) or self.queued_in_broker(topic)):
            raise CoreUsageError(f"{topic!r} is published through the broker: use publish_later")
        result = self.engine.publish(topic, data, seq=seq, owner=owner, now=time.monotonic())
        if self.delivery_log is not None:
            self.delivery_log.published(topic, result.seq)
        self.wake()
        return result

    def publish_later(self, topic: str, data: Any, *, seq: int | None = None, owner: Hashable = None,
                      creator: ClientIdentity | None = None) -> asyncio.Future:
        """Publish through the broker when the topic goes through one (a future of the `Published`), else now
        (a done future). Raises at once what can be told at once (`BrokerUnavailable`, `BadData`, ...).
        `creator`: the client publishing, whose creation budget pays if the publish creates the topic in
        the broker (None: an operator or publisher, bounded by `broker.max_topics` only)."""
        if self.queued_in_broker(topic):  # a full queue holds the publish back until it has room
            pushed = self.broker.queues.push(topic, owner, data, seq, None)  # type: ignore[attr-defined]
            return self._published(topic, pushed)
        if not self.via_broker(topic):
            future = asyncio.get_running_loop().create_future()
            future.set_result(self.publish(topic, data, seq=seq, owner=owner))
            return future
        return self._published(topic, self.broker.publish(topic, data, seq, creator=creator))

    def _published(self, topic: str, seq_future: asyncio.Future) -> asyncio.Future:
        result = asyncio.get_running_loop().create_future()

        def landed(done: asyncio.Future) -> None:
            exc = done.exception()
            if exc is not None:
                result.set_exception(exc)
            else:
                result.set_result(Published(topic, done.result()))

        seq_future.add_done_callback(landed)
        return result

    async def publish_async(self, topic: str, data: Any, *, seq: int | None = None) -> Published:
        """Publish to a shared topic, through the broker when there is one."""
        published: Published = await self.publish_later(topic, data, seq=seq)
        return published

    def publish_reply(self, client_id: str, topic: str, data: Any, request_id: Any) -> None:
        """A client's publish: its `reply` with the seq comes now, or when the broker has given it."""
        conn = self.conns.get(client_id)
        future = self.publish_later(topic, data, creator=conn.identity if conn is not None else None)

        def answer(done: asyncio.Future) -> None:
            if client_id not in self.conns:
                return
            exc = done.exception()
            if isinstance(exc, RequestError):
                self.send_error(client_id, exc, request_id)
            elif exc is not None:
                self.send_error(client_id, InternalError(f"publish failed: {exc}"), request_id)
            else:
                self.send_direct(client_id, encode_reply(request_id, {"seq": done.result().seq}))

        if future.done():
            answer(future)
        else:
            future.add_done_callback(answer)

    async def publish_wait(
        self, topic: str, data: Any, *, owner: Hashable, timeout: float, seq: int | None = None
    ) -> Published:
        """Publish to a private queue, waiting up to `timeout` seconds for space (docs/design/private-queues.md §3)."""
        deadline = time.monotonic() + timeout
        if self.queued_in_broker(topic):
            pushed = self.broker.queues.push(topic, owner, data, seq, deadline)  # type: ignore[attr-defined]
            published: Published = await self._published(topic, pushed)
            return published
        while True:
            try:
                return self.publish(topic, data, seq=seq, owner=owner)
            except QueueFull:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                await asyncio.wait_for(self.space_freed(topic, owner), remaining)

    def space_freed(self, topic: str, owner: Hashable) -> asyncio.Future:
        """A future resolved when the private queue (topic, owner) frees space or disappears."""
        future = asyncio.get_running_loop().create_future()
        self._space_waiters.setdefault((topic, owner), []).append(future)
        return future

    def _wake_space_waiters(self) -> None:
        if self.engine.report_commits:
            committed = self.engine.take_committed()
            if committed:
                self.broker.queues.committed(committed)  # type: ignore[attr-defined]  # RedisBroker
        for key in self.engine.take_space_freed():
            for future in self._space_waiters.pop(key, ()):
                if not future.done():
                    future.set_result(None)

    # -- the scheduler -----------------------------------------------------------------------------------

    async def _scheduler(self) -> None:
        engine = self.engine
        metrics = self.metrics
        while True:
            await self._work.wait()
            self._work.clear()
            while engine.has_work:
                round_started = time.perf_counter()
                for cycle in range(1, self.coalesce_cycles + 1):
                    started = time.perf_counter()
                    batches = engine.run_cycle()
                    self._deliver(batches)
                    now = time.perf_counter()
                    metrics.cycle(now - started, batches)
                    del batches  # not held while the loop sleeps: the last cycle's entries can be a lot
                    if cycle == self.coalesce_cycles or not engine.has_work or now - round_started >= self.coalesce_s:
                        break
                    # Clients caught up are written now; those with a backlog keep their frames for the
                    # round's write. Reads run between cycles, as between rounds (what they publish goes in
                    # the next cycle).
                    self._flush_caught_up()
                    await asyncio.sleep(0)
                self.rounds += 1
                self._flush_staged()
                # What the round committed is written now: a broker may drop it, and held publishers retry.
                self._wake_space_waiters()
                await asyncio.sleep(0)

    def _flush_staged(self) -> None:
        """The round's end: write each connection's staged frames."""
        staged, self.staged = self.staged, {}
        self.caught_up.clear()
        for conn in staged:
            self._flush(conn)

    def _flush_caught_up(self) -> None:
        """Between a round's cycles: write the staged frames of clients with nothing more to come next cycle
        (caught up: a round never delays them); those with a backlog keep theirs for the round's end."""
        caught_up, self.caught_up = self.caught_up, {}
        for conn in caught_up:
            self._flush(conn)

    def _flush(self, conn: Any) -> None:
        """Write one connection's staged frames. One left above its high-water mark is not ready (its batches
        were reported done when staged) until its transport drains."""
        client_id = conn.identity.client_id
        try:
            if conn.flush():
                return
        except Exception:  # a transport that broke mid-write: drop it, never the others
            log.exception("delivery to %s failed", client_id)
            self.kick(client_id, close_codes.INTERNAL_ERROR, "internal error", "error")
            return
        if client_id in self.conns and conn.blocked_since is not None:
            self.engine.mark_idle(client_id)

    def _deliver(self, batches: list[Batch]) -> None:
        frames: dict[bytes | tuple[bytes, ...], bytes] = {}
        conns = self.conns
        delivery_log = self.delivery_log
        done = []
        for batch in batches:
            conn = conns.get(batch.client_id)
            if conn is None:
                continue
            # Clients of one topic usually get identical batches: frame them once. The entries are the key
            # (a bytes object caches its hash, and a lookup compares identity first; one entry, the common
            # case, is its own key, never equal to a tuple key).
            entries = batch.entries
            key = entries[0] if len(entries) == 1 else tuple(entries)
            frame = frames.get(key)
            if frame is None:
                frame = frames[key] = batch.frame()
            try:
                finished = conn.deliver(batch, frame)
            except Exception:  # a transport that broke mid-write: drop it, never the others
                log.exception("delivery to %s failed", batch.client_id)
                self.kick(batch.client_id, close_codes.INTERNAL_ERROR, "internal error", "error")
                continue
            if delivery_log is not None:
                delivery_log.delivered(batch, conn, getattr(conn, "holds_staged", False))
            if finished:
                done.append(batch.client_id)
        if done:
            self.engine.writes_done(done)

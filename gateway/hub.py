"""The hub: the gateway's parts for one process, wired together, started and stopped as one.

    socket -> transport -> client registry / topic router -> broker -> core engine -> scheduler -> socket

* `scheduler` (gateway/scheduler.py): the engine, its wake-ups and rounds, the hand-off of batches to
  connections; the only part that changes the engine, and the broker's `BrokerEvents`.
* `clients` (gateway/clients.py): the connections, per-address counts, tokens, idle and watchdog timers, kick.
* `router` (gateway/router.py): the verbs transports and the admin API use on topics (subscribe, publish,
  create, delete), each through the broker.
* `broker` (gateway/broker/): where topics live, this process (default) or Redis (docs/cluster.md).

Transports hold the hub and use those parts; anyone may read `engine`. docs/architecture.md draws the whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable, Hashable

from core import Engine

from .broker import Broker, make_broker
from .clients import ClientRegistry
from .config import GatewayConfig
from .deliverylog import DeliveryLog
from .gcpolicy import GcPolicy
from .hooks import Hooks
from .metrics import Metrics, engine_families, loop_families, stats_families
from .netguard import ConnectionLimiter
from .proxy import hooks_from_config
from .ratelog import BadInputLog
from .readiness import Readiness
from .router import TopicRouter
from .scheduler import Connection, Scheduler
from .topic_budget import CreationBudget
from .tracing import Tracing, from_config
from .transports.rawtcp import RawBroadcastServer
from .transports.sessions import SessionStore


class Hub:
    def __init__(self, config: GatewayConfig, *, instance_id: str | None = None) -> None:
        self.config = config
        self.instance_id = instance_id or secrets.token_hex(4)
        self.engine = Engine(config.engine_config(), instance_id=self.instance_id)
        conns: dict[Hashable, Connection] = {}
        self.scheduler = Scheduler(config, self.engine, conns)
        self.gc = GcPolicy(config.server.gc_full_interval_s)
        self.bad_input = BadInputLog(config.limits.bad_input_log_per_s)
        #: topic creations by clients: per connection, per address, in total (gateway/topic_budget.py)
        self.creations = CreationBudget(config.limits, lambda: self.engine.topic_count)
        self.broker: Broker = make_broker(config, self.scheduler, self.creations, self.instance_id)
        self.scheduler.report_commits = self.broker.committed
        self.scheduler.presence.store = self.broker.presence
        #: OpenTelemetry traces ([tracing], gateway/tracing.py); None (and nothing imported) when off
        self.tracing: Tracing | None = from_config(config.tracing, self.instance_id)
        #: the backend hooks (gateway/hooks.py): over HTTP ([proxy], gateway/proxy.py), or `NoHooks` without a URL
        self.hooks: Hooks = hooks_from_config(config.proxy, config.scheduler.max_subscriptions, self.bad_input,
                                              self.tracing)
        self.clients = ClientRegistry(config, self.scheduler, self.broker, conns, self.hooks)
        self.clients.on_arrival, self.clients.on_departure = self.gc.arrived, self.gc.departed
        self.clients.tokens.tracing = self.tracing
        self.router = TopicRouter(self.scheduler, self.clients, self.broker, self.creations)
        #: long-poll sessions and SSE streams by their secret, and what outlives them (transports/sessions.py)
        self.sessions = SessionStore(config)
        self.raw: RawBroadcastServer | None = None  # the raw TCP broadcaster, when enabled (`attach_raw`)
        self.limiter: ConnectionLimiter | None = None  # the HTTP port's accounting, once it listens
        #: called when the server shuts down, after the clients were closed: streams that are not clients
        #: (the admin stats stream) end too, so shutdown never waits for them
        self.closing_hooks: list[Callable[[], None]] = []
        if config.deliverylog.enabled:
            self.scheduler.delivery_log = DeliveryLog(config.deliverylog, self.instance_id, self._scheduler_ended)
        #: what GET /readyz answers (gateway/readiness.py): set started and draining by gateway/server.py
        self.readiness = Readiness(lambda: self.broker.healthy)
        self.metrics = Metrics()
        for collect in (lambda: engine_families(self.engine), loop_families, self.scheduler.collect, self.clients.collect,
                        self.creations.collect, self.broker.collect, self.gc.collect, self.bad_input.collect):
            self.metrics.add(collect)
        self.metrics.add(self.readiness.collect)
        self.metrics.add(self.hooks.collect)
        if self.clients.tokens.jwks is not None:
            self.metrics.add(self.clients.tokens.jwks.collect)

    def _scheduler_ended(self) -> bool:
        task = self.scheduler.task
        return task is not None and task.done()

    @property
    def delivery_log(self) -> DeliveryLog | None:
        return self.scheduler.delivery_log

    def attach_raw(self, raw: RawBroadcastServer) -> None:
        """The raw TCP broadcaster runs beside the hub: the admin API and /metrics show it."""
        self.raw = raw
        self.metrics.add(lambda: stats_families("fanout_raw_", "raw TCP broadcaster (docs/design/byte-ring.md §8)",
                                                raw.stats()))

    def attach_limiter(self, limiter: ConnectionLimiter) -> None:
        """The HTTP port's connection accounting, once the server listens (/metrics)."""
        self.limiter = limiter
        self.metrics.add(limiter.collect)

    async def start(self) -> None:
        await self.broker.start()
        await self.clients.tokens.start()  # the JWKS key set, when auth.jwks_url is set (gateway/jwks.py)
        self.scheduler.start()
        self.clients.start()
        self.gc.start()

    async def stop(self) -> None:
        self.gc.stop()
        self.clients.stop()
        await self.scheduler.stop()
        self.close_all_clients()
        await self.hooks.aclose()  # after the clients' disconnect events were queued
        await self.clients.tokens.stop()
        await self.broker.stop()
        if self.tracing is not None:  # the spans left are exported off the event loop; a dead collector: 3 s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(self.tracing.shutdown), 3)

    def drain(self, spread_s: float) -> list[str]:
        """Graceful drain: every client closed with 1012 and its own reconnect hint (ClientRegistry.drain), the
        stats streams ended. Returns the long-poll sessions whose last body waits for their next poll."""
        polling = self.sessions.longpoll.secrets()
        self.clients.drain(spread_s)
        for hook in self.closing_hooks:
            hook()
        return [secret for secret in polling if secret in self.sessions.closed]

    def close_all_clients(self) -> None:
        self.clients.close_all()
        for hook in self.closing_hooks:
            hook()

"""The hub: the gateway's parts for one process, wired together, started and stopped as one.

    socket -> transport -> client registry / topic catalog -> broker -> core engine -> scheduler -> socket

* `scheduler` (gateway/scheduler.py): the engine, its wake-ups and rounds, the hand-off of batches to
  connections; the only part that changes the engine (its `membership` verbs are the broker's `BrokerEvents`).
* `topics`: the engine, read-only (gateway/topic_view.py), for whoever needs to look.
* `clients` (gateway/clients.py): the connections, per-address counts, tokens, idle and watchdog timers, kick.
* `catalog` (gateway/catalog.py): the verbs transports and the admin API use on topics (subscribe, publish,
  create, delete), each through the broker, with the client's creation budget.
* `broker` (gateway/broker/): where topics live, this process (default) or Redis (docs/cluster.md).
* `control` (gateway/control_commands.py): the operators' commands the broker runs on this node.

Every part gets what it uses at construction. Where two parts need each other (the scheduler kicks through
the registry, the broker runs control commands the registry answers), the one made first gets a forwarder
to the one made later. docs/architecture.md draws the whole.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Hashable

from . import commands
from .broker import Broker, make_broker
from .catalog import TopicCatalog
from .clients import ClientRegistry
from .config import GatewayConfig
from .control_commands import ControlCommands
from .edge.netguard import ConnectionLimiter
from .edge.ratelog import BadInputLog
from .hooks.backend import hooks_from_config
from .hooks.base import Hooks
from .ops.deliverylog import DeliveryLog
from .ops.gcpolicy import GcPolicy
from .ops.metrics import Metrics, engine_families, loop_families, stats_families
from .ops.readiness import Readiness
from .ops.tracing import Tracing, from_config
from .scheduler import Connection, Scheduler
from .session_services import SessionServices
from .session_store import SessionStore
from .stats_feed import StatsFeed
from .topic_budget import CreationBudget
from .topic_view import TopicView
from .transports.rawtcp import RawBroadcastServer


class Hub:
    def __init__(self, config: GatewayConfig, *, instance_id: str | None = None) -> None:
        self.config = config
        self.instance_id = instance_id or secrets.token_hex(4)
        conns: dict[Hashable, Connection] = {}
        # The registry is made after the scheduler (it uses it): a connection that broke is kicked through it.
        self.scheduler = Scheduler(
            config,
            conns,
            instance_id=self.instance_id,
            kick=lambda client_id, code, reason, metric: self.clients.kick(client_id, code, reason, metric),
        )
        #: the engine, read-only: the scheduler is its only writer
        self.topics: TopicView = self.scheduler.topics
        self.gc = GcPolicy(config.server.gc_full_interval_s)
        self.bad_input = BadInputLog(config.limits.bad_input_log_per_s)
        #: topic creations by clients: per connection, per address, in total (gateway/topic_budget.py)
        self.creations = CreationBudget(config.limits, lambda: self.topics.topic_count)
        # The control commands and the stats feed are made after the broker (they use the registry, which
        # uses the broker): what the broker asks of them forwards.
        self.broker: Broker = make_broker(
            config,
            self.scheduler.membership,
            self.creations,
            self.instance_id,
            lambda command: self.control.run(command),
            lambda watched: self.stats.node_summary(watched),
        )
        #: OpenTelemetry traces ([tracing], gateway/ops/tracing.py); a null object (nothing imported) when off
        self.tracing: Tracing = from_config(config.tracing, self.instance_id)
        #: the backend hooks (gateway/hooks/base.py): over HTTP ([proxy], gateway/hooks/backend.py), or `NoHooks` without a URL
        self.hooks: Hooks = hooks_from_config(config.proxy, config.scheduler.max_subscriptions, self.bad_input, self.tracing)
        self.clients = ClientRegistry(
            config,
            self.scheduler,
            self.broker,
            conns,
            self.hooks,
            tracing=self.tracing,
            on_arrival=self.gc.arrived,
            on_departure=self.gc.departed,
        )
        self.catalog = TopicCatalog(self.scheduler.membership, self.clients, self.broker, self.creations)
        self.control = ControlCommands(self.clients, self.topics, self.catalog)
        #: long-poll sessions and SSE streams by their secret, and what outlives them (session_store.py)
        self.sessions = SessionStore(config)
        #: all a client connection reaches of the gateway (gateway/session_services.py): no part under the
        #: session (commands, client protocols, transports) holds the hub
        self.services = SessionServices(
            config=config,
            clients=self.clients,
            catalog=self.catalog,
            hooks=self.hooks,
            topics=self.topics,
            presence=self.broker.presence,
            members=self.scheduler.presence,
            scheduler=self.scheduler,
            sessions=self.sessions,
            tracing=self.tracing,
            bad_input=self.bad_input,
            commands=commands,
        )
        self.raw: RawBroadcastServer | None = None  # the raw TCP broadcaster, when enabled (`attach_raw`)
        self.limiter: ConnectionLimiter | None = None  # the HTTP port's accounting, once it listens
        #: called when the server shuts down, after the clients were closed: streams that are not clients
        #: (the admin stats stream) end too, so shutdown never waits for them
        self.closing_hooks: list[Callable[[], None]] = []
        #: the admin stats stream's sampler (gateway/stats_feed.py), made now, not at the first viewer: with a
        #: broker, another node's viewer may ask this node for its summary
        self.stats = StatsFeed(self)
        #: what GET /readyz answers (gateway/ops/readiness.py): set started and draining by gateway/server.py
        self.readiness = Readiness(lambda: self.broker.healthy)
        self.metrics = Metrics()
        for collect in (
            lambda: engine_families(self.topics),
            loop_families,
            self.scheduler.collect,
            self.clients.collect,
            self.creations.collect,
            self.broker.collect,
            self.gc.collect,
            self.bad_input.collect,
        ):
            self.metrics.add(collect)
        self.metrics.add(self.readiness.collect)
        self.metrics.add(self.hooks.collect)
        if self.clients.tokens.jwks is not None:
            self.metrics.add(self.clients.tokens.jwks.collect)

    @property
    def delivery_log(self) -> DeliveryLog | None:
        return self.scheduler.delivery_log

    def attach_raw(self, raw: RawBroadcastServer) -> None:
        """The raw TCP broadcaster runs beside the hub: the admin API and /metrics show it."""
        self.raw = raw
        self.metrics.add(lambda: stats_families("fanout_raw_", "raw TCP broadcaster (docs/design/byte-ring.md §8)", raw.stats()))

    def attach_limiter(self, limiter: ConnectionLimiter) -> None:
        """The HTTP port's connection accounting, once the server listens (/metrics)."""
        self.limiter = limiter
        self.metrics.add(limiter.collect)

    async def start(self) -> None:
        await self.broker.start()
        await self.clients.tokens.start()  # the JWKS key set, when auth.jwks_url is set (gateway/auth/jwks.py)
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
        await self.tracing.close()  # the spans left, exported off the event loop; a dead collector: 3 s

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

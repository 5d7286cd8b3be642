"""A node of the cluster: this process's Redis I/O (docs/cluster.md §3-4).

Redis orders publishes (scripts.PUBLISH: seq, stream, channel in one step); this node feeds its engine what
comes on the channels of the topics it serves, with Redis's seqs, through the core's ordinary verbs plus
`create_topic(epoch=, start=)`, `skip` and `restart_topic`. Each served topic is a `Line`:

* SYNCING: the topic's stream is being read (attach, a gap, Redis back); channel messages wait in the line's
  buffer (at most `BUFFER_MAX`; beyond, they are dropped and read again from the stream).
* LIVE: channel messages go into the engine as they come. A message past the local end (a lost channel
  message) or of another epoch makes the line SYNCING again.

Three tasks: the channel reader (one connection in subscribe mode; its failure is the sign that Redis is
gone, and it reconnects), the publisher (every queued publish in one pipeline, so one node's publishes keep
their order), and the stats refresher (`P:node:ID`, for the cluster-wide `/api/stats`; it lives in
cluster_info.py with the cluster-wide listings).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
import redis.asyncio as aioredis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from core import Published, RequestError, TopicConfig, TopicKind
from core.errors import BadSeq, StaleSeq, TooManyTopics, TopicExists, UnknownTopic

from ..config import BrokerConfig, ConfigError, topic_config
from ..errors import BrokerUnavailable, InternalError
from ..identity import ClientIdentity
from ..presence import PresenceStore
from ..topic_budget import CreationBudget
from . import scripts
from .base import BrokerEvents, BrokerUnreachable
from .cluster_info import ClusterInfo
from .control import ControlChannel
from .keys import Keys, seq_of, stream_id
from .presence_store import RedisPresence
from .private_queues import PrivateQueues
from .validate import PENDING_OVERHEAD, check_ready, encode_message

log = logging.getLogger("gateway.broker")

#: A topic whose last local subscriber left stays attached this long, so a client that reconnects at once
#: finds its ring warm (no stream read, no channel subscribe).
DETACH_GRACE_S = 5.0
#: Pause between attempts to reach Redis (at start and after losing it).
RETRY_S = 0.5
#: Channel messages held per topic while it resyncs: the stream holds them anyway, so beyond this the
#: buffer is dropped and the stream read again, instead of growing with a hot topic's rate.
BUFFER_MAX = 10_000
#: A Redis command that takes longer than this counts as Redis lost (commands are O(1) or O(capacity)).
COMMAND_TIMEOUT_S = 5.0
#: The readiness probe (GET /readyz): a PING this often, which must answer within PROBE_TIMEOUT_S. A Redis
#: stopped (SIGSTOP, a frozen VM) sends no error and the channel connection waits forever: only asking tells.
#: Redis counts as not answering at most PROBE_PERIOD_S + PROBE_TIMEOUT_S after it stopped.
PROBE_PERIOD_S = 2.0
PROBE_TIMEOUT_S = 2.0
#: Publishes sent in one pipeline at most: packing one costs ~12 us of the loop's time, so a backlog of
#: 2,000 in one go held the loop ~25 ms; larger backlogs go as several pipelines, one after the other.
PIPELINE_MAX = 256


def _redacted(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class LineState(Enum):
    #: the stream is being read; channel messages wait in `buffer`
    SYNCING = "syncing"
    #: channel messages go into the engine as they come
    LIVE = "live"


@dataclass(eq=False, slots=True)
class Line:
    """One topic this node serves: its feed from Redis into the engine."""

    name: str
    ready: asyncio.Future[None]
    state: LineState = LineState.SYNCING
    #: Redis's epoch of the local topic; None until the first sync created it
    epoch: str | None = None
    #: the next seq the engine expects (the local ring's end)
    next: int = 0
    kind: str = "ring"
    buffer: list[tuple[str, int, bytes]] = field(default_factory=list)
    overflow: bool = False
    task: asyncio.Task[None] | None = None
    release_timer: asyncio.TimerHandle | None = None
    #: the client whose subscribe made the attach (its creation budget pays if the topic is new in Redis),
    #: why it may not create it (None: it may), and whether the first TOUCH created it
    creator: Any = None
    refusal: tuple[str, str] | None = None
    created: bool = False


@dataclass(slots=True)
class _Pending:
    topic: str
    data: bytes
    seq: int | None
    config: TopicConfig
    future: asyncio.Future[int]
    #: the publishing client (None: an operator or a publisher), why it may not create the topic (None: it
    #: may), and whether the publish created it
    creator: Any = None
    refusal: tuple[str, str] | None = None
    created: bool = False


class RedisBroker:
    clustered = True

    def __init__(self, config: BrokerConfig, events: BrokerEvents, creations: CreationBudget, instance_id: str) -> None:
        self.events = events
        #: pays for the topics clients' subscribes and publishes create in Redis (gateway/topic_budget.py)
        self.creations = creations
        #: private queues live in Redis, so the engine reports commits for Redis to acknowledge (§8)
        events.engine.report_commits = True
        self.url = config.url
        self.keys = Keys(config.prefix)
        self.ttl = max(1, math.ceil(config.history_ttl_s))
        self.connect_timeout = config.connect_timeout_s
        self.node_id = f"{instance_id}-{os.getpid()}"
        self.redis = aioredis.Redis.from_url(
            config.url, socket_timeout=COMMAND_TIMEOUT_S, socket_connect_timeout=COMMAND_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),  # a failure is reported at once: publishes are refused, not delayed
        )
        self.lines: dict[str, Line] = {}
        #: whether Redis answers: publishes are refused with `broker_unavailable` while not
        self.available = False
        self.last_error = "not connected yet"
        #: whether Redis answered the readiness probe's last PING in time (`_probe_loop`, `healthy`)
        self.answering = True
        self._pubsub: Connection | None = None
        self._subscribing: dict[str, asyncio.Future[None]] = {}
        self._queue: list[_Pending] = []
        #: bytes of data of the publishes not yet answered by Redis (shared topics and private queues), bounded
        #: by broker.max_pending_bytes while Redis stalls; publishes beyond are refused (`reserve`)
        self.pending_bytes = 0
        self.max_pending_bytes = config.max_pending_bytes
        #: publishes refused for that bound (`/metrics`: fanout_broker_backlog_refused_total)
        self.backlog_refused = 0
        #: topics that started a new epoch because Redis was behind this node (`_rewind_behind`)
        self.rewinds = 0
        #: attempts to reconnect that failed (Redis still away, or a stale connection: `_connect`)
        self.reconnect_failures = 0
        self._rewinding: set[asyncio.Task[None]] = set()
        #: set when a publish met that bound, cleared once the pending bytes fall to half of it (hysteresis):
        #: meanwhile the ingest holds its records and stops reading (TCP back-pressure, `when_accepting`)
        #: instead of having each one refused
        self.congested = False
        self._accepting_waiters: set[asyncio.Future[None]] = set()
        #: the cluster-wide topic bound (broker.max_topics), checked by Redis when a topic would be created
        self.max_topics = config.max_topics
        self._queued: asyncio.Event | None = None
        self.shas: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        #: private queues held in Redis (private_queues.py, docs/cluster.md §8)
        self.queues = PrivateQueues(self)
        #: the cluster-wide listings and this node's stats refresher (cluster_info.py)
        self.cluster = ClusterInfo(self)
        #: presence members in Redis, this node's heartbeat, join/leave announcements (presence_store.py)
        self.presence_store = RedisPresence(self)
        self.presence: PresenceStore = self.presence_store
        #: the operators' commands on every node (control.py); the handler is the client registry's
        self.control_handler: Callable[[dict[str, Any]], dict[str, Any]] = lambda command: {}
        self.controls = ControlChannel(self)
        #: this node's summary for the dashboards of the cluster (set by the stats feed, gateway/stats_feed.py)
        self.node_summary: Callable[[bool], dict[str, Any] | None] = lambda watched: None

    @property
    def healthy(self) -> bool:
        """Whether /readyz may say ready: Redis is connected and answered the last PING in time."""
        return self.available and self.answering

    async def _probe_loop(self) -> None:
        """PING every PROBE_PERIOD_S (`answering`). Readiness only: publishes keep their own timeout."""
        while True:
            await asyncio.sleep(PROBE_PERIOD_S)
            answering = await self._answers_ping()
            if answering != self.answering:
                log.warning("broker %s %s", _redacted(self.url), "answers PING again: /readyz ready" if answering
                            else f"did not answer PING within {PROBE_TIMEOUT_S:g} s: /readyz broker_unavailable",
                            extra={"broker": _redacted(self.url), "state": "answering" if answering else "silent"})
            self.answering = answering

    async def _answers_ping(self) -> bool:
        try:
            await asyncio.wait_for(self.redis.ping(), PROBE_TIMEOUT_S)
        except (RedisError, OSError, asyncio.TimeoutError):
            return False
        return True

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        deadline = time.monotonic() + self.connect_timeout
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._connect()
                break
            except (RedisError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise BrokerUnreachable(
                        f"broker {_redacted(self.url)}: unreachable after {self.connect_timeout:g} s"
                        f" ({attempt} attempts): {exc}"
                    ) from None
                log.warning("broker %s unreachable (attempt %d): %s; retrying in %.1f s",
                            _redacted(self.url), attempt, exc, RETRY_S,
                            extra={"broker": _redacted(self.url), "state": "unreachable", "attempt": attempt})
                await asyncio.sleep(RETRY_S)
        self.available = True
        log.info("broker %s: node %s", _redacted(self.url), self.node_id,
                 extra={"broker": _redacted(self.url), "state": "connected", "node": self.node_id})
        await self.presence_store.start()
        self._queued = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_loop(), name="broker-reader"),
                       loop.create_task(self._publish_loop(), name="broker-publisher"),
                       loop.create_task(self.cluster._stats_loop(), name="broker-stats"),
                       loop.create_task(self._probe_loop(), name="broker-probe")]
        try:
            await self.subscribe_channels([self.keys.control])
            await self.controls.load_revocations()
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise BrokerUnreachable(f"broker {_redacted(self.url)}: control channel: {exc}") from None

    async def stop(self) -> None:
        self.queues.stop()
        self.controls.stop()
        for task in self._tasks:
            task.cancel()
        for line in self.lines.values():
            if line.task is not None:
                line.task.cancel()
            if line.release_timer is not None:
                line.release_timer.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        for pending in self._queue:
            if not pending.future.done():
                pending.future.set_exception(BrokerUnavailable("the gateway is stopping"))
        await self.presence_store.stop()
        if self.available:
            try:
                await self.redis.delete(self.keys.node(self.node_id))
            except (RedisError, OSError):
                pass
        if self._pubsub is not None:
            await self._pubsub.disconnect()
        await self.redis.aclose()

    async def _connect(self) -> None:
        """Ping, load the scripts, open the channel connection (replacing a broken one)."""
        # The pool's connections opened before Redis went away are dead: drop them all now, or the first
        # command after the reconnect fails on one and the node loses Redis again (a second round, 0.5 s).
        await self.redis.connection_pool.disconnect()
        await self.redis.ping()
        for name in ("PUBLISH", "TOUCH", "DELETE", "REWIND", "QUEUE_ATTACH", "QUEUE_PUSH", "QUEUE_READ",
                     "QUEUE_ACK", "QUEUE_DELETE", "QUEUE_RESTORE"):
            self.shas[name] = await self.redis.script_load(getattr(scripts, name))
        if self._pubsub is not None:
            await self._pubsub.disconnect()
        kwargs = dict(self.redis.connection_pool.connection_kwargs)
        kwargs["socket_timeout"] = None  # a channel connection waits for messages as long as it takes
        pubsub = Connection(**kwargs)
        # redis-py leaves Connection.connect unannotated (only --strict reports the call; `unused-ignore` for the rest)
        await pubsub.connect()  # type: ignore[no-untyped-call, unused-ignore]
        self._pubsub = pubsub

    def _lost(self, exc: BaseException) -> None:
        """Redis stopped answering: refuse publishes until the reader reconnects."""
        self.last_error = str(exc) or type(exc).__name__
        if not self.available:
            return
        self.available = False
        log.warning("broker %s lost: %s; publishes get broker_unavailable until it is back",
                    _redacted(self.url), self.last_error,
                    extra={"broker": _redacted(self.url), "state": "lost", "reason": self.last_error})
        for future in self._subscribing.values():
            if not future.done():
                future.set_exception(BrokerUnavailable(f"broker unreachable: {self.last_error}"))
        self._subscribing.clear()
        for line in self.lines.values():
            line.state = LineState.SYNCING
        if self._pubsub is not None:
            # The reader may still be waiting on a connection that looks open: close it, so it reconnects.
            asyncio.get_running_loop().create_task(self._pubsub.disconnect())

    async def _read_loop(self) -> None:
        while True:
            pubsub = self._pubsub
            try:
                assert pubsub is not None  # set by _connect before the loop starts
                while True:
                    self._on_channel(await pubsub.read_response(timeout=math.inf, push_request=True))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure of the channel connection: Redis is gone
                self._lost(exc)
            await self._reconnect()

    async def _reconnect(self) -> None:
        while True:
            await asyncio.sleep(RETRY_S)
            try:
                await self._connect()
                await self._resubscribe([self.keys.control] + [self.keys.channel(name) for name in self.lines]
                                        + self.queues.channels())
                await self._rewind_behind([line for line in self.lines.values() if line.epoch is not None])
                self.available = True
                self._wake_accepting()
            except (RedisError, OSError, asyncio.TimeoutError, RequestError) as exc:
                self.available = False
                self.reconnect_failures += 1
                self.last_error = str(exc) or type(exc).__name__
                log.debug("broker still unreachable: %s", self.last_error)
                continue
            log.warning("broker %s back: resynchronising %d topics", _redacted(self.url), len(self.lines),
                        extra={"broker": _redacted(self.url), "state": "back", "topics": len(self.lines)})
            for line in self.lines.values():
                line.state = LineState.SYNCING
                self._start_sync(line)
            self.queues.resync()
            self.presence_store.resync()
            self.controls.resync()
            return

    async def _resubscribe(self, channels: list[str]) -> None:
        """SUBSCRIBE the attached topics' channels on a new connection, from the reader itself (nobody else
        reads the confirmations yet): messages that come first wait in their lines' buffers."""
        pubsub = self._pubsub
        assert pubsub is not None
        if not channels:
            return
        await pubsub.send_command("SUBSCRIBE", *channels)
        waiting = set(channels)

        async def confirmations() -> None:
            while waiting:
                reply = await pubsub.read_response(timeout=math.inf, push_request=True)
                if reply[0] == b"subscribe":
                    waiting.discard(reply[1].decode())
                else:
                    self._on_channel(reply)

        await asyncio.wait_for(confirmations(), COMMAND_TIMEOUT_S)

    async def subscribe_channels(self, channels: list[str]) -> None:
        """SUBSCRIBE and wait until Redis confirms: from then on no message of these channels is missed."""
        loop = asyncio.get_running_loop()
        waiting = []
        for channel in channels:
            future = self._subscribing[channel] = loop.create_future()
            waiting.append(future)
        assert self._pubsub is not None
        await self._pubsub.send_command("SUBSCRIBE", *channels)
        await asyncio.wait_for(asyncio.gather(*waiting), COMMAND_TIMEOUT_S)

    def unsubscribe_channel(self, channel: str) -> None:
        if self.available and self._pubsub is not None:
            asyncio.get_running_loop().create_task(self._send_quietly("UNSUBSCRIBE", channel))

    async def _send_quietly(self, *args: str) -> None:
        try:
            assert self._pubsub is not None
            await self._pubsub.send_command(*args)
        except (RedisError, OSError) as exc:
            log.debug("broker: %s failed: %s", args[0], exc)

    # -- the channels ------------------------------------------------------------------------------------

    def _on_channel(self, reply: Any) -> None:
        kind = reply[0]
        if kind == b"message":
            channel = reply[1].decode()
            if self.queues.on_message(channel, reply[2]) or self.controls.on_message(channel, reply[2]):
                return
            line = self.lines.get(self.keys.topic_of(reply[1].decode()))
            if line is None:
                return  # detached meanwhile
            payload: bytes = reply[2]
            if payload == b"! epoch":  # Redis went back in time: the topic starts a new epoch (`_rewind_behind`)
                self._resync(line)
                return
            if payload.startswith(b"!p "):
                self.presence_store.on_message(line.name, payload)
                return
            if payload.startswith(b"!"):
                self._deleted(line)
                return
            epoch, seq, data = payload.split(b" ", 2)
            self._receive(line, epoch.decode(), int(seq), data)
        elif kind == b"subscribe":
            future = self._subscribing.pop(reply[1].decode(), None)
            if future is not None and not future.done():
                future.set_result(None)

    def _receive(self, line: Line, epoch: str, seq: int, data: bytes) -> None:
        if line.state is LineState.LIVE and self._apply(line, epoch, seq, data):
            return
        if len(line.buffer) < BUFFER_MAX:
            line.buffer.append((epoch, seq, data))
        else:
            line.overflow = True
        if line.state is LineState.LIVE:
            line.state = LineState.SYNCING
            self._start_sync(line)

    def _resync(self, line: Line) -> None:
        if line.state is LineState.LIVE:
            line.state = LineState.SYNCING
        self._start_sync(line)

    async def _rewind_behind(self, lines: list[Line]) -> None:
        """Redis may have come back from an older snapshot: a topic whose next seq in Redis is below what this
        node has delivered would give those seqs again to other messages, and this node would drop them as
        already delivered (silent loss). Each such topic starts a new epoch (scripts.REWIND): every node
        resyncs it and its subscribers get the `epoch` loss notice. One pipeline, before publishes resume."""
        if not lines:
            return
        keys = self.keys
        pipe = self.redis.pipeline(transaction=False)
        for line in lines:
            pipe.evalsha(self.shas["REWIND"], 2, keys.meta(line.name), keys.stream(line.name), secrets.token_hex(8),
                         line.epoch or "", line.next, keys.channel(line.name))
        for line, rewound in zip(lines, await pipe.execute()):
            if rewound == 1:
                log.warning("broker: Redis is behind this node on %r (it had delivered up to seq %d of epoch %s):"
                            " Redis went back in time (an older snapshot?); the topic starts a new epoch",
                            line.name, line.next - 1, line.epoch)
                self.rewinds += 1

    def _spawn_rewind(self, line: Line) -> None:
        async def rewind() -> None:
            try:
                await self._rewind_behind([line])
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                self._lost(exc)  # the reconnect checks every topic again

        task = asyncio.get_running_loop().create_task(rewind(), name=f"broker-rewind {line.name}")
        self._rewinding.add(task)
        task.add_done_callback(self._rewinding.discard)

    def _apply(self, line: Line, epoch: str, seq: int, data: bytes) -> bool:
        """Put one channel message into the engine. False: it needs a resync first (a gap, another epoch)."""
        if epoch != line.epoch:
            return False
        if seq < line.next:
            return True  # the stream read already gave it
        if seq > line.next and line.kind != TopicKind.SNAPSHOT.value:  # a snapshot's jump is conflation
            return False
        self._feed(line, seq, data)
        line.next = seq + 1
        self.events.wake()
        return True

    def _feed(self, line: Line, seq: int, data: bytes) -> None:
        try:
            # the publishing node encoded `data` (orjson) for the stream: embed it, never decode and re-encode
            self.events.apply(line.name, orjson.Fragment(data), seq=seq)
        except RequestError as exc:
            # e.g. larger than this node's scheduler.max_message_bytes: its subscribers are told it is lost.
            log.warning("broker: seq %d of %r cannot be stored here: %s", seq, line.name, exc)
            self.events.skip(line.name, seq + 1)

    def _deleted(self, line: Line) -> None:
        self._drop(line)
        if self.events.engine.has_topic(line.name):
            self.events.deleted(line.name)

    def _drop(self, line: Line) -> None:
        self.lines.pop(line.name, None)
        self.presence_store.forget(line.name)
        if line.task is not None and line.task is not asyncio.current_task():
            line.task.cancel()
        if line.release_timer is not None:
            line.release_timer.cancel()
        if not line.ready.done():
            line.ready.set_exception(UnknownTopic(f"topic {line.name!r} was deleted"))
            line.ready.exception()  # retrieved: nobody may be waiting
        self.unsubscribe_channel(self.keys.channel(line.name))

    # -- reading the stream ------------------------------------------------------------------------------

    def _start_sync(self, line: Line) -> None:
        if line.task is None or line.task.done():
            line.task = asyncio.get_running_loop().create_task(self._sync(line), name=f"broker-sync {line.name}")

    def _settings(self, name: str) -> TopicConfig:
        config = self.events.engine.topic_config(name)
        if config is None:
            raise UnknownTopic(f"no topic {name!r} and no rule creates it")
        return config

    async def _touch(
        self, name: str, config: TopicConfig, first: str, exclusive: bool = False,
        refusal: tuple[str, str] | None = None,
    ) -> list[Any]:
        """The TOUCH script; `refusal`: why the caller may not create the topic (TooManyCreatedTopics if
        it is new), None when it may."""
        keys = self.keys
        reply: list[Any] = await self.redis.evalsha(
            self.shas["TOUCH"], 3, keys.meta(name), keys.stream(name), keys.topics,
            secrets.token_hex(8), config.kind.value, config.capacity, orjson.dumps(config.as_dict()),
            self.ttl, "1" if exclusive else "0", first, time.time(), name, "0" if refusal else "1", self.max_topics,
        )
        if reply[0] == -2:
            assert refusal is not None
            raise self.creations.refuse(refusal)
        if reply[0] == -3:
            raise self._cluster_full()
        return reply

    def _begin_creation(self, holder: Line | _Pending, done: asyncio.Future[Any]) -> None:
        """A client's attach or publish, which creates the topic if Redis has none: the refusal of its
        creation budget goes with it to Redis (which refuses only a new topic); allowed, it counts as a
        creation under way until `done`, then is charged if it created the topic (`holder.created`)."""
        creator = holder.creator
        if creator is None:
            return
        budget = self.creations
        holder.refusal = budget.begin(creator)
        if holder.refusal is None:
            done.add_done_callback(lambda _: budget.end(creator, holder.created))

    def _cluster_full(self) -> TooManyTopics:
        """The error of a topic Redis would create past broker.max_topics, counted."""
        self.creations.refused["cluster"] += 1
        return TooManyTopics(f"the cluster holds its maximum of {self.max_topics} topics (broker.max_topics)")

    def reserve(self, size: int) -> None:
        """Count `size` bytes of a publish waiting for Redis; `BrokerUnavailable` when that would pass
        broker.max_pending_bytes (Redis stalls: the publisher retries later; one publish of any size goes
        when nothing waits). `release_bytes` when answered. `size` 0: only whether anything fits (checked
        before the data is encoded, so a refusal costs no encoding)."""
        if self.max_pending_bytes > 0 and self.pending_bytes and self.pending_bytes + size > self.max_pending_bytes - (
                0 if size else 1):
            self.backlog_refused += 1
            self.congested = True
            raise BrokerUnavailable(
                f"the broker is not keeping up: {self.pending_bytes} bytes of publishes wait for Redis"
                f" (broker.max_pending_bytes); retry later")
        self.pending_bytes += size

    def release_bytes(self, size: int) -> None:
        self.pending_bytes -= size
        if self.congested and self.pending_bytes <= self.max_pending_bytes // 2:
            self.congested = False
            self._wake_accepting()

    @property
    def accepting(self) -> bool:
        """Whether a publish may be sent now: Redis answers and the backlog is not congested."""
        return self.available and not self.congested

    def when_accepting(self) -> asyncio.Future[None]:
        """A future done once `accepting` (at once when it is): Redis back, or the pending bytes at half
        of broker.max_pending_bytes after they met it. Cancel it to stop waiting."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.accepting:
            future.set_result(None)
        else:
            self._accepting_waiters.add(future)
            future.add_done_callback(self._accepting_waiters.discard)
        return future

    def _wake_accepting(self) -> None:
        if not self.accepting:
            return
        for future in list(self._accepting_waiters):
            if not future.done():
                future.set_result(None)

    async def _sync(self, line: Line) -> None:
        """Bring the local topic level with Redis: create it, fill a gap, or restart it in a new epoch; then
        apply what waited in the buffer. Loops until the line is LIVE with nothing missing."""
        name = line.name
        engine = self.events.engine
        restart = False
        try:
            while self.available:
                fresh = line.epoch is None or not engine.has_topic(name)
                first = "-" if fresh or restart else stream_id(line.next)
                # A client's subscribe creates the topic in Redis within its budget; a resync always may.
                refusal = line.refusal if line.epoch is None else None
                created, epoch_b, top, settings, value, entries = await self._touch(
                    name, self._settings(name), first, refusal=refusal)
                line.created = line.created or created == 1
                epoch = epoch_b.decode()
                config = self.config_from(settings) or self._settings(name)
                line.kind = config.kind.value
                if not fresh and epoch != line.epoch and not restart:
                    restart = True  # another epoch: its stream from the start
                    continue
                line.overflow = False
                if config.kind is TopicKind.SNAPSHOT:
                    self._sync_snapshot(line, fresh, restart, epoch, config, top, value)
                else:
                    self._sync_ring(line, fresh, restart, epoch, config, top, entries)
                restart = False
                line.epoch = epoch
                self.events.wake()
                if not line.ready.done():
                    line.ready.set_result(None)
                buffer, line.buffer = line.buffer, []
                line.state = LineState.LIVE
                for i, (m_epoch, seq, data) in enumerate(buffer):
                    if not self._apply(line, m_epoch, seq, data):
                        line.buffer = buffer[i:] + line.buffer
                        line.state = LineState.SYNCING
                        break
                if line.state is LineState.LIVE and not line.overflow:
                    return
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._lost(exc)
            self._fail(line, BrokerUnavailable(f"broker unreachable: {self.last_error}"))
        except RequestError as exc:  # no rule for the name, too many topics
            self._fail(line, exc)
        except Exception as exc:  # a bug: the line is dropped, its subscribers keep what they have
            log.exception("broker: resync of %r failed", name)
            self._fail(line, BrokerUnavailable(f"internal error while reading {name!r}: {exc}"))
        if not self.available:
            self._fail(line, BrokerUnavailable(f"broker unreachable: {self.last_error}"))

    def _fail(self, line: Line, exc: RequestError) -> None:
        """The sync could not finish: a line that never became a topic is dropped (its subscribes fail);
        one that is a topic stays SYNCING until Redis is back (the reconnect resyncs it)."""
        if line.ready.done():
            return
        line.ready.set_exception(exc)
        line.ready.exception()  # retrieved here: the waiting subscribes read it from their callbacks
        if self.lines.get(line.name) is line:
            self._drop(line)

    def config_from(self, settings: bytes | None) -> TopicConfig | None:
        if not settings:
            return None
        try:
            return topic_config(orjson.loads(settings))
        except (ConfigError, orjson.JSONDecodeError):
            return None  # written by another version: this node's own rule applies

    def _sync_ring(
        self, line: Line, fresh: bool, restart: bool, epoch: str, config: TopicConfig, top: int, entries: list[Any]
    ) -> None:
        engine = self.events.engine
        name = line.name
        start = seq_of(entries[0][0]) if entries else top
        if fresh:
            engine.create_topic(name, config, epoch=epoch, start=start)
            line.next = start
        elif restart:
            engine.restart_topic(name, epoch, start)
            line.next = start
        elif start > line.next:
            # Published while this node did not listen, and trimmed from the stream since: exactly lost.
            self.events.skip(name, start)
            line.next = start
        for entry_id, fields in entries:
            seq = seq_of(entry_id)
            if seq >= line.next:
                self._feed(line, seq, _field(fields, b"d"))
                line.next = seq + 1

    def _sync_snapshot(
        self, line: Line, fresh: bool, restart: bool, epoch: str, config: TopicConfig, top: int, value: bytes | None
    ) -> None:
        engine = self.events.engine
        if fresh:
            engine.create_topic(line.name, config, epoch=epoch, start=0)
            line.next = 0
        elif restart:
            engine.restart_topic(line.name, epoch, 0)
            line.next = 0
        if value is not None and top - 1 >= line.next:
            self._feed(line, top - 1, value)
        line.next = max(line.next, top)

    # -- the seam ----------------------------------------------------------------------------------------

    def _private(self, topic: str) -> bool:
        """Whether `topic` is private: its queues live in Redis lists (private_queues.py), not in streams."""
        config = self.events.engine.topic_config(topic)
        return config is not None and config.kind is TopicKind.PRIVATE

    def publish_nowait(self, topic: str, data: Any, *, seq: int | None = None, owner: Hashable = None) -> Published | None:
        return None  # every topic lives in Redis: its seq comes from the script

    def publish(self, topic: str, data: Any, *, seq: int | None = None, owner: Hashable = None,
                creator: ClientIdentity | None = None, deadline: float | None = None) -> asyncio.Future[Published]:
        if self._private(topic):  # a full queue holds the publish back until it has room (or `deadline`)
            seq_future = self.queues.push(topic, owner, data, seq, deadline)
        else:
            seq_future = self._publish_shared(topic, data, seq, creator)
        result: asyncio.Future[Published] = asyncio.get_running_loop().create_future()

        def landed(done: asyncio.Future[int]) -> None:
            exc = done.exception()
            if exc is not None:
                result.set_exception(exc)
            else:
                result.set_result(Published(topic, done.result()))

        seq_future.add_done_callback(landed)
        return result

    def creates_here(self, topic: str) -> bool:
        # shared topics are created in Redis (which charges the creator's budget when it did, `_begin_creation`)
        return self._private(topic) and not self.events.engine.has_topic(topic)

    def subscribe(self, client_id: str, topic: str, *, since: tuple[str, int] | None, request_id: Any,
                  creator: ClientIdentity, ack: bool = False) -> None:
        if self._private(topic):
            self.queues.subscribe(client_id, topic, request_id, ack)
            return
        if not self.attached(topic):
            self.attach(topic, creator=creator).add_done_callback(
                lambda ready: self._attached(ready, client_id, topic, since, request_id))
            return
        self.hold(topic)
        self.events.subscribe(client_id, topic, since=since, request_id=request_id)

    def _attached(self, ready: asyncio.Future[None], client_id: str, topic: str, since: tuple[str, int] | None,
                  request_id: Any) -> None:
        if not self.events.connected(client_id):
            self.release(topic)
            return
        exc = ready.exception()
        if exc is not None:
            error = exc if isinstance(exc, RequestError) else InternalError(f"subscribing to {topic!r} failed: {exc}")
            self.events.refused(client_id, error, request_id)
            return
        self.hold(topic)
        self.events.joined(client_id, topic, since=since, request_id=request_id)

    def left(self, topic: str, owner: Hashable, *, unsubscribed: bool) -> None:
        if not self._private(topic):
            self.release(topic)
        elif unsubscribed:
            self.queues.unsubscribed(topic, owner)
        else:
            self.queues.released(topic, owner)

    def committed(self, reports: list[tuple[str, Hashable, int]]) -> None:
        self.queues.committed(reports)

    def attached(self, topic: str) -> bool:
        line = self.lines.get(topic)
        return line is not None and line.epoch is not None and self.events.engine.has_topic(topic)

    def attach(self, topic: str, *, creator: Any = None) -> asyncio.Future[None]:
        line = self.lines.get(topic)
        if line is not None:
            return line.ready
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        if not self.available:
            ready.set_exception(BrokerUnavailable(f"broker unreachable: {self.last_error}"))
            return ready
        line = self.lines[topic] = Line(topic, ready, creator=creator)
        self._begin_creation(line, ready)
        line.task = loop.create_task(self._attach(line), name=f"broker-attach {topic}")
        return ready

    async def _attach(self, line: Line) -> None:
        try:
            await self.subscribe_channels([self.keys.channel(line.name)])
        except (RedisError, OSError, asyncio.TimeoutError, RequestError) as exc:
            if isinstance(exc, (RedisError, OSError)):
                self._lost(exc)
            self._fail(line, exc if isinstance(exc, RequestError)
                       else BrokerUnavailable(f"broker unreachable: {self.last_error}"))
            return
        await self._sync(line)

    def hold(self, topic: str) -> None:
        line = self.lines.get(topic)
        if line is not None and line.release_timer is not None:
            line.release_timer.cancel()
            line.release_timer = None

    def release(self, topic: str) -> None:
        line = self.lines.get(topic)
        if line is None or line.release_timer is not None:
            return
        engine = self.events.engine
        if engine.has_topic(topic) and engine.topic(topic).subs:
            return
        line.release_timer = asyncio.get_running_loop().call_later(DETACH_GRACE_S, self._detach, line)

    def _detach(self, line: Line) -> None:
        line.release_timer = None
        engine = self.events.engine
        if self.lines.get(line.name) is not line or not line.ready.done():
            return
        if engine.has_topic(line.name):
            if engine.topic(line.name).subs:
                return
            engine.delete_topic(line.name)
        self._drop(line)

    def _publish_shared(self, topic: str, data: Any, seq: int | None, creator: ClientIdentity | None) -> asyncio.Future[int]:
        check_ready(self.available, self.last_error, seq)
        config = self._settings(topic)
        self.reserve(0)
        raw = encode_message(topic, data, self.events.engine.config.max_message_bytes)
        size = len(raw) + len(topic) + PENDING_OVERHEAD
        self.reserve(size)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: self.release_bytes(size))
        pending = _Pending(topic, raw, seq, config, future, creator)
        self._begin_creation(pending, future)
        self._queue.append(pending)
        assert self._queued is not None  # set by start
        self._queued.set()
        return future

    async def _publish_loop(self) -> None:
        assert self._queued is not None
        while True:
            await self._queued.wait()
            self._queued.clear()
            while self._queue:
                if not self.available:  # lost meanwhile: what was queued behind is refused at once
                    batch, self._queue = self._queue, []
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(BrokerUnavailable(f"broker unreachable: {self.last_error}"))
                    break
                batch, self._queue = self._queue[:PIPELINE_MAX], self._queue[PIPELINE_MAX:]
                await self._send(batch)

    async def _send(self, batch: list[_Pending]) -> None:
        """One pipeline on one connection: the order of the batch is the order of the seqs it gets."""
        keys = self.keys
        now = time.time()
        try:
            pipe = self.redis.pipeline(transaction=False)
            # What this node had delivered of each topic when the publish left: Redis gives a seq at or above
            # it, unless Redis went back in time (the channel may deliver this very publish before its answer,
            # so the end at answer time proves nothing).
            floors = {p.topic: (line.epoch, line.next) for p in batch if (line := self.lines.get(p.topic)) is not None}
            for p in batch:
                name = p.topic
                pipe.evalsha(
                    self.shas["PUBLISH"], 3, keys.meta(name), keys.stream(name), keys.topics,
                    secrets.token_hex(8), p.data, p.config.kind.value, p.config.capacity,
                    orjson.dumps(p.config.as_dict()), self.ttl, keys.channel(name),
                    "" if p.seq is None else p.seq, now, name, "0" if p.refusal else "1", self.max_topics,
                )
            results = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._lost(exc)
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(BrokerUnavailable(
                        f"broker lost during the publish (it may or may not have landed): {self.last_error}"))
            return
        for p, result in zip(batch, results):
            if p.future.done():
                continue
            if isinstance(result, NoScriptError):  # Redis restarted empty between a reconnect and now
                self._lost(result)
                p.future.set_exception(BrokerUnavailable("broker restarted: retry"))
            elif isinstance(result, Exception):
                p.future.set_exception(BrokerUnavailable(f"broker refused the publish: {result}"))
            else:
                status, epoch, seq, created = result
                line = self.lines.get(p.topic)
                floor = floors.get(p.topic)
                if status == 0 and line is not None and floor is not None and floor[0] == epoch.decode() \
                        and int(seq) < floor[1]:
                    # Redis gave a seq this node has delivered already: it went back in time. The topic
                    # starts a new epoch and the publisher retries (this message landed in the old one).
                    self._spawn_rewind(line)
                    p.future.set_exception(BrokerUnavailable(
                        f"the broker is behind this node on {p.topic!r} (restored from an older state?): the"
                        " topic starts a new epoch; retry"))
                elif status == 0:
                    p.created = created == 1
                    p.future.set_result(int(seq))
                elif status == -3:  # the topic is new, and this client may create none now
                    assert p.refusal is not None
                    p.future.set_exception(self.creations.refuse(p.refusal))
                elif status == -4:
                    p.future.set_exception(self._cluster_full())
                elif status == -1:
                    p.future.set_exception(StaleSeq(f"seq {p.seq} of {p.topic!r} was already published (next: {seq})"))
                else:
                    p.future.set_exception(BadSeq(f"seq {p.seq} of {p.topic!r} is not the next one ({seq}): with a"
                                                  " broker, an explicit seq only makes a retry idempotent"))

    async def create(self, topic: str, config: TopicConfig) -> dict[str, Any]:
        engine = self.events.engine
        if config.kind is TopicKind.PRIVATE:  # its queues are made in Redis when their users subscribe
            local: dict[str, Any] = engine.create_topic(topic, config).info()
            return local
        await self._create_shared(topic, config)
        info = engine.topic(topic).info() if engine.has_topic(topic) else await self.topic_info(topic)
        assert info is not None
        return dict(info)

    async def _create_shared(self, topic: str, config: TopicConfig) -> None:
        if not self.available:
            raise BrokerUnavailable(f"broker unreachable: {self.last_error}")
        try:
            created = (await self._touch(topic, config, "+", exclusive=True))[0]
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._lost(exc)
            raise BrokerUnavailable(f"broker unreachable: {self.last_error}") from None
        if created == -1:
            raise TopicExists(f"topic {topic!r} exists")
        await self.attach(topic)
        self.release(topic)

    async def delete(self, topic: str) -> int:
        engine = self.events.engine
        if self._private(topic):
            return self.events.deleted(topic)
        subscribers = len(engine.topic(topic).subs) if engine.has_topic(topic) else 0
        await self._delete_shared(topic)
        return subscribers

    async def _delete_shared(self, topic: str) -> None:
        if not self.available:
            raise BrokerUnavailable(f"broker unreachable: {self.last_error}")
        keys = self.keys
        try:
            existed = await self.redis.evalsha(self.shas["DELETE"], 3, keys.meta(topic), keys.stream(topic),
                                               keys.topics, keys.channel(topic), topic)
        except (RedisError, OSError) as exc:
            self._lost(exc)
            raise BrokerUnavailable(f"broker unreachable: {self.last_error}") from None
        line = self.lines.get(topic)
        if line is not None:
            self._deleted(line)  # at once here; other nodes on the channel's `! deleted`
        elif not existed and not self.events.engine.has_topic(topic):
            raise UnknownTopic(f"no topic {topic!r}")

    # -- cluster-wide listings (admin API): cluster_info.py ---------------------------------------------

    async def topics(self) -> list[dict[str, Any]] | None:
        return await self.cluster.topics()

    async def topic_info(self, topic: str) -> dict[str, Any] | None:
        return await self.cluster.topic_info(topic)

    async def cluster_stats(self) -> dict[str, Any] | None:
        return await self.cluster.cluster_stats()

    async def cluster_nodes(self, watch_s: float) -> list[dict[str, Any]] | None:
        return await self.cluster.nodes(watch_s)

    async def control(self, command: dict[str, Any]) -> list[dict[str, Any]]:
        return await self.controls.control(command)

    async def refresh_queues(self) -> None:
        await self.queues.refresh()

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("fanout_broker_pending_bytes", "bytes of publishes waiting for Redis"
                                " (bounded by broker.max_pending_bytes)", value=self.pending_bytes)
        yield CounterMetricFamily("fanout_broker_backlog_refused", "publishes refused (broker_unavailable) because"
                                  " broker.max_pending_bytes wait for Redis", value=self.backlog_refused)
        yield CounterMetricFamily("fanout_broker_reconnect_failures", "attempts to reconnect to Redis that failed",
                                  value=self.reconnect_failures)
        yield CounterMetricFamily("fanout_broker_rewinds", "topics that started a new epoch because Redis was"
                                  " behind this node (restored from an older state)", value=self.rewinds)


def _field(fields: list[bytes], name: bytes) -> bytes:
    """A stream entry's field (redis-py gives a flat list or a dict, depending on the parser)."""
    if isinstance(fields, dict):
        return fields[name]
    for i in range(0, len(fields), 2):
        if fields[i] == name:
            return fields[i + 1]
    raise KeyError(name)

"""The shared topics this node serves from Redis (docs/cluster.md §3-4): attaching one (its channel
subscribed, its stream read), keeping it level with Redis through its `Line` (feeds.py holds the machine;
this module does its I/O), detaching it when its last subscriber left, and checking every topic against a
Redis that came back (a restored snapshot, a promoted replica that lacked writes: rewind.py)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Protocol

import orjson
from redis.exceptions import RedisError

from core import RequestError, TopicConfig
from core.errors import TooManyTopics, TopicExists, UnknownTopic

from ..auth.identity import ClientIdentity
from ..config import ConfigError, topic_config
from ..errors import BrokerUnavailable, InternalError
from ..topic_budget import CreationBudget
from .base import BrokerEvents
from .feeds import Feed, Line, LineState, Step, Touched
from .keys import Keys, stream_id
from .link import LINK_ERRORS, Link
from .rewind import Rewinder
from .topic_directory import TopicDirectory

log = logging.getLogger("gateway.broker")

#: A topic whose last local subscriber left stays attached this long, so a client that reconnects at once
#: finds its ring warm (no stream read, no channel subscribe).
DETACH_GRACE_S = 5.0


class TopicPresence(Protocol):
    """What the lines tell the presence store (presence_store.py) of the topics they serve."""

    def forget(self, topic: str) -> None: ...

    def on_message(self, topic: str, payload: bytes) -> None: ...


class TopicLines:
    def __init__(
        self, link: Link, keys: Keys, events: BrokerEvents, creations: CreationBudget, ttl: int, max_topics: int
    ) -> None:
        self.link = link
        self.keys = keys
        self.events = events
        #: pays for the topics clients' subscribes and publishes create in Redis (gateway/topic_budget.py)
        self.creations = creations
        self.ttl = ttl
        #: the cluster-wide topic bound (broker.max_topics), checked by Redis when a topic would be created
        self.max_topics = max_topics
        self.feed = Feed(events)
        self.lines: dict[str, Line] = {}
        #: set by the broker once made (it needs the broker): presence of the topics served here
        self.presence: TopicPresence | None = None
        #: checks the topics against a Redis that came back (rewind.py)
        self.rewinder = Rewinder(link, keys)
        #: Redis Cluster: the cluster-wide topic listing and bound, kept by the nodes (topic_directory.py)
        self.directory = TopicDirectory(link, keys, ttl, max_topics)

    def stop(self) -> None:
        for line in self.lines.values():
            if line.task is not None:
                line.task.cancel()
            if line.release_timer is not None:
                line.release_timer.cancel()

    def channels(self) -> list[str]:
        return [self.keys.channel(name) for name in self.lines]

    def script_keys(self, name: str) -> list[str]:
        """KEYS of the PUBLISH, TOUCH and DELETE scripts: the topic's meta and stream, and on one Redis the
        topics' sorted set (on Redis Cluster a script touches its topic's slot only: topic_directory.py)."""
        keys = self.keys
        return [keys.meta(name), keys.stream(name)] + ([] if self.link.sharded else [keys.topics])

    def bound(self) -> int:
        """The scripts' `max` argument (scripts._ROOM): broker.max_topics on one Redis, which the script checks;
        on Redis Cluster the directory's verdict, 0 (room) or -1 (full)."""
        if not self.link.sharded or self.max_topics <= 0:
            return self.max_topics
        return -1 if self.directory.full else 0

    # -- attaching ---------------------------------------------------------------------------------------

    def subscribe(
        self,
        client_id: str,
        topic: str,
        since: tuple[str, int] | None,
        request_id: Any,
        creator: ClientIdentity,
        delta: bool | None = None,
    ) -> None:
        if not self.attached(topic):
            self.attach(topic, creator=creator).add_done_callback(
                lambda ready: self._joined(ready, client_id, topic, since, request_id, delta)
            )
            return
        self.hold(topic)
        self.events.subscribe(client_id, topic, since=since, request_id=request_id, delta=delta)

    def _joined(
        self,
        ready: asyncio.Future[None],
        client_id: str,
        topic: str,
        since: tuple[str, int] | None,
        request_id: Any,
        delta: bool | None,
    ) -> None:
        if not self.events.connected(client_id):
            self.release(topic)
            return
        exc = ready.exception()
        if exc is not None:
            error = exc if isinstance(exc, RequestError) else InternalError(f"subscribing to {topic!r} failed: {exc}")
            self.events.refused(client_id, error, request_id)
            return
        self.hold(topic)
        self.events.joined(client_id, topic, since=since, request_id=request_id, delta=delta)

    def attached(self, topic: str) -> bool:
        line = self.lines.get(topic)
        return line is not None and line.epoch is not None and self.events.topics.has_topic(topic)

    def attach(self, topic: str, *, creator: Any = None) -> asyncio.Future[None]:
        line = self.lines.get(topic)
        if line is not None:
            return line.ready
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        if not self.link.available:
            ready.set_exception(BrokerUnavailable(f"broker unreachable: {self.link.last_error}"))
            return ready
        line = self.lines[topic] = Line(topic, ready, creator=creator)
        self.begin_creation(line, ready)
        line.task = loop.create_task(self._attach(line), name=f"broker-attach {topic}")
        return ready

    async def _attach(self, line: Line) -> None:
        try:
            await self.link.subscribe_channels([self.keys.channel(line.name)])
        except LINK_ERRORS as exc:
            if isinstance(exc, (RedisError, OSError)):
                self.link.lost(exc)
            self._fail(
                line, exc if isinstance(exc, RequestError) else BrokerUnavailable(f"broker unreachable: {self.link.last_error}")
            )
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
        topics = self.events.topics
        if topics.has_topic(topic) and topics.topic(topic).subs:
            return
        line.release_timer = asyncio.get_running_loop().call_later(DETACH_GRACE_S, self._detach, line)

    def _detach(self, line: Line) -> None:
        line.release_timer = None
        topics = self.events.topics
        if self.lines.get(line.name) is not line or not line.ready.done():
            return
        if topics.has_topic(line.name):
            if topics.topic(line.name).subs:
                return
            self.events.deleted(line.name)  # no subscriber: nobody told, no member left
        self.drop(line)

    def deleted(self, line: Line) -> None:
        self.drop(line)
        if self.events.topics.has_topic(line.name):
            self.events.deleted(line.name)

    def drop(self, line: Line) -> None:
        self.lines.pop(line.name, None)
        if self.presence is not None:
            self.presence.forget(line.name)
        if line.task is not None and line.task is not asyncio.current_task():
            line.task.cancel()
        if line.release_timer is not None:
            line.release_timer.cancel()
        if not line.ready.done():
            line.ready.set_exception(UnknownTopic(f"topic {line.name!r} was deleted"))
            line.ready.exception()  # retrieved: nobody may be waiting
        self.link.unsubscribe_channel(self.keys.channel(line.name))

    # -- the channels ------------------------------------------------------------------------------------

    def on_message(self, channel: str, payload: bytes) -> None:
        line = self.lines.get(self.keys.topic_of(channel))
        if line is None:
            return  # detached meanwhile
        if payload == b"! epoch":  # Redis went back in time: the topic starts a new epoch (rewind.py)
            self.resync(line)
        elif payload.startswith(b"!p "):
            if self.presence is not None:
                self.presence.on_message(line.name, payload)
        elif payload.startswith(b"!"):
            self.deleted(line)
        else:
            epoch, seq, data = payload.split(b" ", 2)
            if self.feed.receive(line, epoch.decode(), int(seq), data):
                self._start_sync(line)

    def resync(self, line: Line) -> None:
        if line.state is LineState.LIVE:
            line.state = LineState.SYNCING
        self._start_sync(line)

    def lost(self) -> None:
        """Redis is gone: every line reads its stream again once it is back (`back`)."""
        for line in self.lines.values():
            line.state = LineState.SYNCING

    def back(self) -> None:
        for line in self.lines.values():
            line.state = LineState.SYNCING
            self._start_sync(line)

    # -- reading the stream ------------------------------------------------------------------------------

    def _start_sync(self, line: Line) -> None:
        if line.task is None or line.task.done():
            line.task = asyncio.get_running_loop().create_task(self._sync(line), name=f"broker-sync {line.name}")

    async def _sync(self, line: Line) -> None:
        """Bring the local topic level with Redis: create it, fill a gap, or restart it in a new epoch; then
        apply what waited in the buffer. Loops until the line is LIVE with nothing missing."""
        name = line.name
        topics = self.events.topics
        restart = False
        try:
            while self.link.available:
                fresh = line.epoch is None or not topics.has_topic(name)
                first = "-" if fresh or restart else stream_id(line.next)
                # A client's subscribe creates the topic in Redis within its budget; a resync always may.
                refusal = line.refusal if line.epoch is None else None
                touched = Touched.of(await self.touch(name, self.settings(name), first, refusal=refusal))
                config = config_from(touched.settings) or self.settings(name)
                step = self.feed.settle(line, touched, config, fresh, restart)
                restart = step is Step.RESTART
                if not restart and not line.ready.done():
                    line.ready.set_result(None)
                if step is Step.LIVE:
                    return
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self.link.lost(exc)
            self._fail(line, BrokerUnavailable(f"broker unreachable: {self.link.last_error}"))
        except RequestError as exc:  # no rule for the name, too many topics
            self._fail(line, exc)
        except Exception as exc:  # a bug: the line is dropped, its subscribers keep what they have
            log.exception("broker: resync of %r failed", name)
            self._fail(line, BrokerUnavailable(f"internal error while reading {name!r}: {exc}"))
        if not self.link.available:
            self._fail(line, BrokerUnavailable(f"broker unreachable: {self.link.last_error}"))

    def _fail(self, line: Line, exc: RequestError) -> None:
        """The sync could not finish: a line that never became a topic is dropped (its subscribes fail);
        one that is a topic stays SYNCING until Redis is back (the reconnect resyncs it)."""
        if line.ready.done():
            return
        line.ready.set_exception(exc)
        line.ready.exception()  # retrieved here: the waiting subscribes read it from their callbacks
        if self.lines.get(line.name) is line:
            self.drop(line)

    async def touch(
        self, name: str, config: TopicConfig, first: str, exclusive: bool = False, refusal: tuple[str, str] | None = None
    ) -> list[Any]:
        """The TOUCH script; `refusal`: why the caller may not create the topic (TooManyCreatedTopics if
        it is new), None when it may."""
        keys = self.script_keys(name)
        reply: list[Any] = await self.link.redis.evalsha(
            self.link.shas["TOUCH"],
            len(keys),
            *keys,
            secrets.token_hex(8),
            config.kind.value,
            config.capacity,
            orjson.dumps(config.as_dict()),
            self.ttl,
            "1" if exclusive else "0",
            first,
            time.time(),
            name,
            "0" if refusal else "1",
            self.bound(),
        )
        if reply[0] == 1:
            self.directory.note(name)
        if reply[0] == -2:
            assert refusal is not None
            raise self.creations.refuse(refusal)
        if reply[0] == -3:
            raise self.cluster_full()
        return reply

    def settings(self, name: str) -> TopicConfig:
        config = self.events.topics.topic_config(name)
        if config is None:
            raise UnknownTopic(f"no topic {name!r} and no rule creates it")
        return config

    # -- creation ----------------------------------------------------------------------------------------

    def begin_creation(self, holder: Any, done: asyncio.Future[Any]) -> None:
        """A client's attach or publish (`holder`: a Line or a pending publish, with `creator`, `refusal`,
        `created`), which creates the topic if Redis has none: the refusal of its creation budget goes with
        it to Redis (which refuses only a new topic); allowed, it counts as a creation under way until
        `done`, then is charged if it created the topic (`holder.created`)."""
        creator = holder.creator
        if creator is None:
            return
        budget = self.creations
        holder.refusal = budget.begin(creator)
        if holder.refusal is None:
            done.add_done_callback(lambda _: budget.end(creator, holder.created))

    def cluster_full(self) -> TooManyTopics:
        """The error of a topic Redis would create past broker.max_topics, counted."""
        self.creations.refused["cluster"] += 1
        return TooManyTopics(f"the cluster holds its maximum of {self.max_topics} topics (broker.max_topics)")

    async def create(self, topic: str, config: TopicConfig) -> None:
        if not self.link.available:
            raise BrokerUnavailable(f"broker unreachable: {self.link.last_error}")
        try:
            created = (await self.touch(topic, config, "+", exclusive=True))[0]
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self.link.lost(exc)
            raise BrokerUnavailable(f"broker unreachable: {self.link.last_error}") from None
        if created == -1:
            raise TopicExists(f"topic {topic!r} exists")
        await self.attach(topic)
        self.release(topic)

    async def delete(self, topic: str) -> None:
        if not self.link.available:
            raise BrokerUnavailable(f"broker unreachable: {self.link.last_error}")
        keys = self.script_keys(topic)
        try:
            existed = await self.link.redis.evalsha(self.link.shas["DELETE"], len(keys), *keys, self.keys.channel(topic), topic)
            self.directory.forget(topic)
        except (RedisError, OSError) as exc:
            self.link.lost(exc)
            raise BrokerUnavailable(f"broker unreachable: {self.link.last_error}") from None
        line = self.lines.get(topic)
        if line is not None:
            self.deleted(line)  # at once here; other nodes on the channel's `! deleted`
        elif not existed and not self.events.topics.has_topic(topic):
            raise UnknownTopic(f"no topic {topic!r}")


def config_from(settings: bytes | None) -> TopicConfig | None:
    """A topic's settings as Redis holds them (written by the node that created it)."""
    if not settings:
        return None
    try:
        return topic_config(orjson.loads(settings))
    except (ConfigError, orjson.JSONDecodeError):
        return None  # written by another version: this node's own rule applies

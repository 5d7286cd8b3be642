"""Publishing shared topics through Redis (docs/cluster.md §3): the queue of publishes waiting for Redis, its
byte bound (broker.max_pending_bytes) and the back-pressure it gives (`when_accepting`), and the publisher
task, which sends every queued publish in one pipeline so one node's publishes keep their order."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from core import TopicConfig
from core.errors import BadSeq, StaleSeq

from ..auth.identity import ClientIdentity
from ..errors import BrokerUnavailable
from .keys import Keys
from .link import Link
from .topic_lines import TopicLines
from .validate import PENDING_OVERHEAD, check_ready, encode_message

#: Publishes sent in one pipeline at most: packing one costs ~12 us of the loop's time, so a backlog of
#: 2,000 in one go held the loop ~25 ms; larger backlogs go as several pipelines, one after the other.
PIPELINE_MAX = 256


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


class Publisher:
    def __init__(self, link: Link, keys: Keys, topics: TopicLines, max_pending_bytes: int) -> None:
        self.link = link
        self.keys = keys
        self.topics = topics
        self._queue: list[_Pending] = []
        self._queued: asyncio.Event | None = None
        #: bytes of data of the publishes not yet answered by Redis (shared topics and private queues), bounded
        #: by broker.max_pending_bytes while Redis stalls; publishes beyond are refused (`reserve`)
        self.pending_bytes = 0
        self.max_pending_bytes = max_pending_bytes
        #: publishes refused for that bound (`/metrics`: fanout_broker_backlog_refused_total)
        self.backlog_refused = 0
        #: set when a publish met that bound, cleared once the pending bytes fall to half of it (hysteresis):
        #: meanwhile the ingest holds its records and stops reading (TCP back-pressure, `when_accepting`)
        #: instead of having each one refused
        self.congested = False
        self._accepting_waiters: set[asyncio.Future[None]] = set()

    def run(self) -> asyncio.Task[None]:
        self._queued = asyncio.Event()
        return asyncio.get_running_loop().create_task(self._loop(), name="broker-publisher")

    def stop(self) -> None:
        for pending in self._queue:
            if not pending.future.done():
                pending.future.set_exception(BrokerUnavailable("the gateway is stopping"))

    # -- the byte bound ----------------------------------------------------------------------------------

    def reserve(self, size: int) -> None:
        """Count `size` bytes of a publish waiting for Redis; `BrokerUnavailable` when that would pass
        broker.max_pending_bytes (Redis stalls: the publisher retries later; one publish of any size goes
        when nothing waits). `release_bytes` when answered. `size` 0: only whether anything fits (checked
        before the data is encoded, so a refusal costs no encoding)."""
        if (
            self.max_pending_bytes > 0
            and self.pending_bytes
            and self.pending_bytes + size > self.max_pending_bytes - (0 if size else 1)
        ):
            self.backlog_refused += 1
            self.congested = True
            raise BrokerUnavailable(
                f"the broker is not keeping up: {self.pending_bytes} bytes of publishes wait for Redis"
                f" (broker.max_pending_bytes); retry later"
            )
        self.pending_bytes += size

    def release_bytes(self, size: int) -> None:
        self.pending_bytes -= size
        if self.congested and self.pending_bytes <= self.max_pending_bytes // 2:
            self.congested = False
            self.wake_accepting()

    @property
    def accepting(self) -> bool:
        """Whether a publish may be sent now: Redis answers and the backlog is not congested."""
        return self.link.available and not self.congested

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

    def wake_accepting(self) -> None:
        if not self.accepting:
            return
        for future in list(self._accepting_waiters):
            if not future.done():
                future.set_result(None)

    # -- publishing --------------------------------------------------------------------------------------

    def publish(self, topic: str, data: Any, seq: int | None, creator: ClientIdentity | None) -> asyncio.Future[int]:
        check_ready(self.link.available, self.link.last_error, seq)
        config = self.topics.settings(topic)
        self.reserve(0)
        raw = encode_message(topic, data, self.topics.events.topics.config.max_message_bytes)
        size = len(raw) + len(topic) + PENDING_OVERHEAD
        self.reserve(size)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: self.release_bytes(size))
        pending = _Pending(topic, raw, seq, config, future, creator)
        self.topics.begin_creation(pending, future)
        self._queue.append(pending)
        assert self._queued is not None  # set by run
        self._queued.set()
        return future

    async def _loop(self) -> None:
        assert self._queued is not None
        while True:
            await self._queued.wait()
            self._queued.clear()
            while self._queue:
                if not self.link.available:  # lost meanwhile: what was queued behind is refused at once
                    batch, self._queue = self._queue, []
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(BrokerUnavailable(f"broker unreachable: {self.link.last_error}"))
                    break
                batch, self._queue = self._queue[:PIPELINE_MAX], self._queue[PIPELINE_MAX:]
                await self._send(batch)

    async def _send(self, batch: list[_Pending]) -> None:
        """One pipeline on one connection: the order of the batch is the order of the seqs it gets."""
        keys, link, topics = self.keys, self.link, self.topics
        now = time.time()
        try:
            pipe = link.redis.pipeline(transaction=False)
            # What this node had delivered of each topic when the publish left: Redis gives a seq at or above
            # it, unless Redis went back in time (the channel may deliver this very publish before its answer,
            # so the end at answer time proves nothing).
            floors = {p.topic: (line.epoch, line.next) for p in batch if (line := topics.lines.get(p.topic)) is not None}
            bound = topics.bound()
            for p in batch:
                name = p.topic
                script_keys = topics.script_keys(name)
                # EVALSHA by name: redis-py's cluster pipeline refuses its `evalsha` method, not the command
                pipe.execute_command(
                    "EVALSHA",
                    link.shas["PUBLISH"],
                    len(script_keys),
                    *script_keys,
                    secrets.token_hex(8),
                    p.data,
                    p.config.kind.value,
                    p.config.capacity,
                    orjson.dumps(p.config.as_dict()),
                    topics.ttl,
                    keys.channel(name),
                    "" if p.seq is None else p.seq,
                    now,
                    name,
                    "0" if p.refusal else "1",
                    bound,
                )
            results = await pipe.execute(raise_on_error=False)
        except (RedisError, RedisClusterException, OSError, asyncio.TimeoutError) as exc:
            link.lost(exc)
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(
                        BrokerUnavailable(f"broker lost during the publish (it may or may not have landed): {link.last_error}")
                    )
            return
        for p, result in zip(batch, results):
            if not p.future.done():
                self._answer(p, result, floors.get(p.topic))

    def _answer(self, p: _Pending, result: Any, floor: tuple[str | None, int] | None) -> None:
        """Settle one publish's future with its script's result."""
        if isinstance(result, NoScriptError):  # Redis restarted empty between a reconnect and now
            self.link.lost(result)
            p.future.set_exception(BrokerUnavailable("broker restarted: retry"))
            return
        if isinstance(result, Exception):
            p.future.set_exception(BrokerUnavailable(f"broker refused the publish: {result}"))
            return
        status, epoch, seq, created = result
        line = self.topics.lines.get(p.topic)
        if status == 0 and line is not None and floor is not None and floor[0] == epoch.decode() and int(seq) < floor[1]:
            # Redis gave a seq this node has delivered already: it went back in time. The topic starts a
            # new epoch and the publisher retries (this message landed in the old one).
            self.topics.rewinder.spawn(line)
            p.future.set_exception(
                BrokerUnavailable(
                    f"the broker is behind this node on {p.topic!r} (restored from an older state?): the"
                    " topic starts a new epoch; retry"
                )
            )
        elif status == 0:
            p.created = created == 1
            self.topics.rewinder.note_accepted(p.topic, epoch.decode(), int(seq))
            self.topics.directory.note(p.topic)
            p.future.set_result(int(seq))
        elif status == -3:  # the topic is new, and this client may create none now
            assert p.refusal is not None
            p.future.set_exception(self.topics.creations.refuse(p.refusal))
        elif status == -4:
            p.future.set_exception(self.topics.cluster_full())
        elif status == -1:
            p.future.set_exception(StaleSeq(f"seq {p.seq} of {p.topic!r} was already published (next: {seq})"))
        else:
            p.future.set_exception(
                BadSeq(
                    f"seq {p.seq} of {p.topic!r} is not the next one ({seq}): with a"
                    " broker, an explicit seq only makes a retry idempotent"
                )
            )

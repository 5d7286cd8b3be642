"""Private queues in Redis (docs/cluster.md §8): nothing queued is lost when a node dies.

Each (topic, owner) queue is a Redis hash (epoch, next seq, bytes, holder) and list (the data), written by
the scripts `QUEUE_*` (scripts.py). Redis is the queue; the core's `PrivateTopic` on the node holding the
owner's subscription is its local view (peek / commit), fed from Redis:

* subscribe: SUBSCRIBE the queue's channel, then `QUEUE_ATTACH` (creates it when missing, makes this node
  the holder, tells the previous holder `t NODE`) returns the epoch, the head's seq and every entry queued;
  the engine subscribes with `queue_start=(epoch, head)` and gets the entries with their seqs.
* publish (any node): `QUEUE_PUSH` appends while there is room, atomically with the seq; `n NEXT` on the
  channel makes the holder pull (`QUEUE_READ` from its local end, at most the room its local queue has).
  A full queue: the publisher's outbox retries the same message, woken by a local commit of that queue or
  after a backoff (10 ms doubling to 200 ms), until the publisher's deadline (admin) or for ever (ingest,
  whose reading is paused meanwhile). One outbox per queue and node keeps one publisher's order.
* commit: the engine reports (topic, owner, first seq still queued) (`Engine.take_committed`); `QUEUE_ACK`
  removes what is below it. Entries handed out and not committed stay in Redis: a node killed meanwhile
  loses none, the next holder hands them out again with the same seqs (at-least-once).
* a node taking the queue over (`t NODE` from another node): this node closes its handle (`closed`,
  `taken_over`) and forgets the queue.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisError

from core import QueueFull, RequestError
from core.errors import BadSeq, NoTarget, NotSubscribed, StaleSeq
from core.private import PrivateTopic

from ..errors import BrokerUnavailable, InternalError
from .validate import PENDING_OVERHEAD, check_ready, encode_message

if TYPE_CHECKING:
    from .node import RedisNode

log = logging.getLogger("gateway.broker")

#: Messages sent in one `QUEUE_PUSH`.
PUSH_BATCH = 64
#: A publisher held back by a full queue retries after this, doubling up to BACKOFF_MAX_S (or at once when
#: a commit on this node frees space in that queue).
BACKOFF_S = 0.01
BACKOFF_MAX_S = 0.2
#: Acks that failed while Redis looked available are sent again after this (else when Redis is back).
ACK_RETRY_S = 0.5

Key = tuple[str, Hashable]


@dataclass(eq=False, slots=True)
class Held:
    """A queue whose subscriber is on this node."""

    topic: str
    owner: Hashable
    keys: tuple[str, str, str]
    epoch: str | None = None
    #: subscribes waiting for the attach: (client id, request id, ack)
    waiting: list[tuple[str, Any, bool]] = field(default_factory=list)
    pulling: bool = False
    again: bool = False
    #: the highest next seq Redis announced (`n NEXT`, reads): past the local end, messages not pulled yet
    top: int = 0


@dataclass(slots=True)
class _Push:
    data: bytes
    seq: int | None
    deadline: float | None
    future: asyncio.Future[int]


@dataclass(eq=False, slots=True)
class _Outbox:
    topic: str
    owner: Hashable
    items: deque[_Push] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None


class PrivateQueues:
    def __init__(self, broker: "RedisNode") -> None:
        self.broker = broker
        self.events = broker.events
        self.held: dict[Key, Held] = {}
        self.by_channel: dict[str, Held] = {}
        self._outboxes: dict[Key, _Outbox] = {}
        #: acks to send: key -> (keys, epoch, first seq still queued)
        self._acks: dict[Key, tuple[tuple[str, str, str], str, int]] = {}
        self._ack_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for outbox in self._outboxes.values():
            if outbox.task is not None:
                outbox.task.cancel()
            for push in outbox.items:
                if not push.future.done():
                    push.future.set_exception(BrokerUnavailable("the gateway is stopping"))
        if self._ack_task is not None:
            self._ack_task.cancel()

    def channels(self) -> list[str]:
        return list(self.by_channel)

    async def _eval(self, name: str, keys: tuple[str, ...], *args: Any) -> Any:
        broker = self.broker
        return await broker.redis.evalsha(broker.shas[name], len(keys), *keys, *args)

    # -- subscribing -------------------------------------------------------------------------------------

    def subscribe(self, client_id: str, topic: str, request_id: Any, ack: bool = False) -> None:
        """Subscribe `client_id` to its owner's queue: at once when this node holds it, else after the attach."""
        events = self.events
        owner = events.topics.client(client_id).owner
        key = (topic, owner)
        held = self.held.get(key)
        if held is not None:
            if held.epoch is None:
                held.waiting.append((client_id, request_id, ack))
            else:
                events.subscribe(client_id, topic, request_id=request_id, queue_start=(held.epoch, 0), ack=ack)
            return
        if not self.broker.available:
            raise BrokerUnavailable(f"broker unreachable: {self.broker.last_error}; retry later")
        events.resolve(topic)  # the rule's errors (unknown topic) now, before any Redis work
        keys = self.broker.keys.queue(topic, str(owner))
        held = self.held[key] = Held(topic, owner, keys, waiting=[(client_id, request_id, ack)])
        self.by_channel[keys[2]] = held
        self._spawn(self._attach(held))

    async def _attach(self, held: Held) -> None:
        events = self.events
        try:
            await self.broker.link.subscribe_channels([held.keys[2]])
            epoch, head, entries = await self._eval(
                "QUEUE_ATTACH", held.keys[:2], secrets.token_hex(8), self.broker.ttl, held.keys[2], self.broker.node_id
            )
        except (RedisError, OSError, asyncio.TimeoutError, RequestError) as exc:
            waiting, held.waiting = held.waiting, []
            self._forget(held)
            error = exc if isinstance(exc, RequestError) else BrokerUnavailable(f"broker unreachable: {exc}")
            for client_id, request_id, _ in waiting:
                events.refused(client_id, error, request_id)
            return
        held.epoch = epoch.decode()
        waiting, held.waiting = held.waiting, []
        subscribed = False
        for client_id, request_id, ack in waiting:
            if not events.connected(client_id):
                continue
            try:
                events.subscribe(client_id, held.topic, request_id=request_id, queue_start=(held.epoch, int(head)), ack=ack)
                subscribed = True
            except RequestError as err:
                events.refused(client_id, err, request_id)
        if not subscribed:
            self._forget(held)
            return
        held.top = int(head) + len(entries)
        self._feed(held, int(head), entries)
        self.pull(held)

    def released(self, topic: str, owner: Hashable) -> None:
        """A handle of (topic, owner) left (disconnect, unsubscribe): forget the queue unless another
        handle of this node took it over. Its entries stay in Redis for the next holder."""
        held = self.held.get((topic, owner))
        if held is None or held.epoch is None or self._local(held) is not None:
            return
        self._forget(held)

    def unsubscribed(self, topic: str, owner: Hashable) -> None:
        """An explicit unsubscribe: the queue leaves Redis too (as it leaves the node without a broker)."""
        held = self.held.get((topic, owner))
        if held is None or held.epoch is None or self._local(held) is not None:
            return
        self._forget(held)
        self._spawn(self._delete(held))

    async def _delete(self, held: Held) -> None:
        await self._flush_acks()
        try:
            await self._eval("QUEUE_DELETE", held.keys[:2], self.broker.node_id)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.debug("broker: deleting the queue %s failed: %s", held.keys[0], exc)

    def _forget(self, held: Held) -> None:
        if self.held.get((held.topic, held.owner)) is held:
            del self.held[(held.topic, held.owner)]
            self.by_channel.pop(held.keys[2], None)
            self.broker.link.unsubscribe_channel(held.keys[2])

    def _local(self, held: Held) -> Any:
        topics = self.events.topics
        if not topics.has_topic(held.topic):
            return None
        topic = topics.topic(held.topic)
        return topic.queues.get(held.owner) if isinstance(topic, PrivateTopic) else None

    # -- the channel -------------------------------------------------------------------------------------

    def on_message(self, channel: str, payload: bytes) -> bool:
        """A message of a queue's channel (True), or not a queue's channel (False)."""
        held = self.by_channel.get(channel)
        if held is None:
            return "}:qc:" in channel  # a queue this node let go of (a message after its UNSUBSCRIBE)
        if payload.startswith(b"t "):
            if payload[2:].decode() != self.broker.node_id and held.epoch is not None:
                self._forget(held)
                self.events.evicted(held.topic, held.owner, "taken_over")
            return True
        if payload.startswith(b"n "):
            held.top = max(held.top, int(payload[2:]))
        if held.epoch is not None:
            self.pull(held)
        return True

    async def check_behind(self) -> None:
        """After a reconnect, before publishes resume: a held queue Redis holds behind what this node pulled or
        was announced (a promoted replica that lacked pushes) goes on at that seq (scripts.QUEUE_REWIND), so
        no seq is given twice; if it lacks messages announced and not pulled yet, they are lost: the handle
        is closed (`closed`, reason `lost`), as when Redis lost the queue. Raises the link's errors."""
        checks = [
            (held, held.epoch, sub.cursor)
            for held in self.held.values()
            if held.epoch is not None and (sub := self._local(held)) is not None
        ]
        if not checks:
            return
        broker = self.broker
        pipe = broker.redis.pipeline(transaction=False)
        for held, epoch, cursor in checks:
            pipe.execute_command(
                "EVALSHA",
                broker.shas["QUEUE_REWIND"],
                2,
                held.keys[0],
                held.keys[1],
                epoch,
                max(cursor, held.top),
                broker.ttl,
                broker.node_id,
            )
        for (held, _, cursor), behind in zip(checks, await pipe.execute()):
            if behind < 0:
                continue
            log.warning(
                "broker: Redis was behind this node on the queue %s (next seq %d, pulled up to %d): it goes on at %d",
                held.keys[0],
                behind,
                cursor,
                max(cursor, held.top),
            )
            if held.top > max(behind, cursor):
                log.warning(
                    "broker: the queue %s lost seqs [%d, %d) with Redis; its handle is closed",
                    held.keys[0],
                    max(behind, cursor),
                    held.top,
                )
                self._forget(held)
                self.events.evicted(held.topic, held.owner, "lost")

    def resync(self) -> None:
        """Redis is back: pull every held queue and send the acks that failed."""
        for held in list(self.held.values()):
            if held.epoch is not None:
                self.pull(held)
        if self._acks:
            self._schedule_acks()

    # -- from Redis into the engine ----------------------------------------------------------------------

    def pull(self, held: Held) -> None:
        if held.pulling:
            held.again = True
            return
        held.pulling = True
        self._spawn(self._pull(held))

    async def _pull(self, held: Held) -> None:
        try:
            while True:
                held.again = False
                sub = self._local(held)
                if sub is None or self.held.get((held.topic, held.owner)) is not held:
                    return
                room = sub.topic.config.max_count - len(sub.queue)
                if room <= 0:
                    return  # the next commit pulls again
                try:
                    reply = await self._eval("QUEUE_READ", held.keys[:2], sub.cursor, room)
                except (RedisError, OSError, asyncio.TimeoutError) as exc:
                    log.debug("broker: reading the queue %s failed: %s", held.keys[0], exc)
                    return  # the reconnect resyncs
                if reply and reply[0].decode() == held.epoch:
                    held.top = max(held.top, int(reply[3]))
                    self._feed(held, int(reply[1]), reply[2])
                elif not reply:  # Redis lost the queue (restarted empty)
                    if not await self._restore(held, sub.cursor):
                        return
                    held.again = True
                elif reply:
                    log.warning("broker: the queue %s has a new epoch; its holder's view is stale", held.keys[0])
                if not held.again:
                    return
        finally:
            held.pulling = False

    async def _restore(self, held: Held, end: int) -> bool:
        """Redis came back without the held queue: make it again in its epoch at the local end, so the
        subscriber reads on (what was pulled is in the local view). When Redis had announced messages past
        the local end, they are gone: the handle is closed (`closed`, reason `lost`) and the client subscribes
        again to a new queue. False when the queue is forgotten or Redis failed (the reconnect pulls again)."""
        if held.top > end:
            log.warning("broker: the queue %s lost seqs [%d, %d) with Redis; its handle is closed", held.keys[0], end, held.top)
            self._forget(held)
            self.events.evicted(held.topic, held.owner, "lost")
            return False
        try:
            await self._eval("QUEUE_RESTORE", held.keys[:2], held.epoch, end, self.broker.ttl, self.broker.node_id)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.debug("broker: making the queue %s again failed: %s", held.keys[0], exc)
            return False
        log.warning("broker: the queue %s was lost with Redis; made again at seq %d", held.keys[0], end)
        return True

    def _feed(self, held: Held, head: int, entries: list[bytes]) -> None:
        for i, data in enumerate(entries):
            try:
                # encoded by the publishing node (orjson): embedded as is, not decoded and encoded again
                self.events.apply(held.topic, orjson.Fragment(data), seq=head + i, owner=held.owner)
            except StaleSeq:
                continue  # this node has it already
            except QueueFull:
                break  # the local view is full (it counts encoded bytes): the next commit pulls again
            except RequestError as exc:
                log.warning("broker: seq %d of the queue %s cannot be stored here: %s", head + i, held.keys[0], exc)
                break

    # -- commits -----------------------------------------------------------------------------------------

    def committed(self, reports: list[tuple[str, Hashable, int]]) -> None:
        for topic, owner, upto in reports:
            held = self.held.get((topic, owner))
            if held is None or held.epoch is None:
                continue
            previous = self._acks.get((topic, owner))
            if previous is None or previous[2] < upto:
                self._acks[(topic, owner)] = (held.keys, held.epoch, upto)
            self.pull(held)  # the local view has room again
        if self._acks:
            self._schedule_acks()

    def _schedule_acks(self) -> None:
        if self._ack_task is None or self._ack_task.done():
            self._ack_task = asyncio.get_running_loop().create_task(self._flush_acks())

    async def _flush_acks(self) -> None:
        while self._acks:
            acks, self._acks = self._acks, {}
            broker = self.broker
            try:
                pipe = broker.redis.pipeline(transaction=False)
                for keys, epoch, upto in acks.values():
                    pipe.execute_command("EVALSHA", broker.shas["QUEUE_ACK"], 2, keys[0], keys[1], upto, broker.ttl, epoch)
                await pipe.execute()
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                for key, ack in acks.items():  # sent again when Redis is back (acks are idempotent)
                    if key not in self._acks or self._acks[key][2] < ack[2]:
                        self._acks[key] = ack
                log.debug("broker: acks failed: %s", exc)
                if self.broker.available:  # e.g. a pooled connection from before Redis restarted: try again
                    asyncio.get_running_loop().call_later(ACK_RETRY_S, self._schedule_acks)
                return

    async def refresh(self) -> None:
        """Keep the held queues in Redis while their subscribers stay (EXPIRE)."""
        if not self.held:
            return
        pipe = self.broker.redis.pipeline(transaction=False)
        for held in self.held.values():
            pipe.expire(held.keys[0], self.broker.ttl)
            pipe.expire(held.keys[1], self.broker.ttl)
        await pipe.execute()

    # -- publishing --------------------------------------------------------------------------------------

    def push(self, topic: str, owner: Hashable, data: Any, seq: int | None, deadline: float | None) -> asyncio.Future[int]:
        """Queue one message for `owner`; the future gives its seq, or fails with `QueueFull` once
        `deadline` (monotonic) passed with the queue full, `NotSubscribed` when `owner` has no queue, ..."""
        broker = self.broker
        if owner is None:
            raise NoTarget(f"private topic {topic!r} needs the user whose queue gets the message (`client`)")
        check_ready(broker.available, broker.last_error, seq)
        broker.publisher.reserve(0)
        raw = encode_message(topic, data, self.events.topics.config.max_message_bytes)
        self.events.resolve(topic)
        size = len(raw) + PENDING_OVERHEAD
        broker.publisher.reserve(size)  # broker.max_pending_bytes: what waits for Redis, shared topics and queues alike
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: broker.publisher.release_bytes(size))
        key = (topic, owner)
        outbox = self._outboxes.get(key)
        if outbox is None:
            outbox = self._outboxes[key] = _Outbox(topic, owner)
        outbox.items.append(_Push(raw, seq, deadline, future))
        if outbox.task is None:
            outbox.task = asyncio.get_running_loop().create_task(self._send(outbox))
        return future

    async def _send(self, outbox: _Outbox) -> None:
        events = self.events
        items = outbox.items
        keys = self.broker.keys.queue(outbox.topic, str(outbox.owner))
        backoff = BACKOFF_S
        try:
            while items:
                while items and items[0].future.done():  # a publisher that gave up
                    items.popleft()
                if not items:
                    break
                config = events.topics.topic_config(outbox.topic)
                if config is None:
                    self._fail_all(outbox, NotSubscribed(f"no topic {outbox.topic!r}"))
                    break
                batch = [items[i] for i in range(min(PUSH_BATCH, len(items)))]
                args: list[Any] = [config.max_count, config.max_bytes, self.broker.ttl, keys[2]]
                for push in batch:
                    args += ["" if push.seq is None else push.seq, push.data]
                try:
                    status, done, first, _next = await self._eval("QUEUE_PUSH", keys[:2], *args)
                except (RedisError, OSError, asyncio.TimeoutError) as exc:
                    self._fail_all(
                        outbox, BrokerUnavailable(f"broker lost during the publish (it may or may not have landed): {exc}")
                    )
                    break
                for i in range(done):
                    push = items.popleft()
                    if not push.future.done():
                        push.future.set_result(int(first) + i)
                if status == 0:
                    backoff = BACKOFF_S
                    continue
                if status == -3:  # full: wait for a local commit of this queue or the backoff
                    head = items[0]
                    if head.deadline is not None and head.deadline <= time.monotonic():
                        items.popleft()
                        head.future.set_exception(QueueFull(f"private queue {outbox.topic!r} of {outbox.owner!r} is full"))
                        continue
                    wait = backoff if head.deadline is None else max(0.0, min(backoff, head.deadline - time.monotonic()))
                    try:
                        async with asyncio.timeout(wait):
                            await events.space_freed(outbox.topic, outbox.owner)
                    except TimeoutError:
                        pass
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
                    continue
                backoff = BACKOFF_S
                push = items.popleft()
                if push.future.done():
                    continue
                next_seq = int(first) + done
                if status == -1:
                    push.future.set_exception(StaleSeq(f"seq {push.seq} of private {outbox.topic!r} was already queued"))
                elif status == -2:
                    push.future.set_exception(
                        BadSeq(f"seq {push.seq} of private {outbox.topic!r} is not the next one ({next_seq})")
                    )
                else:
                    push.future.set_exception(NotSubscribed(f"{outbox.owner!r} has no queue on {outbox.topic!r}"))
        except Exception as exc:  # never leave a publisher waiting for ever
            log.exception("broker: private publish failed")
            self._fail_all(outbox, InternalError(f"publish failed: {exc}"))
        finally:
            outbox.task = None
            if items:
                outbox.task = asyncio.get_running_loop().create_task(self._send(outbox))
            elif self._outboxes.get((outbox.topic, outbox.owner)) is outbox:
                del self._outboxes[(outbox.topic, outbox.owner)]

    def _fail_all(self, outbox: _Outbox, exc: Exception) -> None:
        while outbox.items:
            push = outbox.items.popleft()
            if not push.future.done():
                push.future.set_exception(exc)

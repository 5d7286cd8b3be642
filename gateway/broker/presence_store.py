"""Presence members held in Redis, cluster-wide (docs/integration.md, "Presence", "Cluster").

Each node writes only its own members, mirrored from its memory (`local`), so no write races another node's:

* `P:{T}:pm:NODE`: hash client id -> member JSON (`{"u", "c", "i"}`), `P:{T}:pu:NODE`: hash owner -> its
  member count on that node, `P:{T}:pn`: set of the nodes holding members of T;
* `P:palive:NODE`: the node's heartbeat, set every `HEARTBEAT_S` with a TTL of `ALIVE_TTL_MS`.

The member keys and the node set carry a TTL (`MEMBER_TTL_MS`, 60 s) that the holder refreshes every 20 s
(one pipeline of PEXPIRE per topic it holds members of): a dead node's keys go even if no node ever reads
the topic again.

A read (`view`) takes the topic's nodes, drops (and deletes) those whose heartbeat is gone, counts the rest
(HLEN each, O(nodes)) and reads the members only when there are at most `limits.presence_max_members`.
So a killed node's members leave every answer within `ALIVE_TTL_MS` (3 s) of its last heartbeat.

Joins and leaves are announced on the topic's channel (`P:{T}:c`) as `!p NODE JSON`; the nodes serving the
topic (those with local subscribers) hand them to `BrokerEvents.presence_changed`, the origin ignores its own.

The sweep: for the `join_leave` topics it serves, a node keeps the other nodes' members (`remote`: read once
from Redis when it starts serving the topic, then kept by the announcements). After each heartbeat it checks
the heartbeat keys of the nodes found there (one pipeline of EXISTS: O(distinct nodes), nothing per member);
for a node whose key is gone it hands a `leave` per member it knew of that node to `presence_changed` (its
own local subscribers only: each node tells its own, so each subscriber gets one leave per member whatever
the number of nodes), then deletes the dead node's keys of the topic, done by whichever node's SREM removed
the node from `P:{T}:pn` (one per topic). So a killed node's members leave with `leave` entries within
`ALIVE_TTL_MS` + `HEARTBEAT_S` (4 s) of its last heartbeat, plus a round trip.

Writes go through one task in order, as idempotent "make Redis match memory" steps; when a write fails, or
the heartbeat finds its key had expired (Redis restarted, or this node stalled past the TTL and a reader
dropped its members), the whole local state is written again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisError

from ..errors import BrokerUnavailable
from ..presence import Member, PresenceView, TopicMembers
from .stopping import stop_tasks

if TYPE_CHECKING:
    from .node import RedisNode

log = logging.getLogger("gateway.broker")

#: the node's presence heartbeat period, and its key's TTL: a dead node's members leave within the TTL
HEARTBEAT_S = 1.0
ALIVE_TTL_MS = 3000
#: pause after a failed write before the state is written again
RETRY_S = 0.5
#: a node's member keys expire this long after their last refresh, so the keys of a node that died while no
#: node read the topic do not stay in Redis for good; refreshed every `REFRESH_HEARTBEATS` heartbeats
MEMBER_TTL_MS = 60_000
REFRESH_HEARTBEATS = 20

#: write steps: ("m", topic, client) member, ("u", topic, owner) owner count, ("t", topic, "") the topic's
#: keys of this node (gone once it has no member here), ("p", topic, payload) an announcement
_Op = tuple[str, str, Any]


class RedisPresence:
    def __init__(self, node: "RedisNode") -> None:
        self.node = node
        #: this node's members per topic (what its Redis hashes mirror)
        self.local: dict[str, TopicMembers] = {}
        self._ops: list[_Op] = []
        self._dirty = False
        self._queued: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        #: the other nodes' members of the `join_leave` topics this node serves: topic -> node -> client ->
        #: member (what this node's subscribers were told, or could read with `presence`); kept for the sweep
        self.remote: dict[str, dict[str, dict[str, Member]]] = {}
        #: topics of `remote` read from Redis (their announcements since then are all in it)
        self.loaded: set[str] = set()
        #: topics being read: the announcements that came meanwhile, applied once the read is in
        self._loading: dict[str, list[tuple[str, str, Member]]] = {}
        #: topics of `loaded` to read again (after a reconnect)
        self._stale: set[str] = set()
        #: members a sweep found gone (each a `leave` to the local subscribers), since the start
        self.swept = 0

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.node.redis.set(self.node.keys.presence_alive(self.node.node_id), "1", px=ALIVE_TTL_MS)
        self._queued = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._write_loop(), name="presence-writer"),
            loop.create_task(self._heartbeat_loop(), name="presence-heartbeat"),
        ]

    async def stop(self) -> None:
        """Cancel the tasks; this node's members leave Redis (a graceful stop does not wait for the TTL)."""
        await stop_tasks(self._tasks)
        if not self.node.available:
            return
        keys, node_id = self.node.keys, self.node.node_id
        try:
            pipe = self.node.redis.pipeline(transaction=False)
            # the topics still held, and those left during the shutdown whose steps were not written
            for topic in {*self.local, *(op[1] for op in self._ops if op[0] == "t")}:
                pipe.delete(*keys.presence_members(topic, node_id))
                pipe.srem(keys.presence_nodes(topic), node_id)
            pipe.delete(keys.presence_alive(node_id))
            await pipe.execute()
        except (RedisError, OSError):
            pass

    def resync(self) -> None:
        """Redis is back (maybe empty): write the whole local state again (announcing it: other nodes that
        swept this node's members while it was away learn them again), and read the other nodes' members
        again at the next sweep (announcements may have been missed)."""
        self._dirty = True
        self._stale.update(self.loaded)
        self._wake()

    def _wake(self) -> None:
        if self._queued is not None:
            self._queued.set()

    # -- the store (gateway/presence.py PresenceStore) ---------------------------------------------------

    def join(self, topic: str, member: Member) -> None:
        members = self.local.get(topic)
        if members is None:
            members = self.local[topic] = TopicMembers()
        if members.add(member):
            self._ops += [
                ("m", topic, member.client),
                ("u", topic, member.owner),
                ("p", topic, self._announcement("join", member)),
            ]
            self._wake()

    def leave(self, topic: str, client: str) -> Member | None:
        members = self.local.get(topic)
        if members is None:
            return None
        member = members.remove(client)
        if member is None:
            return None
        self._ops += [("m", topic, client), ("u", topic, member.owner), ("p", topic, self._announcement("leave", member))]
        if not members.clients:
            del self.local[topic]
            self._ops.append(("t", topic, ""))
        self._wake()
        return member

    def topic_gone(self, topic: str) -> None:
        if self.local.pop(topic, None) is not None:
            self._ops.append(("t", topic, ""))
            self._wake()

    def view(self, topic: str, limit: int) -> asyncio.Future[PresenceView]:
        return asyncio.ensure_future(self._view(topic, limit))

    # -- announcements -----------------------------------------------------------------------------------

    def _announcement(self, kind: str, member: Member) -> bytes:
        return b"!p " + self.node.node_id.encode() + b" " + orjson.dumps({"k": kind, "u": member.user, "c": member.client})

    def on_message(self, topic: str, payload: bytes) -> None:
        """A `!p NODE JSON` message of a topic's channel: another node's join or leave."""
        try:
            _, node_id, body = payload.split(b" ", 2)
            if node_id.decode() == self.node.node_id:
                return
            doc = orjson.loads(body)
            kind, user, client = doc["k"], doc["u"], doc["c"]
        except (ValueError, KeyError, TypeError, orjson.JSONDecodeError):
            log.warning("broker: bad presence message on %r", topic)
            return
        if kind in ("join", "leave") and isinstance(client, str) and (user is None or isinstance(user, str)):
            self._remote_event(topic, kind, node_id.decode(), Member(client, user))

    # -- the other nodes' members, and the sweep ----------------------------------------------------------

    def _tracks(self, topic: str) -> bool:
        """Whether this node keeps `topic`'s other members: it serves it and it has `join_leave`."""
        topics = self.node.events.topics
        return topic in self.node.lines and topics.has_topic(topic) and topics.topic(topic).config.join_leave

    def _remote_event(self, topic: str, kind: str, node_id: str, member: Member) -> None:
        """Another node's announcement: local `join` / `leave` entries, each member announced once (a join
        of a member already known, or a leave of one not known once the topic was read, is not)."""
        if not self._tracks(topic):
            self.forget(topic)
            self.node.events.presence_changed(topic, kind, member)
            return
        events = self._loading.get(topic)
        if events is not None:
            events.append((kind, node_id, member))
        nodes = self.remote.setdefault(topic, {})
        if kind == "join":
            members = nodes.setdefault(node_id, {})
            if member.client in members:
                return
            members[member.client] = member
        else:
            members = nodes.get(node_id, {})
            if members.pop(member.client, None) is None and topic in self.loaded:
                return
            if not members:
                nodes.pop(node_id, None)
        self.node.events.presence_changed(topic, kind, member)

    def forget(self, topic: str) -> None:
        """This node no longer serves `topic` (detached, deleted)."""
        self.remote.pop(topic, None)
        self.loaded.discard(topic)
        self._stale.discard(topic)

    async def _load(self, topics: list[str]) -> None:
        """Read the other nodes' members of `topics`: those of live nodes (a node already dead then is not
        this node's to announce: its keys are deleted). On a reload (after a reconnect, when announcements
        may have been missed) the difference with what was known is announced. O(members) once per topic."""
        redis, keys, own = self.node.redis, self.node.keys, self.node.node_id
        for topic in topics:
            self._loading[topic] = []
        try:
            pipe = redis.pipeline(transaction=False)
            for topic in topics:
                pipe.smembers(keys.presence_nodes(topic))
            node_sets = [sorted(_str(n) for n in raw if _str(n) != own) for raw in await pipe.execute()]
            pipe = redis.pipeline(transaction=False)
            for topic, nodes in zip(topics, node_sets):
                for node_id in nodes:
                    pipe.exists(keys.presence_alive(node_id))
                    pipe.hvals(keys.presence_members(topic, node_id)[0])
            values = iter(await pipe.execute())
            long_dead: list[tuple[str, str]] = []
            for topic, nodes in zip(topics, node_sets):
                read: dict[str, dict[str, Member]] = {}
                for node_id in nodes:
                    alive, raw = next(values), next(values)
                    if not alive:  # dead before this node served the topic: nobody here was told of them
                        long_dead.append((topic, node_id))
                        continue
                    members = {m.client: m for m in map(_decode, raw)}
                    if members:
                        read[node_id] = members
                for kind, node_id, member in self._loading.pop(topic):  # what came after the read began
                    if kind == "join":
                        read.setdefault(node_id, {})[member.client] = member
                    else:
                        read.get(node_id, {}).pop(member.client, None)
                self._stale.discard(topic)
                if not self._tracks(topic):
                    continue
                known = self.remote.get(topic, {})
                if topic in self.loaded:  # a reload: tell what changed meanwhile
                    self._announce_difference(topic, known, read)
                self.remote[topic] = {n: m for n, m in read.items() if m}
                self.loaded.add(topic)
            if long_dead:
                await self._delete(long_dead)
        finally:
            for topic in topics:
                self._loading.pop(topic, None)

    def _announce_difference(self, topic: str, known: dict[str, dict[str, Member]], read: dict[str, dict[str, Member]]) -> None:
        events = self.node.events
        for node_id, members in known.items():
            for client, member in members.items():
                if client not in read.get(node_id, {}):
                    events.presence_changed(topic, "leave", member)
        for node_id, members in read.items():
            for client, member in members.items():
                if client not in known.get(node_id, {}):
                    events.presence_changed(topic, "join", member)

    async def sweep(self) -> None:
        """One round after a heartbeat: read the served `join_leave` topics not read yet, then drop the
        members of nodes whose heartbeat key is gone, with a `leave` for each (to local subscribers)."""
        for topic in [t for t in self.remote if not self._tracks(t)]:
            self.forget(topic)
        unread = [
            t
            for t in self.node.lines
            if (t not in self.loaded or t in self._stale) and t not in self._loading and self._tracks(t)
        ]
        if unread:
            await self._load(unread)
        nodes = sorted({n for held in self.remote.values() for n in held})
        if not nodes:
            return
        keys, redis = self.node.keys, self.node.redis
        pipe = redis.pipeline(transaction=False)
        for node_id in nodes:
            pipe.exists(keys.presence_alive(node_id))
        dead = [n for n, flag in zip(nodes, await pipe.execute()) if not flag]
        if dead:
            await self._dead(dead)

    async def _dead(self, dead: Iterable[str]) -> None:
        """`leave` entries for the members known of the `dead` nodes, then their keys deleted."""
        gone: list[tuple[str, str]] = []
        for node_id in dead:
            for topic, held in self.remote.items():
                members = held.pop(node_id, None)
                if members is None:
                    continue
                gone.append((topic, node_id))
                log.info("broker: presence: node %s is gone: %d members of %r leave", node_id, len(members), topic)
                for member in members.values():
                    self.swept += 1
                    self.node.events.presence_changed(topic, "leave", member)
        await self._delete(gone)

    async def _delete(self, gone: list[tuple[str, str]]) -> None:
        """Delete dead nodes' keys of topics: done by the one node whose SREM took the dead node out of the
        topic's node set."""
        keys, redis = self.node.keys, self.node.redis
        pipe = redis.pipeline(transaction=False)
        for topic, node_id in gone:
            pipe.srem(keys.presence_nodes(topic), node_id)
        removed = await pipe.execute()
        mine = [(topic, node_id) for (topic, node_id), n in zip(gone, removed) if n]
        if mine:
            pipe = redis.pipeline(transaction=False)
            for topic, node_id in mine:
                pipe.delete(*keys.presence_members(topic, node_id))
            await pipe.execute()

    # -- writing -----------------------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        assert self._queued is not None
        while True:
            await self._queued.wait()
            self._queued.clear()
            if not self._ops and not self._dirty:
                continue
            ops, self._ops = self._ops, []
            dirty, self._dirty = self._dirty, False
            try:
                await self._write(ops, dirty)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.debug("broker: presence write failed: %s", exc)
                self._dirty = True  # memory is the truth: write all of it once Redis answers
                self._ops = [op for op in ops if op[0] == "t"] + self._ops  # keys of topics left here
                await asyncio.sleep(RETRY_S)
                self._wake()

    async def _write(self, ops: list[_Op], everything: bool) -> None:
        keys, node_id = self.node.keys, self.node.node_id
        publish = self.node.link.publish_command  # SPUBLISH on Redis Cluster: the topic's shard channel
        pipe = self.node.redis.pipeline(transaction=False)
        if everything:
            pipe.set(keys.presence_alive(node_id), "1", px=ALIVE_TTL_MS)
            for topic, members in self.local.items():
                member_key, owner_key = keys.presence_members(topic, node_id)
                pipe.delete(member_key, owner_key)
                pipe.hset(member_key, mapping={c: _encode(m) for c, m in members.clients.items()})
                pipe.hset(owner_key, mapping={o: n for o, n in members.owners.items()})
                pipe.sadd(keys.presence_nodes(topic), node_id)
                _expire(pipe, keys.presence_nodes(topic), member_key, owner_key)
                # announced again: a node that swept them (this node's heartbeat had expired) learns them
                # again; one that still knows them sends no entry (`_remote_event`)
                for held_member in members.clients.values():
                    pipe.execute_command(publish, keys.channel(topic), self._announcement("join", held_member))
        for kind, topic, arg in ops:
            held = self.local.get(topic)
            member_key, owner_key = keys.presence_members(topic, node_id)
            if kind == "p":
                pipe.execute_command(publish, keys.channel(topic), arg)
            elif everything or kind == "t":
                if kind == "t" and held is None:
                    pipe.delete(member_key, owner_key)
                    pipe.srem(keys.presence_nodes(topic), node_id)
            elif kind == "m":
                member = held.clients.get(arg) if held is not None else None
                if member is not None:
                    pipe.hset(member_key, arg, _encode(member))
                    pipe.sadd(keys.presence_nodes(topic), node_id)
                    _expire(pipe, keys.presence_nodes(topic), member_key)
                else:
                    pipe.hdel(member_key, arg)
            else:  # "u"
                count = held.owners.get(arg, 0) if held is not None else 0
                if count > 0:
                    pipe.hset(owner_key, arg, count)
                    _expire(pipe, owner_key)
                else:
                    pipe.hdel(owner_key, arg)
        await pipe.execute()

    async def _refresh_ttls(self) -> None:
        """The member keys of every topic this node holds members of live another `MEMBER_TTL_MS`."""
        if not self.local:
            return
        keys, node_id = self.node.keys, self.node.node_id
        pipe = self.node.redis.pipeline(transaction=False)
        for topic in self.local:
            _expire(pipe, keys.presence_nodes(topic), *keys.presence_members(topic, node_id))
        await pipe.execute()

    async def _heartbeat_loop(self) -> None:
        key = self.node.keys.presence_alive(self.node.node_id)
        beats = 0
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            beats += 1
            if beats % REFRESH_HEARTBEATS == 0:
                try:
                    await self._refresh_ttls()
                except (RedisError, OSError, asyncio.TimeoutError) as exc:
                    log.debug("broker: presence TTL refresh failed: %s", exc)
            try:
                previous = await self.node.redis.set(key, "1", px=ALIVE_TTL_MS, get=True)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.debug("broker: presence heartbeat failed: %s", exc)
                continue
            if previous is None and self.local:  # expired meanwhile: readers may have dropped our members
                self.resync()
            try:
                await self.sweep()
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.debug("broker: presence sweep failed: %s", exc)

    # -- reading -----------------------------------------------------------------------------------------

    async def _view(self, topic: str, limit: int) -> PresenceView:
        try:
            return await self._read(topic, limit)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc}") from None

    async def _read(self, topic: str, limit: int) -> PresenceView:
        redis, keys = self.node.redis, self.node.keys
        nodes_key = keys.presence_nodes(topic)
        nodes = sorted(n.decode() if isinstance(n, bytes) else n for n in await redis.smembers(nodes_key))
        if not nodes:
            return PresenceView(topic, 0, 0, [])
        pipe = redis.pipeline(transaction=False)
        for node_id in nodes:
            pipe.exists(keys.presence_alive(node_id))
        alive_flags = await pipe.execute()
        alive = [n for n, flag in zip(nodes, alive_flags) if flag]
        pipe = redis.pipeline(transaction=False)
        for node_id in nodes:
            if node_id not in alive:  # a dead node's members: dropped from the answer and from Redis
                pipe.delete(*keys.presence_members(topic, node_id))
                pipe.srem(nodes_key, node_id)
        for node_id in alive:
            member_key, owner_key = keys.presence_members(topic, node_id)
            pipe.hlen(member_key)
            pipe.hlen(owner_key)
        done = await pipe.execute()  # always: the dead nodes' deletes run even when no holder is alive
        counts = done[len(done) - 2 * len(alive) :]
        clients, users = sum(counts[0::2]), sum(counts[1::2])
        if clients > limit:
            # counts only: `users` sums each node's distinct owners (a user on two nodes counts twice)
            return PresenceView(topic, clients, users, None)
        pipe = redis.pipeline(transaction=False)
        for node_id in alive:
            pipe.hvals(keys.presence_members(topic, node_id)[0])
        members = [_decode(raw) for values in await pipe.execute() for raw in values]
        members.sort(key=lambda m: m.client)
        return PresenceView(topic, len(members), len({m.owner for m in members}), members)


def _expire(pipe: Any, *names: str) -> None:
    for name in names:
        pipe.pexpire(name, MEMBER_TTL_MS)


def _encode(member: Member) -> bytes:
    return orjson.dumps({"u": member.user, "c": member.client, "i": member.info})


def _decode(raw: bytes) -> Member:
    doc = orjson.loads(raw)
    return Member(doc["c"], doc["u"], doc["i"])


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

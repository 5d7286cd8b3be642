"""Redis Cluster (`[broker] cluster_addresses`, docs/cluster.md §10): commands and scripts through redis-py's
cluster client (it routes each by its keys' slot and follows MOVED and ASK), live messages by sharded pub/sub:
one channel connection per primary ("shard") in SSUBSCRIBE mode, each channel subscribed on the primary that
holds its slot, where the scripts' SPUBLISH sends it.

Losing any shard's channel connection is losing Redis (`lost`): publishes are refused until every shard is
reached again, every channel subscribed again on its slot's primary, and the broker has checked its topics
against Redis (`LinkHooks.reconnected`, the rewind): a primary that failed over to a replica that lacked
accepted writes is a Redis back from an older state, and its topics start new epochs, announced. The other
shards' topics resync from their streams with nothing to announce. (While a primary is down and not yet
replaced, Redis Cluster itself refuses every slot with the default `cluster-require-full-coverage yes`, so
refusing every publish meanwhile costs nothing more.)

A slot that moves to another primary (resharding) makes its old primary drop the channels of that slot with
an unsolicited `sunsubscribe`: they are subscribed again on the new primary and the broker resyncs each from
its stream (`LinkHooks.moved`), so what was published during the move is read, not missed.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError, RedisClusterException, RedisError, ResponseError

from ..config import BrokerConfig
from ..errors import BrokerUnavailable
from . import scripts
from .link import COMMAND_TIMEOUT_S, LINK_ERRORS, PROBE_TIMEOUT_S, LinkHooks, SingleLink, address, client_options

log = logging.getLogger("gateway.broker")

#: Pause before asking the cluster again where a moved channel's slot lives (the node asked may not know yet).
REHOME_RETRY_S = 0.1


@dataclass(eq=False, slots=True)
class Shard:
    """One primary's channel connection and its reader."""

    name: str
    connection: AbstractConnection
    reader: asyncio.Task[None] | None = None


class ClusterLink(SingleLink):
    """Redis Cluster: the cluster client for commands, one SSUBSCRIBE connection per shard for channels."""

    sharded = True
    publish_command = "SPUBLISH"

    def __init__(self, config: BrokerConfig, hooks: LinkHooks) -> None:
        super().__init__(config, hooks)
        self.target = f"cluster at {', '.join(config.cluster_addresses)}"
        self.shards: dict[str, Shard] = {}
        #: channel -> the shard it was subscribed on (the channels this node wants)
        self.homes: dict[str, str] = {}
        #: set by every loss (a shard's connection, a failed command): the supervisor reconnects
        self._down = asyncio.Event()
        self._rehoming: asyncio.Task[None] | None = None
        self._rehome_again = False

    def _client(self, config: BrokerConfig) -> aioredis.Redis:
        nodes = [ClusterNode(*address(a)) for a in config.cluster_addresses]
        # redis-py's cluster client allows 100 connections per node and fails a command beyond (the one-Redis
        # pool has no bound): a node attaching a thousand topics at once runs that many scripts together
        self.cluster = RedisCluster(startup_nodes=nodes, max_connections=2**31 - 1, **client_options())
        # The broker's parts use the command API that both clients share (commands, pipelines, EVALSHA):
        # typed as the one-Redis client, it is the cluster client.
        return cast(aioredis.Redis, self.cluster)

    # -- lifecycle ---------------------------------------------------------------------------------------

    def run(self) -> list[asyncio.Task[None]]:
        loop = asyncio.get_running_loop()
        return [
            loop.create_task(self._supervise(), name="broker-cluster"),
            loop.create_task(self._probe_loop(), name="broker-probe"),
        ]

    async def close(self) -> None:
        self._stop_state_lines()
        await self._close_shards()
        await self.cluster.aclose()

    async def _connect(self) -> None:
        """Learn the slots, load the scripts on every primary, open one channel connection per primary."""
        await self._close_shards()
        try:
            await self.cluster.nodes_manager.initialize()
        except RedisClusterException as exc:  # no node answered, or some slots have no primary yet
            raise ConnectionError(str(exc)) from None
        primaries = self.cluster.get_primaries()
        for name in scripts.NAMES:
            self.shas[name] = await self.cluster.script_load(scripts.source(name, sharded=True))
        for node in primaries:
            await self._open_shard(node)

    async def _open_shard(self, node: ClusterNode) -> Shard:
        connection = node.connection_class(**{**node.connection_kwargs, "socket_timeout": None})
        await connection.connect()  # type: ignore[no-untyped-call, unused-ignore]
        shard = self.shards[node.name] = Shard(node.name, connection)
        shard.reader = asyncio.get_running_loop().create_task(self._read(shard), name=f"broker-shard {node.name}")
        return shard

    async def _close_shards(self) -> None:
        shards, self.shards = list(self.shards.values()), {}
        for shard in shards:
            if shard.reader is not None and shard.reader is not asyncio.current_task():
                shard.reader.cancel()
            await shard.connection.disconnect()

    def lost(self, exc: BaseException) -> None:
        self._down.set()
        super().lost(exc)

    async def _supervise(self) -> None:
        while True:
            await self._down.wait()
            self._down.clear()
            if self.available:  # a shard failed while the last reconnect was under way: lost again, in full
                super().lost(ConnectionError(f"a shard failed during the reconnect: {self.last_error}"))
            await self._close_shards()
            await self._reconnect()

    async def _resubscribe(self, channels: list[str]) -> None:
        self.homes.clear()
        if channels:
            await self.subscribe_channels(channels)

    async def _answers_ping(self) -> bool:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                await self.cluster.ping(target_nodes=RedisCluster.PRIMARIES)
        except (RedisError, RedisClusterException, OSError, TimeoutError):
            return False
        return True

    # -- the channel connections -------------------------------------------------------------------------

    def _owner(self, channel: str) -> Shard:
        try:
            node = self.cluster.get_node_from_key(channel)
        except RedisClusterException as exc:  # the slot map lacks the slot (a failover under way)
            raise BrokerUnavailable(f"broker: {exc}") from None
        shard = self.shards.get(node.name) if node is not None else None
        if shard is None:  # a primary this node has not connected to (a failover just happened)
            raise BrokerUnavailable(f"broker: no channel connection to the primary of {channel!r} yet")
        return shard

    async def subscribe_channels(self, channels: list[str]) -> None:
        waiting = self._awaiting_confirmations(channels)
        await self._send_subscribes(channels)
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            await asyncio.gather(*waiting)

    async def _send_subscribes(self, channels: list[str]) -> None:
        """SSUBSCRIBE each channel on its slot's primary (one command per channel: a command's channels
        must share a slot)."""
        by_shard: dict[str, list[str]] = {}
        for channel in channels:
            shard = self._owner(channel)
            self.homes[channel] = shard.name
            by_shard.setdefault(shard.name, []).append(channel)
        for name, names in by_shard.items():
            connection = self.shards[name].connection
            await connection.send_packed_command(connection.pack_commands([("SSUBSCRIBE", c) for c in names]))

    def unsubscribe_channel(self, channel: str) -> None:
        home = self.homes.pop(channel, None)
        shard = self.shards.get(home) if home is not None else None
        if shard is not None and self.available:
            asyncio.get_running_loop().create_task(self._send_to(shard, "SUNSUBSCRIBE", channel))

    async def _send_to(self, shard: Shard, *args: str) -> None:
        try:
            await shard.connection.send_command(*args)
        except (RedisError, OSError) as exc:
            log.debug("broker: %s on %s failed: %s", args[0], shard.name, exc)

    async def _read(self, shard: Shard) -> None:
        try:
            while True:
                try:
                    reply = await shard.connection.read_response(timeout=math.inf, push_request=True)
                except ResponseError as exc:  # MOVED: an SSUBSCRIBE reached a primary that lost the slot
                    log.debug("broker: shard %s: %s", shard.name, exc)
                    self._rehome()
                    continue
                self._on_shard_reply(shard, reply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the shard's connection failed: Redis is lost until every shard is back
            if self.shards.get(shard.name) is shard:
                self.lost(exc)

    def _on_shard_reply(self, shard: Shard, reply: Any) -> None:
        kind = reply[0]
        if kind == b"smessage":
            self.hooks.message(reply[1].decode(), reply[2])
        elif kind == b"ssubscribe":
            channel = reply[1].decode()
            future = self._subscribing.get(channel)
            if future is not None and self.homes.get(channel) == shard.name:
                del self._subscribing[channel]
                if not future.done():
                    future.set_result(None)
        elif kind == b"sunsubscribe" and self.homes.get(reply[1].decode()) == shard.name:
            self._rehome()  # not asked for: the slot moved to another primary

    # -- slots that moved --------------------------------------------------------------------------------

    def _rehome(self) -> None:
        if self._rehoming is not None and not self._rehoming.done():
            self._rehome_again = True
            return
        self._rehoming = asyncio.get_running_loop().create_task(self._rehome_loop(), name="broker-rehome")

    async def _rehome_loop(self) -> None:
        """Subscribe the channels whose slot moved on their new primary, then have each resynced."""
        self._rehome_again = True
        try:
            while self._rehome_again and self.available:
                self._rehome_again = False
                await asyncio.sleep(REHOME_RETRY_S)
                await self.cluster.nodes_manager.initialize()
                for node in self.cluster.get_primaries():
                    if node.name not in self.shards:
                        await self._open_shard(node)
                moved = [c for c, home in self.homes.items() if self._owner(c).name != home]
                if moved:
                    log.info("broker: %d channels follow their slots to other primaries", len(moved))
                    await self._move(moved)
        except LINK_ERRORS as exc:
            self.lost(exc)

    async def _move(self, channels: list[str]) -> None:
        for channel in channels:
            shard = self.shards.get(self.homes[channel])
            if shard is not None:
                await self._send_to(shard, "SUNSUBSCRIBE", channel)
        await self.subscribe_channels(channels)
        for channel in channels:
            self.hooks.moved(channel)

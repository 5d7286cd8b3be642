"""The operators' control commands across the cluster (docs/integration.md, "User control"): kick a client, disconnect
a user, revoke tokens, list clients, run on every node of one Redis.

* One pub/sub channel, `P:control`, which every node's channel connection subscribes (beside its topics').
  A command is published there as JSON with the origin node and a reply key; each other node runs it
  through its `control_handler` (`ControlCommands.run`, gateway/control_commands.py) and RPUSHes its answer
  to the reply key (a list, expiring after `REPLY_TTL_S`). The origin ran it itself first, before publishing.
* PUBLISH answers how many connections received the message: the number of nodes listening, so the origin
  knows how many answers to wait for, and waits at most `CONTROL_REPLY_TIMEOUT_S` (BLPOP). A node that
  answers later still ran the command; it is only missing from the count.
* Revocations also go to a hash, `P:revocations` (field `jti:J` or `user:U`, the entry as JSON), whose TTL
  follows its longest-lived entry: a node that starts, or comes back after losing Redis (whose pub/sub
  messages of the meantime are lost), rereads it and applies every live entry, closing the holders too.

Bound: a command reaches every connected node within one Redis round trip (milliseconds), and the API
answers within `CONTROL_REPLY_TIMEOUT_S`; a node cut off from Redis applies revocations when it reconnects
(its kicks and disconnects of the meantime are lost: those clients were cut off from the cluster too).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisError

from core import RequestError

from ..errors import BrokerUnavailable

if TYPE_CHECKING:
    from .node import RedisNode

log = logging.getLogger("gateway.broker")

#: How long the origin of a command waits for the other nodes' answers at most.
CONTROL_REPLY_TIMEOUT_S = 2.0
#: An answer list outlives its command by this much (late answers are dropped with it).
REPLY_TTL_S = 10


def revocation_field(entry: dict[str, Any]) -> str:
    return f"jti:{entry['jti']}" if "jti" in entry else f"user:{entry['user']}"


class ControlChannel:
    def __init__(self, broker: RedisNode) -> None:
        self.broker = broker
        self._tasks: set[asyncio.Task[None]] = set()

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the origin ---------------------------------------------------------------------------------------

    async def control(self, command: dict[str, Any]) -> list[dict[str, Any]]:
        broker = self.broker
        local = {"node": broker.node_id, **broker.control_handler(command)}
        if not broker.available:
            raise BrokerUnavailable(f"broker unreachable: {broker.last_error}; ran on this node only")
        keys = broker.keys
        reply_key = keys.reply(secrets.token_hex(8))
        message = orjson.dumps({**command, "origin": broker.node_id, "reply": reply_key})
        answers = [local]
        try:
            if command.get("op") == "revoke":
                await self._store(local.get("entry", command["entry"]))
            # on Redis Cluster a shard channel (SPUBLISH): it counts the subscribers on the channel's shard,
            # where every node subscribes it
            publish = broker.redis.spublish if broker.link.sharded else broker.redis.publish
            receivers: int = await publish(keys.control, message)
            expected = receivers - 1  # this node's own channel connection got it too
            deadline = time.monotonic() + CONTROL_REPLY_TIMEOUT_S
            while len(answers) - 1 < expected:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                got = await broker.redis.blpop([reply_key], timeout=remaining)
                if got is None:
                    break
                answers.append(orjson.loads(got[1]))
            await broker.redis.delete(reply_key)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc}; ran on {len(answers)} node(s)") from None
        if len(answers) - 1 < expected:
            log.warning(
                "control %s: %d of %d other nodes answered within %.1f s",
                command.get("op"),
                len(answers) - 1,
                expected,
                CONTROL_REPLY_TIMEOUT_S,
            )
        return answers

    async def _store(self, entry: dict[str, Any]) -> None:
        broker = self.broker
        key = broker.keys.revocations
        ttl = max(1, math.ceil(float(entry["expires_at"]) - time.time()))
        pipe = broker.redis.pipeline(transaction=False)
        pipe.hset(key, revocation_field(entry), orjson.dumps(entry))
        pipe.expire(key, ttl, nx=True)  # a new hash: its first entry's life
        pipe.expire(key, ttl, gt=True)  # then the longest entry's
        await pipe.execute()

    # -- every other node ---------------------------------------------------------------------------------

    def on_message(self, channel: str, payload: bytes) -> bool:
        """A message of the control channel (True), run here and answered; False: another channel's."""
        broker = self.broker
        if channel != broker.keys.control:
            return False
        try:
            command = orjson.loads(payload)
            if not isinstance(command, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            log.warning("control: malformed command ignored: %s", exc)
            return True
        if command.get("origin") == broker.node_id:
            return True  # ran before it was published
        try:
            answer: dict[str, Any] = {"node": broker.node_id, **broker.control_handler(command)}
        except RequestError as exc:
            log.warning("control %s from %s: %s", command.get("op"), command.get("origin"), exc)
            answer = {"node": broker.node_id, "error": {"code": exc.code, "message": exc.message}}
        reply = command.get("reply")
        if isinstance(reply, str) and reply.startswith(broker.keys.reply("")):
            self._spawn(self._answer(reply, orjson.dumps(answer)), "broker-control-reply")
        return True

    async def _answer(self, reply: str, answer: bytes) -> None:
        try:
            pipe = self.broker.redis.pipeline(transaction=False)
            pipe.rpush(reply, answer)
            pipe.expire(reply, REPLY_TTL_S)
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.debug("control: answer not sent: %s", exc)

    # -- a node that (re)connects --------------------------------------------------------------------------

    async def load_revocations(self) -> None:
        """Apply every live revocation in Redis (at start, and after Redis was lost); drop expired ones."""
        broker = self.broker
        key = broker.keys.revocations
        stored: dict[Any, Any] = await broker.redis.hgetall(key)
        now = time.time()
        expired = []
        for field, value in stored.items():
            try:
                entry = orjson.loads(value)
                if float(entry["expires_at"]) <= now:
                    expired.append(field)
                    continue
                broker.control_handler({"op": "revoke", "entry": entry})
            except (ValueError, KeyError, TypeError, RequestError) as exc:
                log.warning("control: revocation %r not applied: %s", field, exc)
        if expired:
            await broker.redis.hdel(key, *expired)

    def resync(self) -> None:
        """After a reconnect: reread the revocations (the channel's messages of the meantime are lost)."""
        self._spawn(self._resync(), "broker-control-resync")

    async def _resync(self) -> None:
        try:
            await self.load_revocations()
        except (RedisError, OSError) as exc:
            log.warning("control: revocations not reread: %s", exc)

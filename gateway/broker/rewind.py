"""A Redis behind this node (docs/cluster.md, failure table): restored from an older snapshot, or a replica
promoted by a failover that lacked accepted writes (replication is asynchronous). Its next seq of a topic is
then below what this node delivered or was told accepted, so it would give those seqs again to other
messages, and the nodes that delivered them would drop the new ones as already delivered: a silent loss.

Each such topic starts a new epoch at this node's floor (scripts.REWIND): every node resyncs it and its
subscribers get `loss [cursor, null)` `epoch`, then `subscribed` of the new epoch. The floors checked are
the served lines' ends and, for topics this node published to without serving them, the seqs Redis
accepted since the last check (at most ACCEPTED_MAX topics, the least recently published forgotten first).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict
from collections.abc import Iterable

from redis.exceptions import RedisError

from .feeds import Line
from .keys import Keys
from .link import Link

log = logging.getLogger("gateway.broker")

#: Topics whose accepted seqs are remembered between two checks (a few hundred bytes each); beyond, the
#: least recently published are forgotten (their writes are the likeliest to have reached the replicas).
ACCEPTED_MAX = 50_000
#: REWIND calls per pipeline at a reconnect.
CHECK_BATCH = 1000

#: (topic, epoch, next seq this node knows of)
Floor = tuple[str, str, int]


class Rewinder:
    def __init__(self, link: Link, keys: Keys) -> None:
        self.link = link
        self.keys = keys
        #: topic -> (epoch, next seq) Redis acknowledged to this node's publishes since the last check
        self.accepted: OrderedDict[str, tuple[str, int]] = OrderedDict()
        #: topics that started a new epoch because Redis was behind this node (`/metrics`)
        self.rewinds = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def note_accepted(self, topic: str, epoch: str, seq: int) -> None:
        """Redis accepted a publish of `topic` at `seq` of `epoch`."""
        known = self.accepted.get(topic)
        if known is None or known[0] != epoch or known[1] <= seq:
            self.accepted[topic] = (epoch, seq + 1)
        self.accepted.move_to_end(topic)
        if len(self.accepted) > ACCEPTED_MAX:
            self.accepted.popitem(last=False)

    async def check(self, lines: Iterable[Line]) -> None:
        """After a reconnect, before publishes resume: every served topic and every topic accepted since the
        last check, against Redis. Raises the link's errors (the reconnect tries again)."""
        floors: dict[tuple[str, str], int] = {(name, epoch): end for name, (epoch, end) in self.accepted.items()}
        for line in lines:
            if line.epoch is not None:
                key = (line.name, line.epoch)
                floors[key] = max(floors.get(key, 0), line.next)
        checks = [(name, epoch, end) for (name, epoch), end in floors.items()]
        for i in range(0, len(checks), CHECK_BATCH):
            await self.behind(checks[i : i + CHECK_BATCH])
        self.accepted.clear()  # Redis holds every one of them now (or a new epoch past it)

    async def behind(self, floors: list[Floor]) -> None:
        """One pipeline of REWIND: each topic Redis holds behind its floor starts a new epoch there."""
        if not floors:
            return
        keys, link = self.keys, self.link
        pipe = link.redis.pipeline(transaction=False)
        for name, epoch, end in floors:
            pipe.execute_command(
                "EVALSHA",
                link.shas["REWIND"],
                2,
                keys.meta(name),
                keys.stream(name),
                secrets.token_hex(8),
                epoch,
                end,
                keys.channel(name),
            )
        for (name, epoch, end), rewound in zip(floors, await pipe.execute()):
            if rewound == 1:
                log.warning(
                    "broker: Redis is behind this node on %r (seqs up to %d of epoch %s were delivered or"
                    " accepted): Redis went back in time (an older snapshot, a replica that lagged);"
                    " the topic starts a new epoch",
                    name,
                    end - 1,
                    epoch,
                )
                self.rewinds += 1

    def spawn(self, line: Line) -> None:
        """A publish got a seq this node delivered already: check that topic now."""
        if line.epoch is None:
            return
        floor = (line.name, line.epoch, line.next)

        async def rewind() -> None:
            try:
                await self.behind([floor])
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                self.link.lost(exc)  # the reconnect checks every topic again

        task = asyncio.get_running_loop().create_task(rewind(), name=f"broker-rewind {line.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

"""The hub: one core engine, the connections of every transport, and the scheduler task that drives it.

Transports are adapters: each connection object implements `Connection` and the hub never knows more of
it. The scheduler task runs `run_cycle` whenever there is work (an event set by publish, subscribe, ready),
hands each batch to its connection without awaiting it, and sleeps when idle.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol

from core import Batch, Engine, QueueFull, RequestError
from core.entries import encode_error

from . import close_codes
from .config import GatewayConfig
from .gcpolicy import GcPolicy
from .metrics import Metrics
from .ratelog import BadInputLog

log = logging.getLogger("gateway")


@dataclass
class ClientIdentity:
    """Where a connection's identity and permissions live (authentication will fill `user` and `scopes`)."""

    client_id: str
    transport: str
    peer: str = ""
    user: str | None = None
    scopes: frozenset[str] | None = None  # None: no restriction beyond topic config
    connected_at: float = field(default_factory=time.time)


class Connection(Protocol):
    identity: ClientIdentity

    def deliver(self, batch: Batch, frame: bytes) -> bool:
        """Start writing one batch; True if the write completed at once (the client is ready again)."""

    def kick(self, code: int, reason: str) -> None:
        """Close the connection with a protocol close code and reason."""

    def describe(self) -> dict[str, Any]:
        """State for the admin API."""


class Hub:
    def __init__(self, config: GatewayConfig, *, instance_id: str | None = None) -> None:
        self.config = config
        self.instance_id = instance_id or secrets.token_hex(4)
        self.engine = Engine(config.engine_config(), instance_id=self.instance_id)
        self.conns: dict[str, Connection] = {}
        self.gc = GcPolicy(config.server.gc_full_interval_s)
        self.bad_input = BadInputLog(config.limits.bad_input_log_per_s)
        self.metrics = Metrics(self)
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._ids = itertools.count(1)
        #: publishers waiting for space in a private queue: (topic, client) -> futures
        self._space_waiters: dict[tuple[str, Hashable], list[asyncio.Future]] = {}
        #: connections whose last write has not drained (not ready), watched for the blocked timeout
        self.blocked: dict[str, Any] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        self.raw = None  # the raw TCP broadcaster, when enabled
        self.ingest = None

    # -- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._scheduler(), name="fanout-scheduler")
        self._schedule_tick()
        self._schedule_watchdog()
        self.gc.start()

    async def stop(self) -> None:
        self.gc.stop()
        for timer in (self._tick, self._watchdog):
            if timer:
                timer.cancel()
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.close_all_clients()

    def close_all_clients(self) -> None:
        for client_id in list(self.conns):
            self.kick(client_id, close_codes.GOING_AWAY, "server shutting down", "shutdown")

    def _schedule_tick(self) -> None:
        period = self.config.scheduler.hole_tick_ms / 1000
        loop = asyncio.get_running_loop()
        self._tick = loop.call_later(period, self._on_tick)

    def _on_tick(self) -> None:
        # Cost: O(topics that hold an out-of-order hole), nothing when there is none.
        if self.engine.tick(time.monotonic()):
            self.wake()
        self._schedule_tick()

    def _schedule_watchdog(self) -> None:
        period = min(1.0, self.config.websocket.blocked_timeout_s / 4)
        self._watchdog = asyncio.get_running_loop().call_later(period, self._on_watchdog)

    def _on_watchdog(self) -> None:
        # Cost: O(write-blocked clients) only.
        limit = self.config.websocket.blocked_timeout_s
        now = time.monotonic()
        for client_id, conn in list(self.blocked.items()):
            if conn.blocked_since is not None and now - conn.blocked_since > limit:
                log.info("disconnecting %s: write-blocked for more than %.1f s", client_id, limit)
                self.kick(client_id, close_codes.SLOW_CONSUMER, "slow consumer", "slow_consumer")
        self._schedule_watchdog()

    # -- connections -----------------------------------------------------------------------------------

    def new_client_id(self, prefix: str) -> str:
        return f"{prefix}-{self.instance_id}-{next(self._ids)}"

    def register(self, conn: Connection, *, ready: bool) -> None:
        cid = conn.identity.client_id
        self.engine.connect(cid, ready=ready, info=conn.identity)
        self.conns[cid] = conn
        self.metrics.connected(conn.identity.transport)

    def unregister(self, client_id: str, reason: str) -> None:
        conn = self.conns.pop(client_id, None)
        if conn is None:
            return
        self.blocked.pop(client_id, None)
        self.engine.disconnect(client_id)
        self.metrics.disconnected(conn.identity.transport, reason)
        self._wake_space_waiters()

    def kick(self, client_id: str, code: int, reason: str, metric_reason: str) -> bool:
        conn = self.conns.get(client_id)
        if conn is None:
            return False
        conn.kick(code, reason)
        self.unregister(client_id, metric_reason)
        return True

    # -- the core's verbs, with the wake-up the scheduler needs --------------------------------------------

    def wake(self) -> None:
        if self.engine.has_work:
            self._work.set()

    def write_done(self, client_id: str) -> None:
        if client_id in self.conns:
            self.engine.write_done(client_id)
            self._wake_space_waiters()
            self.wake()

    def commit(self, client_id: str) -> None:
        self.engine.commit(client_id)
        self._wake_space_waiters()

    def mark_ready(self, client_id: str) -> None:
        self.engine.mark_ready(client_id)
        self.wake()

    def send_direct(self, client_id: str, entry: bytes) -> None:
        try:
            self.engine.send_direct(client_id, entry)
        except RequestError:  # DirectQueueFull: the client does not read its replies
            self.kick(client_id, close_codes.DIRECT_OVERFLOW, "direct queue overflow", "direct_queue_full")
            return
        self.wake()

    def send_error(self, client_id: str, exc: RequestError, request_id: Any = None) -> None:
        self.send_direct(client_id, encode_error(exc.code, exc.message, request_id))

    def publish(self, topic: str, data: Any, *, seq: int | None = None, owner: Hashable = None):
        """Publish now or raise (QueueFull is back-pressure: see `publish_wait`). `owner`: the user whose
        private queue gets it (private topics)."""
        result = self.engine.publish(topic, data, seq=seq, owner=owner, now=time.monotonic())
        self.wake()
        return result

    async def publish_wait(self, topic: str, data: Any, *, owner: Hashable, timeout: float, seq: int | None = None):
        """Publish to a private queue, waiting up to `timeout` seconds for space (seed 001 blocking push)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.publish(topic, data, seq=seq, owner=owner)
            except QueueFull:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                await asyncio.wait_for(self.space_freed(topic, owner), remaining)

    def space_freed(self, topic: str, owner: Hashable) -> asyncio.Future:
        """A future resolved when the private queue (topic, owner) frees space or disappears."""
        future = asyncio.get_running_loop().create_future()
        self._space_waiters.setdefault((topic, owner), []).append(future)
        return future

    def _wake_space_waiters(self) -> None:
        for key in self.engine.take_space_freed():
            for future in self._space_waiters.pop(key, ()):
                if not future.done():
                    future.set_result(None)

    # -- the scheduler -----------------------------------------------------------------------------------

    async def _scheduler(self) -> None:
        engine = self.engine
        metrics = self.metrics
        while True:
            await self._work.wait()
            self._work.clear()
            while engine.has_work:
                started = time.perf_counter()
                batches = engine.run_cycle()
                self._deliver(batches)
                metrics.cycle(time.perf_counter() - started, batches)
                # Let reads and writes run between cycles; publishes meanwhile coalesce into the next one.
                await asyncio.sleep(0)

    def _deliver(self, batches: list[Batch]) -> None:
        frames: dict[tuple[int, ...], bytes] = {}
        conns = self.conns
        done = []
        for batch in batches:
            conn = conns.get(batch.client_id)
            if conn is None:
                continue
            # Clients of one topic usually get identical batches: frame them once (ids are of live objects).
            key = tuple(map(id, batch.entries))
            frame = frames.get(key)
            if frame is None:
                frame = frames[key] = batch.frame()
            try:
                finished = conn.deliver(batch, frame)
            except Exception:  # a transport that broke mid-write: drop it, never the others
                log.exception("delivery to %s failed", batch.client_id)
                self.kick(batch.client_id, close_codes.INTERNAL_ERROR, "internal error", "error")
                continue
            if finished:
                done.append(batch.client_id)
        for client_id in done:
            self.engine.write_done(client_id)
        if done:
            self._wake_space_waiters()

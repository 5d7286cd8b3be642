"""The scheduler: the core engine, the task that runs its cycles, and the hand-off of batches to connections.

It owns every change of the engine: its `Membership` (below) has the verbs the client registry, the topic
catalog and the broker use (connect, subscribe, apply, create, ...; it is the broker's `BrokerEvents`), so
each change comes with the wake-up it needs and no caller can forget one (a silent stall). Everyone else
reads the engine through `topics`, a read-only `TopicView` (gateway/topic_view.py); no other module holds
the engine (tests/core/test_engine_has_one_writer.py).

The task runs `run_cycle` whenever there is work, hands each batch to its connection without awaiting it,
and sleeps when idle. A round runs up to `write_coalesce_cycles` cycles (or `write_coalesce_ms`) while work
remains, then each connection writes its staged frames once (gateway/transports/staging.py).
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from core import Batch, Crowd, Engine, Published, RequestError, Sink, TopicConfig
from core.entries import encode_error, frame_batch

from . import close_codes
from .auth.identity import ClientIdentity
from .config import GatewayConfig
from .fanwrite import Sender
from .ops.deliverylog import DeliveryLog
from .ops.metrics import BATCH_BUCKETS, CYCLE_BUCKETS, BucketHistogram
from .ops.tracing import ExpectedApply, Fanout, count_fanouts, end_fanouts, forget_applies
from .presence import Member, Presence, PresenceStore
from .tenancy import Tenancy
from .topic_view import TopicView

if TYPE_CHECKING:
    from .auth.tokens import Principal

log = logging.getLogger("gateway")

#: a linger due within this much is ended now: the loop's timers tick in milliseconds and may fire early
LINGER_SLACK_S = 0.001

#: sockets the fan-out writer is handed at most at once: a crowd's first clients get their frame while the
#: scheduler still hands out the rest (10,000 in one call waited ~20 ms of hand-off for the first one)
CROWD_SLICE = 512

#: how the scheduler drops a connection that broke: (client id, close code, reason, metric reason) -> closed
Kick = Callable[[Hashable, int, str, str], bool]
#: where private queues' commits go (a Redis broker acknowledges them): (topic, owner, first seq still queued)
Commits = Callable[[list[tuple[str, Hashable, int]]], None]


class IdleClock(Protocol):
    #: when the client's last command came (monotonic)
    last_command: float


class OwningSession(Protocol):
    """What the registry needs of a connection's session (gateway/session.py `ClientSession`): named here so
    that the scheduler does not import the session, which sits above it."""

    @property
    def state(self) -> IdleClock: ...

    def authenticate(self, principal: Principal) -> Principal: ...


class Connection(Protocol):
    """What the scheduler and the client registry need of a transport's connection."""

    identity: ClientIdentity

    @property
    def session(self) -> OwningSession:
        """Its client's session: the registry reads its idle clock and renews its identity."""

    #: when its last write stopped draining (monotonic), None while it drains: the watchdog's input
    blocked_since: float | None

    def deliver(self, batch: Batch, frame: bytes) -> Delivered:
        """Write one batch, or stage it for the round's write (transports/staging.py): what became of it."""

    def flush(self) -> bool:
        """Write what was staged this round; True when it drained (the client stays ready)."""

    def kick(self, code: int, reason: str, retry_ms: int | None = None) -> None:
        """Close the connection with a protocol close code and reason; `retry_ms`: the reconnect hint of a
        drain (1012), carried by the SSE close event and the long-poll entry (the WebSocket: in the reason)."""

    def describe(self) -> dict[str, Any]:
        """State for the admin API."""


class Delivered(Enum):
    """What a connection did with a batch (`Connection.deliver`); the scheduler keeps its round's sets."""

    #: written; the client is ready for the next one
    DONE = "done"
    #: staged for the round's write; the client has more to come (ready: it takes part in the next cycle)
    STAGED = "staged"
    #: staged behind frames staged earlier in the round, the client caught up: written after this cycle
    CAUGHT_UP = "caught_up"
    #: written, and the transport is above its high-water mark (or closed): not ready until it drains
    BLOCKED = "blocked"
    #: handed over, done only when the client acknowledges it (long-poll): not ready until then
    HELD = "held"


@runtime_checkable
class DirectWritable(Protocol):
    """A connection whose caught-up batches the fan-out writer may send to its socket directly, together with
    other clients' (gateway/fanwrite.py): the WebSocket's, checked once when it registers."""

    #: what the connection's bytes for a frame depend on besides the frame (0: nothing; the WebSocket: the
    #: window of its compressed frames, for frames of `compression_min_bytes` or more; negative: another
    #: protocol's form of every frame, gateway/transports/ws_centrifugo.py)
    wire_variant: int
    #: where the engine may gather its caught-up one-entry batches into crowds (`Engine.take_crowds`): no
    #: per-client call at all, the frame then goes to `token` with `wire`'s bytes unless `handle` (its
    #: transport) is closing or holds bytes. None: each batch is handed out (`direct_fd`).
    crowd_sink: Sink | None

    def direct_fd(self, batch: Batch, frame: bytes) -> int:
        """The socket this batch's frame may be written to directly, the batch then counted as delivered;
        -1: `deliver` it. Asked only of a batch with nothing more to come (`Batch.more` false)."""

    def wire(self, frame: bytes, count: int) -> bytes:
        """The bytes `direct_fd`'s socket gets for a frame, the same for every connection of its kind and
        `wire_variant`; `count` sockets get them."""

    def gathered_wire(self, entry: bytes, frame: bytes, sinks: list[Sink]) -> bytes:
        """The bytes for a crowd (`crowd_sink`) of connections of this kind and `wire_variant` whose batch is
        `entry`, framed as `frame`; b"": none of it is for them (they were counted delivered all the same)."""

    def write_rest(self, data: bytes, sent: int) -> bool:
        """The direct write took `sent` bytes of `data` (-errno: none): the transport writes the rest; True if
        the client is ready again."""


#: one frame's caught-up clients of one wire variant, handed out one by one: their sockets, connections, ids
HandedOut = tuple[list[int], list[DirectWritable], list[Hashable]]


class CrowdsSent:
    """What a cycle handed to the sender, in the order submitted. Per submit: the index of its first socket,
    its bytes, and whose its sockets are from `offsets` on in `members` (connections handed out one by one,
    or a crowd's sinks): a shortfall's index names the socket. `client_ids`: the clients handed out, done
    once sent (a crowd's were counted written by the engine)."""

    __slots__ = ("count", "starts", "wires", "members", "offsets", "client_ids")

    def __init__(self) -> None:
        self.count = 0
        self.starts: list[int] = []
        self.wires: list[bytes] = []
        self.members: list[list[DirectWritable] | list[Sink]] = []
        self.offsets: list[int] = []
        self.client_ids: list[Hashable] = []


class Scheduler:
    def __init__(
        self, config: GatewayConfig, conns: Mapping[Hashable, Connection], *, kick: Kick, instance_id: str = "0"
    ) -> None:
        self.config = config
        self.engine = Engine(config.engine_config(), instance_id=instance_id)
        #: whose share each connection's service counts to (`[fairness]`, gateway/tenancy.py)
        self.tenancy = Tenancy(config.fairness)
        if self.tenancy.enabled:
            self.engine.enable_fairness(self.tenancy.fair_share())
        #: the engine for everyone else: read-only (changes go through `membership` or the verbs below)
        self.topics: TopicView = self.engine
        #: the client registry's connections, read-only here
        self.conns = conns
        #: how a connection that broke is dropped (the client registry's `kick`)
        self.kick = kick
        #: private queues' commits go to the broker, when it takes them (`Membership.attach_broker`)
        self.report_commits: Commits | None = None
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._tick: asyncio.TimerHandle | None = None
        #: armed while a topic lingers (`TopicConfig.linger`): wakes its held subscribers when it is due
        self._linger: asyncio.TimerHandle | None = None
        self._linger_due = 0.0
        #: the connections of `conns` the fan-out writer may write directly (`DirectWritable`), by client
        self.writable_sockets: dict[Hashable, DirectWritable] = {}
        #: connections with frames staged in the current round (`_flush_staged` writes them)
        self.staged: dict[Connection, None] = {}
        #: those of them whose client is caught up: written after the cycle, not at the round's end
        self.caught_up: dict[Connection, None] = {}
        #: a round runs up to this many cycles (or `coalesce_s`) while work remains, then writes once per client
        self.coalesce_cycles = config.scheduler.write_coalesce_cycles
        self.coalesce_s = config.scheduler.write_coalesce_ms / 1000
        #: staged bytes per connection at which it is written before the round ends (transports/staging.py)
        self.stage_limit = config.websocket.write_high_water
        #: frames below this go out the same whatever a connection's `wire_variant` (uncompressed)
        self.variant_min_bytes = config.websocket.compression_min_bytes
        #: connections whose last write has not drained (not ready), watched for the blocked timeout
        self.blocked: dict[Hashable, Connection] = {}
        #: publishers waiting for space in a private queue: (topic, owner) -> futures
        self._space_waiters: dict[tuple[str, Hashable], list[asyncio.Future[None]]] = {}
        #: the sampled delivery log ([deliverylog], gateway/ops/deliverylog.py), when enabled: its writer thread
        #: ends with the scheduler's task
        self.delivery_log = (
            DeliveryLog(config.deliverylog, instance_id, lambda: self._task is not None and self._task.done())
            if config.deliverylog.enabled
            else None
        )
        #: rounds run, and write calls of staged data (`/metrics`: batches written / writes = what rounds save)
        self.rounds = 0
        self.staged_writes = 0
        #: frames written straight to a socket with others (`_write_crowd`), and those a socket did not take whole
        self.direct_writes = 0
        self.direct_shortfalls = 0
        #: of the direct writes, those to clients the engine gathered into crowds (no Python per client)
        self.gathered_writes = 0
        #: the fan-out writer's sender (gateway/fanwrite.py: the compiled one or its Python twin)
        self.sender = Sender()
        self._sent = CrowdsSent()
        self.cycle_seconds = BucketHistogram(CYCLE_BUCKETS)
        self.entries_per_batch = BucketHistogram(BATCH_BUCKETS)
        #: sampled admin publishes whose apply is awaited, by topic (gateway/ops/tracing.py); empty unless traced
        self.traced_applies: dict[str, ExpectedApply] = {}
        #: traced messages whose fan-out is being watched, by topic: each cycle's batches are counted
        #: only while it is not empty
        self.fanouts: dict[str, Fanout] = {}
        #: armed while join/leave changes wait for their flush (`Presence.due_at`)
        self._presence_timer: asyncio.TimerHandle | None = None
        #: the verbs on clients, subscriptions and topics (the registry's, the catalog's, the broker's)
        self.membership = Membership(self)
        #: presence members of topics with `presence` (gateway/presence.py), in the broker's store
        self.presence = self.membership.presence

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fanout-scheduler")
        self._schedule_tick()

    async def stop(self) -> None:
        for timer in (self._tick, self._linger, self._presence_timer):
            if timer is not None:
                timer.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    def _schedule_tick(self) -> None:
        period = self.config.scheduler.hole_tick_ms / 1000
        self._tick = asyncio.get_running_loop().call_later(period, self._on_tick)

    def _on_tick(self) -> None:
        # Cost: O(topics that hold an out-of-order hole), nothing when there is none; reclaim costs
        # O(topics that became unused + topics whose time is up).
        now = time.monotonic()
        if self.engine.tick(now):
            self.wake()
        ttl = self.config.limits.topic_ttl_s
        if ttl > 0:
            self.engine.reclaim(now, ttl, self.config.limits.topic_history_ttl_s)
        if self.fanouts or self.traced_applies:  # traced publishes whose watch is over (gateway/ops/tracing.py)
            end_fanouts(self.fanouts, now)
            forget_applies(self.traced_applies, now)
        self._schedule_tick()

    # -- wake-ups ----------------------------------------------------------------------------------------

    def wake(self) -> None:
        if self.engine.lingering:
            self._arm_linger()
        if self.engine.has_work:
            self._work.set()

    def _arm_linger(self) -> None:
        """The timer goes off at the earliest linger's end: a topic with a shorter linger held after one
        with a longer may end first."""
        due = self.engine.next_release()
        if due is None or (self._linger is not None and self._linger_due <= due):
            return
        if self._linger is not None:
            self._linger.cancel()
        self._linger_due = due
        self._linger = asyncio.get_running_loop().call_later(max(0.0, due - time.monotonic()), self._on_linger)

    def _presence_noted(self) -> None:
        """A join or leave waits to be announced: a cycle now, or once the presence flush is due."""
        delay = self.presence.due_at() - time.monotonic()
        if delay <= 0:
            self._work.set()
        elif self._presence_timer is None:
            self._presence_timer = asyncio.get_running_loop().call_later(delay, self._on_presence_due)

    def _on_presence_due(self) -> None:
        self._presence_timer = None
        self._work.set()

    def _on_linger(self) -> None:
        self._linger = None
        self.engine.release(time.monotonic() + LINGER_SLACK_S)
        self.wake()

    # -- readiness (the transports' write state) -----------------------------------------------------------

    def write_blocked(self, client_id: Hashable, conn: Connection) -> None:
        """A write did not drain at once: the client is not ready, and the watchdog watches it."""
        self.blocked[client_id] = conn

    def write_drained(self, client_id: Hashable) -> None:
        """The blocked write drained: the client is ready again."""
        self.blocked.pop(client_id, None)
        self.write_done(client_id)

    def write_unwatched(self, client_id: Hashable) -> None:
        """The connection is gone: stop watching its write (the registry unregisters it separately)."""
        self.blocked.pop(client_id, None)

    def write_done(self, client_id: Hashable) -> None:
        if client_id in self.conns:
            self.engine.write_done(client_id)
            self.space()
            self.wake()

    def mark_ready(self, client_id: Hashable) -> None:
        self.engine.mark_ready(client_id)
        self.wake()

    def mark_idle(self, client_id: Hashable) -> None:
        self.engine.mark_idle(client_id)

    def commit(self, client_id: Hashable) -> None:
        self.engine.commit(client_id)
        self.space()

    def space_freed(self, topic: str, owner: Hashable) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._space_waiters.setdefault((topic, owner), []).append(future)
        return future

    def space(self) -> None:
        if self.report_commits is not None:
            committed = self.engine.take_committed()
            if committed:
                self.report_commits(committed)
        for key in self.engine.take_space_freed():
            for future in self._space_waiters.pop(key, ()):
                if not future.done():
                    future.set_result(None)

    # -- the task ----------------------------------------------------------------------------------------

    async def _run(self) -> None:
        engine = self.engine
        while True:
            await self._work.wait()
            self._work.clear()
            self.presence.flush(time.monotonic())  # join/leave entries noted meanwhile, coalesced
            while engine.has_work:
                round_started = time.perf_counter()
                for cycle in range(1, self.coalesce_cycles + 1):
                    started = time.perf_counter()
                    self.presence.flush(time.monotonic())
                    # A cycle allocates a batch per client and frees them all at its end: the collector,
                    # triggered every 700 of them, would walk the live ones again and again (a tenth of the
                    # CPU at 10,000 clients). They hold no cycles, so it waits until they are gone.
                    collecting = gc.isenabled()
                    if collecting:
                        gc.disable()
                    try:
                        # clients with a sink are gathered into crowds, unless each batch must be seen
                        engine.crowding = not self.fanouts and self.delivery_log is None
                        batches = engine.run_cycle()
                        crowds = engine.take_crowds()
                        self._deliver(batches, crowds)
                        if self.fanouts:  # a traced publish's fan-out is watched (gateway/ops/tracing.py)
                            count_fanouts(self.fanouts, batches)
                    finally:
                        if collecting:
                            gc.enable()
                    now = time.perf_counter()
                    self.cycle_seconds.observe(now - started)
                    del batches, crowds  # not held while the loop sleeps: the last cycle's entries can be a lot
                    if cycle == self.coalesce_cycles or not engine.has_work or now - round_started >= self.coalesce_s:
                        break
                    # Clients caught up are written now; those with a backlog keep their frames for the
                    # round's write. Reads run between cycles, as between rounds (what they publish goes in
                    # the next cycle).
                    self._flush_caught_up()
                    await asyncio.sleep(0)
                self.rounds += 1
                self._flush_staged()
                if self.fanouts:  # written: the watches complete now end
                    end_fanouts(self.fanouts, time.monotonic())
                # What the round committed is written now: a broker may drop it, and held publishers retry.
                self.space()
                await asyncio.sleep(0)

    def _flush_staged(self) -> None:
        """The round's end: write each connection's staged frames."""
        staged, self.staged = self.staged, {}
        self.caught_up.clear()
        for conn in staged:
            self._flush(conn)

    def _flush_caught_up(self) -> None:
        """Between a round's cycles: write the staged frames of clients with nothing more to come next cycle
        (caught up: a round never delays them); those with a backlog keep theirs for the round's end."""
        caught_up, self.caught_up = self.caught_up, {}
        for conn in caught_up:
            self._flush(conn)

    def _flush(self, conn: Connection) -> None:
        """Write one connection's staged frames. One left above its high-water mark is not ready (its batches
        were reported done when staged) until its transport drains."""
        client_id = conn.identity.client_id
        try:
            if conn.flush():
                return
        except Exception:  # a transport that broke mid-write: drop it, never the others
            log.exception("delivery to %s failed", client_id)
            self.kick(client_id, close_codes.INTERNAL_ERROR, "internal error", "error")
            return
        if client_id in self.conns and conn.blocked_since is not None:
            self.engine.mark_idle(client_id)

    def _deliver(self, batches: list[Batch], crowds: list[Crowd]) -> None:
        """The cycle's crowds (gathered by the engine: sent first, no per-client work here), then its batches.
        A caught-up batch whose frame may go straight to its socket (`direct_fd`) joins the clients handed
        out with that frame and wire variant, sent with them."""
        frames: dict[bytes | tuple[bytes, ...], bytes] = {}
        # the clients handed out, by frame and then by wire variant (the window its compressed form was made
        # with, another protocol's form): handed to the sender in slices (`_write_crowd`), sent while the rest
        # are handed out. Two plain lookups per client: a (frame, variant) key would be a tuple made and
        # hashed per client.
        handed: dict[bytes, dict[int, HandedOut]] = {}
        # the crowd the previous client joined: the next one usually joins it too (no lookups)
        crowd_frame: bytes | None = None
        crowd_variant = 0
        by_variant: dict[int, HandedOut] = {}
        slot = 0  # its key in by_variant
        crowd: HandedOut = ([], [], [])
        fds, group, client_ids = crowd
        variant_min_bytes = self.variant_min_bytes
        sent = self._sent
        conns = self.conns
        writable_sockets = self.writable_sockets
        staged, caught_up = self.staged, self.caught_up
        # an enum member's lookup costs ~0.1 µs, several per delivery: looked up once per cycle
        done_, staged_, caught_up_ = Delivered.DONE, Delivered.STAGED, Delivered.CAUGHT_UP
        delivery_log = self.delivery_log
        observe_size = self.entries_per_batch.observe
        singles = 0
        done = []
        try:
            for gathered in crowds:  # first: the sender sends them while the batches are handed out
                self._write_gathered(gathered, frames)
                singles += len(gathered.tokens)
                self.gathered_writes += len(gathered.tokens)
            for batch in batches:
                client_id = batch.client_id
                conn = conns.get(client_id)
                if conn is None:
                    continue
                # Clients of one topic usually get identical batches: frame them once. The entries are the
                # key (a bytes object caches its hash, and a lookup compares identity first; one entry, the
                # common case, is its own key, never equal to a tuple key).
                entries = batch.entries
                if len(entries) == 1:
                    key: bytes | tuple[bytes, ...] = entries[0]
                    singles += 1
                else:
                    key = tuple(entries)
                    observe_size(len(entries))
                frame = frames.get(key)
                if frame is None:
                    frame = frames[key] = batch.frame()
                try:
                    writable = writable_sockets.get(client_id)
                    if writable is not None and not batch.more and (fd := writable.direct_fd(batch, frame)) >= 0:
                        # sent directly: done once the sender is through, below
                        variant = writable.wire_variant
                        if frame is not crowd_frame or variant != crowd_variant:  # else the previous client's
                            crowd_frame, crowd_variant = frame, variant
                            if 0 < variant and len(frame) < variant_min_bytes:  # sent plain whatever the window
                                variant = 0
                            by_variant = handed.setdefault(frame, {})
                            crowd = by_variant.get(variant) or by_variant.setdefault(variant, ([], [], []))
                            slot = variant
                            fds, group, client_ids = crowd
                        fds.append(fd)
                        group.append(writable)
                        client_ids.append(client_id)
                        if len(fds) == CROWD_SLICE:  # the first ones need not wait for the whole cycle's hand-off
                            self._write_crowd(frame, crowd)
                            del by_variant[slot]
                            crowd_frame = None
                        if delivery_log is not None:
                            delivery_log.delivered(batch, conn, False)
                        continue
                    outcome = conn.deliver(batch, frame)
                except Exception:  # a transport that broke mid-write: drop it, never the others
                    log.exception("delivery to %s failed", client_id)
                    self.kick(client_id, close_codes.INTERNAL_ERROR, "internal error", "error")
                    continue
                if outcome is done_:
                    done.append(client_id)
                elif outcome is staged_ or outcome is caught_up_:  # done, written with the round
                    staged[conn] = None
                    if outcome is caught_up_:
                        caught_up[conn] = None
                    done.append(client_id)
                if delivery_log is not None:
                    delivery_log.delivered(batch, conn, outcome is staged_ or outcome is caught_up_)
            for frame, by_variant in handed.items():
                for crowd in by_variant.values():
                    self._write_crowd(frame, crowd)
        finally:
            if sent.count:
                done.extend(self._crowds_sent())
        self.entries_per_batch.observe_many(1, singles)
        if done:
            self.engine.writes_done(done)

    def _write_crowd(self, frame: bytes, crowd: HandedOut) -> None:
        """Hand one frame for many sockets to the sender (the compiled one sends it on its own thread while
        the scheduler goes on; the twin at once)."""
        fds, group, client_ids = crowd
        self._submit(fds, group[0].wire(frame, len(fds)), group, 0, None)
        self._sent.client_ids += client_ids

    def _write_gathered(self, crowd: Crowd, frames: dict[bytes | tuple[bytes, ...], bytes]) -> None:
        """A crowd the engine gathered: its frame to all its sockets, in slices (each sender's job), each
        socket passed over whose transport is closing or holds bytes (its rest then goes like a shortfall)."""
        entry = crowd.entry
        frame = frames.get(entry)
        if frame is None:
            frame = frames[entry] = frame_batch((entry,))
        tokens, handles, sinks = crowd.tokens, crowd.handles, crowd.sinks
        count = len(tokens)
        data = sinks[0].owner.gathered_wire(entry, frame, sinks)
        if not data:
            return
        if count <= CROWD_SLICE:
            self._submit(tokens, data, sinks, 0, handles)
            return
        for start in range(0, count, CROWD_SLICE):
            end = start + CROWD_SLICE
            self._submit(tokens[start:end], data, sinks, start, handles[start:end])

    def _submit(
        self, fds: list[int], data: bytes, members: list[DirectWritable] | list[Sink], offset: int, transports: list[Any] | None
    ) -> None:
        sent = self._sent
        sent.starts.append(sent.count)
        sent.wires.append(data)
        sent.members.append(members)
        sent.offsets.append(offset)
        sent.count += len(fds)
        self.staged_writes += len(fds)
        self.direct_writes += len(fds)
        if transports is None:
            self.sender.submit(fds, data)
        else:
            self.sender.submit(fds, data, transports)

    def _crowds_sent(self) -> list[Hashable]:
        """Wait for the sender; the transports take what a socket did not. Returns the clients ready again
        (one whose rest left its transport above the high-water mark is not)."""
        sent, self._sent = self._sent, CrowdsSent()
        short = self.sender.wait()
        if not short:
            return sent.client_ids
        self.direct_shortfalls += len(short)
        unready: set[Hashable] = set()
        for index, taken in short:
            part = bisect.bisect_right(sent.starts, index) - 1
            member = sent.members[part][sent.offsets[part] + index - sent.starts[part]]
            gathered = isinstance(member, Sink)
            conn: Any = member.owner if isinstance(member, Sink) else member
            client_id = conn.identity.client_id
            try:
                ok = conn.write_rest(sent.wires[part], taken)
            except Exception:  # a transport that broke mid-write: drop it, never the others
                ok = False
                log.exception("delivery to %s failed", client_id)
                self.kick(client_id, close_codes.INTERNAL_ERROR, "internal error", "error")
            if ok:
                continue
            if not gathered:
                unready.add(client_id)
            elif client_id in self.conns and conn.blocked_since is not None:  # left ready by the engine
                self.engine.mark_idle(client_id)
        return [client_id for client_id in sent.client_ids if client_id not in unready] if unready else sent.client_ids

    # -- metrics -------------------------------------------------------------------------------------------

    def tenants(self) -> dict[str, Any]:
        """`GET /api/tenants`: this node's tenants and what each was served (gateway/tenancy.py)."""
        return self.tenancy.describe(self.engine.fair)

    def collect(self) -> Iterator[Metric]:
        """The scheduler's families for /metrics."""
        yield from self.tenancy.collect(self.engine.fair)
        yield CounterMetricFamily(
            "fanout_rounds", "scheduler rounds (cycles written together, gateway/transports/staging.py)", value=self.rounds
        )
        yield CounterMetricFamily(
            "fanout_staged_writes", "write calls of staged batches (WebSocket, SSE)", value=self.staged_writes
        )
        yield CounterMetricFamily(
            "fanout_direct_writes",
            "frames written to a caught-up client's socket together with other clients' (gateway/fanwrite.py)",
            value=self.direct_writes,
        )
        yield CounterMetricFamily(
            "fanout_direct_write_shortfalls",
            "direct writes a socket did not take whole (the rest went through its transport)",
            value=self.direct_shortfalls,
        )
        yield CounterMetricFamily(
            "fanout_gathered_writes",
            "of the direct writes, those to clients the engine gathered into crowds (no per-client work in Python)",
            value=self.gathered_writes,
        )
        yield GaugeMetricFamily("fanout_write_blocked_clients", "clients whose write has not drained", value=len(self.blocked))
        yield self.cycle_seconds.family("fanout_cycle_duration_seconds", "run_cycle plus hand-off time")
        yield self.entries_per_batch.family("fanout_entries_per_batch", "entries per batch written")


class Membership:
    """The scheduler's verbs on who subscribes to what, and on the topics they meet: the client registry, the
    topic catalog and the broker (this is its `BrokerEvents`) change the engine through these only, each
    with the wake-up it needs."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.engine = scheduler.engine
        #: read the engine freely through this (gateway/topic_view.py)
        self.topics: TopicView = scheduler.engine
        self.conns = scheduler.conns
        #: presence members of topics with `presence` (gateway/presence.py); the broker gives it its store
        self.presence = Presence(
            self.topics,
            self.engine.send_direct,
            self._direct_overflowed,
            scheduler.config.limits.presence_max_members,
            scheduler._presence_noted,
        )

    def attach_broker(self, presence: PresenceStore, commits: Commits | None) -> None:
        """The broker, once, as it is made: where presence members are kept, and where private queues'
        commits go (None: nowhere, the queues live here)."""
        self.presence.store = presence
        self.engine.report_commits = commits is not None
        self.scheduler.report_commits = commits

    # -- clients (the client registry) ---------------------------------------------------------------------

    def connect(self, conn: Connection, *, ready: bool) -> None:
        identity = conn.identity
        self.engine.connect(identity.client_id, ready=ready, info=identity, owner=identity.owner, tenant=identity.tenant)
        if isinstance(conn, DirectWritable):
            self.scheduler.writable_sockets[identity.client_id] = conn
            if conn.crowd_sink is not None:
                self.engine.attach_sink(identity.client_id, conn.crowd_sink)

    def disconnect(self, client_id: Hashable) -> tuple[list[str], Hashable]:
        """The engine forgets the client. Returns the topics it subscribed to and its owner (the caller
        leaves each: presence, the broker's holders)."""
        client = self.engine.client(client_id)
        names, owner = list(client.subs), client.owner
        self.scheduler.writable_sockets.pop(client_id, None)
        self.engine.disconnect(client_id)
        return names, owner

    def set_owner(self, client_id: Hashable, owner: Hashable) -> None:
        """Whose private queues the client reads (raises `CoreUsageError` while it holds one of its own)."""
        self.engine.set_owner(client_id, owner)

    def set_tenant(self, client_id: Hashable, tenant: str, user: Hashable) -> None:
        """Whose share the client's service counts to from now on (its first token, with fairness on)."""
        self.engine.set_tenant(client_id, tenant, user)

    # -- subscriptions ---------------------------------------------------------------------------------------

    def unsubscribe(self, client_id: str, topic: str, *, request_id: Any = None) -> Hashable:
        """The engine's unsubscribe (raises its errors), then the client leaves the topic's presence. Returns
        the client's owner (whose holder of the topic the broker lets go)."""
        owner = self.engine.client(client_id).owner
        self.engine.unsubscribe(client_id, topic, request_id=request_id)
        self.presence.left(client_id, topic)
        self.scheduler.wake()
        return owner

    def ack(self, client_id: str, topic: str, seq: int) -> int:
        """Commit an acknowledged private subscription's entries up to `seq`: the first seq still queued.
        Publishers waiting for room retry; with a broker, the commit goes to Redis."""
        head = self.engine.ack(client_id, topic, seq)
        self.scheduler.space()
        return head

    def apply(self, topic: str, data: Any, *, seq: int | None = None, owner: Hashable = None) -> Published:
        if self.scheduler.traced_applies and topic in self.scheduler.traced_applies:
            result = self._apply_traced(topic, data, seq, owner)
        else:
            result = self.engine.publish(topic, data, seq=seq, owner=owner, now=time.monotonic())
        if self.scheduler.delivery_log is not None:
            self.scheduler.delivery_log.published(topic, result.seq)
        self.scheduler.wake()
        return result

    def _apply_traced(self, topic: str, data: Any, seq: int | None, owner: Hashable) -> Published:
        """A sampled admin publish's apply: its `engine.apply` span, and its fan-out watched from now."""
        expected = self.scheduler.traced_applies.pop(topic)
        with expected.span(topic) as span:
            result = self.engine.publish(topic, data, seq=seq, owner=owner, now=time.monotonic())
            span.set_attribute("fanout.seq", result.seq)
            fanout = expected.watch(span, topic, result.seq, self._reached_by(topic, owner))
        previous = self.scheduler.fanouts.pop(topic, None)
        if previous is not None:  # a newer traced message of the topic: the watch follows that one
            previous.end(False)
        if fanout.expected:
            self.scheduler.fanouts[topic] = fanout
        else:
            fanout.end(True)
        return result

    def _reached_by(self, topic: str, owner: Hashable) -> int:
        """Subscribers a message published now reaches: a shared topic's, or a private queue's one holder."""
        handle = self.engine.topic(topic)
        return len(handle.subs) if handle.shared else int(handle.holder(owner) is not None)

    def skip(self, topic: str, upto: int) -> None:
        self.engine.skip(topic, upto, time.monotonic())
        self.scheduler.wake()

    def deleted(self, topic: str) -> int:
        count = self.engine.delete_topic(topic)
        self.presence.topic_gone(topic)
        self.scheduler.wake()
        return count

    def evicted(self, topic: str, owner: Hashable, reason: str) -> bool:
        if not self.engine.evict(topic, owner, reason):
            return False
        self.scheduler.space()
        self.scheduler.wake()
        return True

    def subscribe(
        self,
        client_id: str,
        topic: str,
        *,
        since: tuple[str, int] | None = None,
        request_id: Any = None,
        queue_start: tuple[str, int] | None = None,
        ack: bool = False,
        delta: bool | None = None,
    ) -> None:
        """The engine's subscribe (raises its errors), then the client joins the topic's presence: the one
        place a shared-topic subscription is made."""
        self.engine.subscribe(client_id, topic, since=since, request_id=request_id, queue_start=queue_start, ack=ack, delta=delta)
        self.presence.joined(client_id, topic)
        self.scheduler.wake()

    def joined(
        self,
        client_id: str,
        topic: str,
        *,
        since: tuple[str, int] | None = None,
        request_id: Any = None,
        queue_start: tuple[str, int] | None = None,
        delta: bool | None = None,
    ) -> None:
        if client_id not in self.conns:
            return
        try:
            self.subscribe(client_id, topic, since=since, request_id=request_id, queue_start=queue_start, delta=delta)
        except RequestError as err:  # its error entry wakes the scheduler, as the subscribe does
            self.send_error(client_id, err, request_id)

    def presence_changed(self, topic: str, kind: str, member: Member) -> None:
        self.presence.announce(topic, kind, member)

    def refused(self, client_id: str, error: RequestError, request_id: Any = None) -> None:
        if client_id in self.conns:
            self.send_error(client_id, error, request_id)

    def connected(self, client_id: str) -> bool:
        return client_id in self.conns

    def client_count(self) -> int:
        return len(self.conns)

    def space(self) -> None:
        self.scheduler.space()

    def space_freed(self, topic: str, owner: Hashable) -> asyncio.Future[None]:
        return self.scheduler.space_freed(topic, owner)

    def wake(self) -> None:
        self.scheduler.wake()

    # -- topics ------------------------------------------------------------------------------------------------

    def resolve(self, topic: str) -> None:
        """The local topic, created on first use by its rule (raises the rule's errors: unknown topic)."""
        self.engine.resolve(topic)

    def create_topic(
        self, name: str, config: TopicConfig | None = None, *, epoch: str | None = None, start: int = 0
    ) -> dict[str, Any]:
        """A new local topic (raises `TopicExists`, `TooManyTopics`); `epoch` and `start`: a broker's stream
        (docs/cluster.md §3). Returns its INFO."""
        info: dict[str, Any] = self.engine.create_topic(name, config, epoch=epoch, start=start).info()
        self.scheduler.wake()
        return info

    def restart_topic(self, name: str, epoch: str, start: int) -> None:
        """A broker's stream changed epoch (docs/cluster.md §4): subscribers read on from `start`."""
        self.engine.restart_topic(name, epoch, start)
        self.scheduler.wake()

    # -- direct entries ------------------------------------------------------------------------------------

    def send_direct(self, client_id: Hashable, entry: bytes) -> None:
        try:
            self.engine.send_direct(client_id, entry)
        except RequestError:  # DirectQueueFull: the client does not read its replies
            self._direct_overflowed(client_id)
            return
        self.scheduler.wake()

    def direct_room(self, client_id: Hashable) -> int:
        """Bytes `send_direct` would queue for the client now without overflowing (core/engine.py's bounds):
        an answer larger than this is never built."""
        engine = self.engine
        config, client = engine.config, engine.client(client_id)
        if client.queued() >= config.direct_queue_max:
            return 0
        held = client.direct_bytes
        return max(
            0,
            min(
                config.direct_queue_max_bytes - held,
                max(config.direct_total_max_bytes - engine.direct_bytes, client.budget - held),
            ),
        )

    def _direct_overflowed(self, client_id: Hashable) -> None:
        self.scheduler.kick(client_id, close_codes.DIRECT_OVERFLOW, "direct queue overflow", "direct_queue_full")

    def send_error(self, client_id: Hashable, exc: RequestError, request_id: Any = None) -> None:
        self.send_direct(client_id, encode_error(exc.code, exc.message, request_id))

"""A client worker process: many subscribers on one uvloop event loop, driven by the runner over a pipe.

Conversation with the runner (tuples over a ``multiprocessing`` pipe)::

    runner -> ("connect",)                                 the topics exist: connect and subscribe
    worker -> ("ready", n_ready, n_failed, first_error)   all clients connected and subscribed (or timed out)
    runner -> ("go", go_ns)                                publishing starts at go_ns: stall timers count from it
    runner -> ("stop",)                                    close everything, write the log
    worker -> ("done", path)                               the pickled recorder state (see recorder.dump)

Live totals go to a shared int64 array at ``COUNTERS`` offsets, for the progress bar and the drain test.

A reconnect storm (``storm_at``): at that many seconds after the go time every WebSocket client drops its
connection (an abort: what the server sees when a network path dies) and comes back at a random moment within
``storm_spread`` seconds, resubscribing each topic with ``since`` = its epoch and the next seq it needs; its
state (``Subscriber.state``) says when it tried, when it was open, when every topic was subscribed again.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import orjson

from fanout_client.fossil import DeltaBase, DeltaError
from loadtest.aio import run_loop, within
from loadtest.book import intact
from loadtest.httpclient import HttpConnection, open_connection
from loadtest.procstat import raise_nofile_limit
from loadtest.recorder import DEFAULT_MAX_ROWS, Recorder
from loadtest.scenarios import ClientPlan, source_addr
from loadtest.target import Target
from loadtest.wsclient import WsClient, connect

#: ``--payload book`` runs of at most this many clients check every book they get (`Worker.checks_books`)
BOOK_CHECK_CLIENTS = 1000
COUNTERS = ("ready", "closed", "msgs_light", "msgs_stalled", "lost_light", "lost_stalled", "frames", "errors", "wire_bytes")
#: handshakes in flight per process: a burst of thousands overflows the server's accept backlog
CONNECT_CONCURRENCY = 64
CONNECT_ATTEMPTS = 3
#: how often the shared counters are refreshed
COUNTER_PERIOD = 0.1
#: ... when the publisher paces itself on the delivery counts (closed-loop max rate)
FAST_COUNTER_PERIOD = 0.002
#: a storm's reconnect that fails waits this long times its attempt number (at most STORM_BACKOFF_MAX), jittered
STORM_BACKOFF = 0.2
STORM_BACKOFF_MAX = 1.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    slot: int
    target: Target
    topics: tuple[str, ...]
    #: (global client index, plan); the index is the client's code in the delivery log
    clients: tuple[tuple[int, ClientPlan], ...]
    n_clients: int
    stall_at: float
    #: 0: stalled clients never resume
    stall_for: float
    out_path: str
    connect_timeout: float = 20.0
    max_rows: int = DEFAULT_MAX_ROWS
    #: seconds between refreshes of the shared counters (short when the publisher paces on them)
    counter_period: float = COUNTER_PERIOD
    #: client i connects from loopback address ``source_addr(i % source_addrs)``; 0: the kernel's choice
    source_addrs: int = 0
    #: reconnect storm: seconds after the go time (None: no storm), and the spread of the comebacks
    storm_at: float | None = None
    storm_spread: float = 5.0
    seed: int = 1
    #: WebSocket clients offer permessage-deflate ("deflate"), subscribe with fossil deltas ("fossil"), and
    #: check each order book they get against its checksum (``--payload book``)
    compression: str = "off"
    delta: str = "off"
    books: bool = False
    #: "centrifugo": WebSocket clients speak Centrifugo's client protocol (loadtest/centrifugo_subscriber.py)
    protocol: str = "fanout"


class Subscriber:
    """One client's state, whatever its transport."""

    def __init__(self, index: int, plan: ClientPlan, worker: Worker) -> None:
        self.index = index
        self.plan = plan
        self.worker = worker
        self.recorder = worker.recorder
        self.batch = 0
        self.subscribed = 0
        self.ready = asyncio.get_running_loop().create_future()
        self.connected_ns = 0
        self.closed_ns = 0
        self.closed_reason = ""
        self.error = ""
        k = worker.spec.source_addrs
        #: the local address this client connects from (None: the kernel's choice)
        self.source = source_addr(index % k) if k else None
        #: reconnect storm (time.time_ns() values, 0 until they happen): the storm, this client's first
        #: reconnect attempt, its open connection, its resubscribe sent, every topic subscribed again
        self.storm_ns = self.retry_ns = self.open_ns = self.resub_ns = self.back_ns = 0
        self.attempts = 0
        self.storm_error = ""

    def _got(self, entries: Any, batch_id: int, now: int) -> None:
        self.subscribed += self.recorder.entries(self.index, entries, batch_id, now)
        if self.subscribed >= len(self.plan.topics) and not self.ready.done():
            self.ready.set_result(None)
        if self.resub_ns and not self.back_ns and self.subscribed >= 2 * len(self.plan.topics):
            self.back_ns = now

    def _mark_closed(self, reason: str) -> None:
        if not self.closed_ns and not self.worker.stopping:
            self.closed_ns = time.time_ns()
            self.closed_reason = reason
            self.worker.closed += 1

    def state(self) -> dict[str, Any]:
        out = {
            "name": self.plan.name,
            "ready": self.ready.done() and not self.ready.cancelled(),
            "connected_ns": self.connected_ns,
            "closed_ns": self.closed_ns,
            "closed_reason": self.closed_reason,
            "error": self.error,
        }
        if self.storm_ns:
            out["storm"] = {
                "storm_ns": self.storm_ns,
                "retry_ns": self.retry_ns,
                "open_ns": self.open_ns,
                "resub_ns": self.resub_ns,
                "back_ns": self.back_ns,
                "attempts": self.attempts,
                "error": self.storm_error,
            }
        return out


class _Detached:
    """The listener of a connection its client dropped: what still arrives on it is ignored."""

    def ws_open(self) -> None:
        pass

    def ws_messages(self, messages: list[bytes], now_ns: int) -> None:
        pass

    def ws_closed(self, reason: str) -> None:
        pass


DETACHED = _Detached()


class WsSubscriber(Subscriber):
    """A WebSocket client of the gateway (JSON array batches) or of nchan (one raw body per frame)."""

    ws: WsClient | None = None
    #: bytes read by the connections this client dropped (a storm)
    old_bytes = 0
    #: ``--delta fossil``: each topic's base (by topic name)
    bases: dict[str, DeltaBase] | None = None

    async def start(self) -> None:
        spec = self.worker.spec
        target = spec.target
        topics = [spec.topics[t] for t in self.plan.topics]
        if spec.delta == "fossil":
            self.bases = {name: DeltaBase() for name in topics}
        self.ws = await connect(
            target.host,
            target.http_port,
            target.ws_path(topics),
            self,
            timeout=spec.connect_timeout,
            source=self.source,
            compression=spec.compression == "deflate",
        )

    @property
    def bytes_received(self) -> int:
        return self.old_bytes + (self.ws.bytes_received if self.ws is not None else 0)

    def ws_open(self) -> None:
        self.connected_ns = self.connected_ns or time.time_ns()  # the first connection's (a storm's: open_ns)
        if self.worker.spec.target.kind == "nchan" and not self.ready.done():
            # nchan has no subscribe acknowledgement: the handshake is the subscription, and the
            # publisher's numbering of each topic starts at 0 once everyone is connected
            for t in self.plan.topics:
                self.recorder.starts[(self.index, t)] = 0
            self.ready.set_result(None)

    def ws_messages(self, messages: list[bytes], now_ns: int) -> None:
        loads = orjson.loads
        recorder = self.recorder
        if self.worker.spec.target.kind == "nchan":
            for body in messages:
                self.batch += 1
                if recorder.raw_frame(self.index, body, self.batch, now_ns):
                    continue
                try:
                    data = loads(body)
                except orjson.JSONDecodeError:
                    data = None
                recorder.raw_message(self.index, body, data, self.batch, now_ns)
            return
        checked = self.bases is not None or self.worker.checks_books
        for body in messages:
            self.batch += 1
            if not checked and recorder.msg_frame(self.index, body, self.batch, now_ns):
                continue
            try:
                entries = loads(body)
            except orjson.JSONDecodeError:
                self.recorder.errors["bad_json"] += 1
                continue
            if checked and type(entries) is list:
                self._rebuild(entries)
            self._got(entries, self.batch, now_ns)

    def _rebuild(self, entries: list[Any]) -> None:
        """Apply the deltas of a batch (``--delta fossil``) and check each order book (``--payload book``): a
        message that fails either is counted as an error (``delta_failed``, ``corrupt``) and not recorded."""
        bases, errors = self.bases, self.recorder.errors
        for i, e in enumerate(entries):
            if type(e) is not dict or e.get("type") != "msg":
                if bases is not None and type(e) is dict and e.get("type") in ("subscribed", "loss"):
                    base = bases.get(str(e.get("topic")))  # the gateway sends the next message whole
                    if base is not None:
                        base.reset()
                continue
            if bases is not None and "delta" in e:
                base = bases.get(str(e.get("topic")))
                try:
                    if base is None:
                        raise DeltaError("no base")
                    e["data"] = base.of_entry(e)
                except DeltaError:
                    errors["delta_failed"] += 1
                    entries[i] = {}
                    continue
            if not intact(e.get("data")):
                errors["corrupt"] += 1
                entries[i] = {}

    def ws_closed(self, reason: str) -> None:
        self._mark_closed(reason)

    def subscribe(self) -> None:
        if self.worker.spec.target.kind != "nchan" and self.ws is not None:  # gateway, bare
            commands: list[dict[str, Any]] = [{"op": "subscribe", "topic": self.worker.spec.topics[t]} for t in self.plan.topics]
            if self.bases is not None:
                for command in commands:
                    command["delta"] = "fossil"
            self.ws.send_text(orjson.dumps(commands))

    def drop(self, storm_ns: int) -> None:
        """The storm: abort the connection (RST, nothing more read from it)."""
        ws, self.ws = self.ws, None
        self.storm_ns = storm_ns
        if ws is not None:
            self.old_bytes += ws.bytes_received
        if ws is not None and ws.transport is not None:
            ws.listener = DETACHED
            ws.transport.abort()

    async def come_back(self, since: dict[int, int]) -> None:
        """Reconnect (retrying with a growing pause) and resubscribe every topic from ``since[topic]`` seq of
        the epoch its first ``subscribed`` named."""
        worker, spec = self.worker, self.worker.spec
        target = spec.target
        self.retry_ns = time.time_ns()
        while not worker.stopping:
            self.attempts += 1
            try:
                ws = await connect(
                    target.host, target.http_port, target.ws_path([]), self, timeout=spec.connect_timeout, source=self.source
                )
            except Exception as exc:
                self.storm_error = self.storm_error or f"{type(exc).__name__}: {exc}"[:300]
                pause = min(STORM_BACKOFF_MAX, STORM_BACKOFF * self.attempts)
                await asyncio.sleep(pause * random.uniform(0.5, 1.0))
                continue
            if worker.stopping:
                ws.close()
                return
            self.ws = ws
            self.open_ns = time.time_ns()
            commands = []
            for t in self.plan.topics:
                seq = since[t]
                self.recorder.resuming[(self.index, t)] = seq
                commands.append(
                    {
                        "op": "subscribe",
                        "topic": spec.topics[t],
                        "since": {"epoch": self.recorder.epochs.get((self.index, t), ""), "seq": seq},
                    }
                )
            self.resub_ns = time.time_ns()
            ws.send_text(orjson.dumps(commands))
            return

    def pause(self) -> None:
        if self.ws is not None:
            self.ws.pause()

    def resume(self) -> None:
        if self.ws is not None:
            self.ws.resume()

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()


class LpSubscriber(Subscriber):
    """A long-poll client of the gateway: one keep-alive connection, one GET in flight at a time."""

    conn: HttpConnection | None = None
    task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        target = self.worker.spec.target
        timeout = self.worker.spec.connect_timeout
        self.conn = await open_connection(target.host, target.http_port, timeout, self.source)
        try:
            response = await self.conn.request("POST", "/lp", b"", timeout=timeout)
            if not 200 <= response.status < 300:
                raise ConnectionError(f"POST /lp: {response.status} {response.body[:200]!r}")
            self.sid = str(orjson.loads(response.body)["session"])
        except BaseException:
            self.conn.close()  # a retry opens a new one
            raise
        self.connected_ns = time.time_ns()
        self.reading = asyncio.Event()
        self.reading.set()

    def subscribe(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self.conn is not None
        commands = [{"op": "subscribe", "topic": self.worker.spec.topics[t]} for t in self.plan.topics]
        headers = {"Content-Type": "application/json"}
        try:
            response = await self.conn.request("POST", f"/lp/{self.sid}", orjson.dumps(commands), headers)
            if response.status >= 300:
                raise ConnectionError(f"POST /lp/{self.sid}: {response.status} {response.body[:200]!r}")
            ack: Any = None
            while True:
                await self.reading.wait()
                target = f"/lp/{self.sid}" if ack is None else f"/lp/{self.sid}?ack={ack}"
                response = await self.conn.request("GET", target)
                if response.status != 200:
                    raise ConnectionError(f"GET {target}: {response.status} {response.body[:200]!r}")
                body = orjson.loads(response.body)
                batch = body.get("batch")
                entries = body.get("entries") or []
                if batch is not None:
                    ack = batch
                if entries:
                    self.batch += 1
                    self._got(entries, batch if isinstance(batch, int) else self.batch, response.recv_ns)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the server ended the session or the connection: the client is gone
            self.error = f"{type(exc).__name__}: {exc}"[:300]
            self._mark_closed(self.error)

    def pause(self) -> None:
        self.reading.clear()

    def resume(self) -> None:
        self.reading.set()

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.conn is not None:
            self.conn.close()


class Worker:
    def __init__(self, spec: WorkerSpec, conn: Connection, counters: Any) -> None:
        self.spec = spec
        self.conn = conn
        self.counters = counters
        self.base = spec.slot * len(COUNTERS)
        stalled = [False] * spec.n_clients
        for index, plan in spec.clients:
            stalled[index] = plan.role == "stalled"
        self.recorder = Recorder({t: i for i, t in enumerate(spec.topics)}, stalled, spec.max_rows)
        #: every order book is decoded and checked against its checksum (~10 µs a delivery): in runs of up to
        #: BOOK_CHECK_CLIENTS clients, and whenever deltas are rebuilt; a crowd reads them as any message
        self.checks_books = spec.books and (spec.delta != "off" or spec.n_clients <= BOOK_CHECK_CLIENTS)
        self.closed = 0
        #: set when the runner said stop: the closes that follow are ours, not the server's
        self.stopping = False
        self.subscribers: list[WsSubscriber | LpSubscriber] = []
        self.inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        #: the storm's reconnects under way
        self.comebacks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), lambda: self.inbox.put_nowait(self.conn.recv()))
        for index, plan in self.spec.clients:
            self.subscribers.append(self._subscriber_class(plan)(index, plan, self))
        publisher = loop.create_task(self._publish_counters())
        if (await self.inbox.get())[0] != "connect":
            return
        limit = asyncio.Semaphore(CONNECT_CONCURRENCY)
        await asyncio.gather(*(self._open(s, limit) for s in self.subscribers))
        failed = [s for s in self.subscribers if not (s.ready.done() and not s.ready.cancelled())]
        first_error = next((s.error for s in failed if s.error), "")
        self.conn.send(("ready", len(self.subscribers) - len(failed), len(failed), first_error))

        message = await self.inbox.get()
        if message[0] == "go":
            self._schedule_stall(message[1])
            self._schedule_storm(message[1])
            message = await self.inbox.get()
        self.stopping = True
        for task in self.comebacks:
            task.cancel()
        for s in self.subscribers:
            s.close()
        await asyncio.sleep(0.05)  # let the close frames go out
        publisher.cancel()
        self._copy_counters()
        loop.remove_reader(self.conn.fileno())
        self.recorder.dump(self.spec.out_path, {s.index: s.state() for s in self.subscribers})
        self.conn.send(("done", self.spec.out_path))

    def _subscriber_class(self, plan: ClientPlan) -> type[WsSubscriber] | type[LpSubscriber]:
        if plan.transport == "longpoll":
            return LpSubscriber
        if self.spec.protocol == "centrifugo":
            from loadtest.centrifugo_subscriber import CentrifugoSubscriber  # a subclass of this module's

            return CentrifugoSubscriber
        return WsSubscriber

    async def _open(self, s: WsSubscriber | LpSubscriber, limit: asyncio.Semaphore) -> None:
        deadline = time.monotonic() + self.spec.connect_timeout
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                async with limit:
                    await s.start()
                break
            except Exception as exc:
                s.error = f"{type(exc).__name__}: {exc}"[:300]
                if attempt + 1 == CONNECT_ATTEMPTS or time.monotonic() > deadline:
                    return
                await asyncio.sleep(0.2 * (attempt + 1))
        s.error = ""
        s.subscribe()
        try:
            await within(asyncio.shield(s.ready), max(0.1, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            s.error = f"not subscribed after {self.spec.connect_timeout} s"

    def _schedule_stall(self, go_ns: int) -> None:
        stalled = [s for s in self.subscribers if s.plan.role == "stalled"]
        if not stalled:
            return
        loop = asyncio.get_running_loop()
        start = loop.time() + (go_ns - time.time_ns()) / 1e9 + self.spec.stall_at
        loop.call_at(start, lambda: [s.pause() for s in stalled])
        if self.spec.stall_for > 0:
            loop.call_at(start + self.spec.stall_for, lambda: [s.resume() for s in stalled])

    def _schedule_storm(self, go_ns: int) -> None:
        if self.spec.storm_at is None:
            return
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + (go_ns - time.time_ns()) / 1e9 + self.spec.storm_at, self._storm)

    def _storm(self) -> None:
        """Every WebSocket client still connected drops its connection now and comes back at a random moment
        within the spread (the same moments for the same seed), from the next seq it needs."""
        if self.stopping:
            return
        loop = asyncio.get_running_loop()
        storm_ns = time.time_ns()
        stormed = [
            s for s in self.subscribers if isinstance(s, WsSubscriber) and s.ws is not None and not s.closed_ns and s.ready.done()
        ]
        for s in stormed:
            s.drop(storm_ns)
        since = self.recorder.next_seqs({s.index for s in stormed})
        for s in stormed:
            delay = random.Random(self.spec.seed * 1_000_003 + s.index).uniform(0, self.spec.storm_spread)
            loop.call_later(delay, self._come_back, s, {t: since.get((s.index, t), 0) for t in s.plan.topics})

    def _come_back(self, s: WsSubscriber, since: dict[int, int]) -> None:
        if self.stopping:
            return
        task = asyncio.get_running_loop().create_task(s.come_back(since))
        self.comebacks.add(task)
        task.add_done_callback(self.comebacks.discard)

    def _copy_counters(self, full: bool = True) -> None:
        r = self.recorder
        counters, base = self.counters, self.base
        if full:
            values = (
                sum(1 for s in self.subscribers if s.ready.done() and not s.ready.cancelled()),
                self.closed,
                r.msgs[0],
                r.msgs[1],
                r.lost[0],
                r.lost[1],
                r.frames,
                sum(r.errors.values()),
                sum(s.bytes_received for s in self.subscribers if isinstance(s, WsSubscriber)),
            )
            for i, v in enumerate(values):
                counters[base + i] = v
            return
        counters[base + 2], counters[base + 3], counters[base + 4], counters[base + 5] = (
            r.msgs[0],
            r.msgs[1],
            r.lost[0],
            r.lost[1],
        )

    async def _publish_counters(self) -> None:
        # the delivery counts every period; the rest (O(clients) to count) about every 0.1 s
        every = max(1, round(COUNTER_PERIOD / self.spec.counter_period))
        tick = 0
        while True:
            self._copy_counters(tick % every == 0)
            tick += 1
            await asyncio.sleep(self.spec.counter_period)


def main(spec: WorkerSpec, counters: Any, conn: Connection) -> None:
    """Process entry point (multiprocessing target)."""
    raise_nofile_limit()
    run_loop(Worker(spec, conn, counters).run())

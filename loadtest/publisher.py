"""The publisher process: paced messages into the gateway's TCP ingest, its admin API, or nchan's HTTP
publisher location.

Every message's data is ``{"ts": time.time_ns() when written, "t": topic, "n": k, "pad": "..."}``: ``n``
counts the topic's messages from 0 (``-1`` is the priming message that creates each topic before anyone
subscribes), so a target without sequence numbers (nchan) still shows gaps.

Conversation with the runner::

    publisher -> ("primed", error or "")   every topic exists
    runner    -> ("go", go_ns)             publish from go_ns for the scenario's duration / message cap
    publisher -> ("published", result)     per-topic accepted counts, refusals, timing, CPU

At ``rate=max`` with a ``window`` the publisher runs closed loop: it reads the client processes' shared
delivery counters (received + announced lost, over the clients that read) and keeps at most ``window``
deliveries in flight, so it publishes as fast as the clients receive rather than as fast as the target
accepts bytes. Without a window (open loop) the gateway's ingest takes far more than it can fan out.
"""

from __future__ import annotations

import asyncio
import resource
import time
from array import array
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Awaitable, Callable

import msgspec

from fanout_client.ingest import AsyncIngestConnection, BadAnswer, ErrorAnswer, Synced
from loadtest.aio import run_loop
from loadtest.book import BOOK, Books
from loadtest.httpclient import HttpConnection, open_connection
from loadtest.procstat import raise_nofile_limit
from loadtest.target import Target

#: pacing tick at a fixed rate: the event loop wakes this often and writes what is due
TICK = 0.001
#: most messages written in one tick (also the chunk size in max mode): bounds a tick's work
MAX_BURST = 2000
#: keep-alive connections of an HTTP publisher; a POST waits for its answer, so this bounds its rate
HTTP_CONNECTIONS = 8
#: ingest writes pause above this many bytes buffered (the asyncio default high-water mark is 64 KiB)
WRITE_HIGH_WATER = 1 << 20
SYNC_TIMEOUT = 60.0
HTTP_TIMEOUT = 30.0
#: closed loop: how often a full window is checked again
WINDOW_POLL = 0.002
#: closed loop: a full window whose deliveries do not move for this long is forgiven (the target lost
#: messages without saying so, or a client is gone): counted in ``window_resets``
WINDOW_STUCK = 0.5


@dataclass(frozen=True, slots=True)
class PublisherSpec:
    target: Target
    topics: tuple[str, ...]
    #: msgs/s per topic; with ``fixed=False`` only their proportions matter
    rates: tuple[float, ...]
    fixed: bool
    duration: float
    messages: int
    payload: int | str
    #: "ingest" or "admin" for the gateway; ignored for nchan (always its publisher location)
    via: str = "ingest"
    #: closed loop (``fixed=False`` only): most deliveries in flight; 0 = open loop
    window: int = 0
    #: per topic: subscriptions of the clients that read (what one message on it owes)
    fanout: tuple[int, ...] = ()
    #: client processes whose counters are summed
    procs: int = 0


def topic_cycle(rates: tuple[float, ...], length: int = 10_000) -> list[int]:
    """A repeating order of topic indices in which each topic appears in proportion to its rate, spread
    evenly (topic i's k-th slot sits at (k + 0.5) / count_i of the cycle). Every topic with a rate > 0
    appears at least once."""
    total = sum(rates)
    slots: list[tuple[float, int]] = []
    for i, rate in enumerate(rates):
        if rate <= 0:
            continue
        count = max(1, round(rate / total * length))
        slots.extend(((k + 0.5) / count, i) for k in range(count))
    slots.sort()
    return [i for _pos, i in slots]


class Messages:
    """Builds message bodies: one counter per topic, the timestamp taken at build time."""

    def __init__(self, topics: tuple[str, ...], rates: tuple[float, ...], payload: int | str) -> None:
        self.names = [t.encode() for t in topics]
        self.cycle = topic_cycle(rates)
        self.position = 0
        self.next_n = [0] * len(topics)
        self.pad = b"x" * payload if isinstance(payload, int) else b""
        #: ``--payload book``: an order book per topic instead of the padding (loadtest/book.py)
        self.books = Books(len(topics)) if payload == BOOK else None

    def data(self, topic: int, n: int) -> bytes:
        if self.books is not None and n >= 0:
            return self.books.data(topic, self.names[topic], n, time.time_ns())
        return b'{"ts":%d,"t":"%s","n":%d,"pad":"%s"}' % (time.time_ns(), self.names[topic], n, self.pad)

    def take(self, count: int) -> list[int]:
        """The topics of the next ``count`` messages (and count them)."""
        cycle, pos, n = self.cycle, self.position, len(self.cycle)
        out = [cycle[(pos + k) % n] for k in range(count)]
        self.position = (pos + count) % n
        return out

    def number(self, topic: int) -> int:
        n = self.next_n[topic]
        self.next_n[topic] = n + 1
        return n


class Publisher:
    def __init__(self, spec: PublisherSpec, counter: Any = None, deliveries: Any = None) -> None:
        self.spec = spec
        #: shared int64 array: [0] = messages sent so far, for the progress bar
        self.counter = counter if counter is not None else [0]
        #: the client workers' shared counters (loadtest.worker.COUNTERS per process), for the closed loop
        self.deliveries = deliveries
        from loadtest.worker import COUNTERS

        n, msgs, lost = len(COUNTERS), COUNTERS.index("msgs_light"), COUNTERS.index("lost_light")
        self._delivery_slots = [i * n + k for i in range(spec.procs) for k in (msgs, lost)]
        self.window_resets = 0
        self.messages = Messages(spec.topics, spec.rates, spec.payload)
        self.sent = Counter[int]()
        self.accepted = Counter[int]()
        self.errors = Counter[str]()
        self.error_samples: list[str] = []
        self.ingest: AsyncIngestConnection | None = None
        #: ingest: the topic index of each line written (-1 for sync lines), to charge refusals to their topic
        self.line_topic = array("i")
        #: ingest: refusals per topic index
        self.refused = Counter[int]()
        self.pool: list[HttpConnection] = []
        kind = "nchan" if spec.target.kind == "nchan" else spec.via
        self.send: Callable[[list[int]], Awaitable[None]] = {
            "ingest": self._send_ingest,
            "admin": self._send_admin,
            "nchan": self._send_nchan,
        }[kind]
        self.kind = kind

    async def open(self) -> None:
        target = self.spec.target
        if self.kind == "ingest":
            if target.ingest_port is None:
                raise ValueError("publishing through the ingest needs its port (--ingest HOST:PORT)")
            loop = asyncio.get_running_loop()
            _t, self.ingest = await loop.create_connection(
                lambda: AsyncIngestConnection(self._ingest_error, WRITE_HIGH_WATER), target.host, target.ingest_port
            )
        else:
            self.pool = [await open_connection(target.host, target.http_port) for _ in range(HTTP_CONNECTIONS)]

    async def prime(self) -> None:
        """Publish one ``n = -1`` message per topic so that every topic exists before anyone subscribes."""
        topics = list(range(len(self.spec.topics)))
        if self.ingest is not None:
            self._write_lines(topics, [self._line(t, -1) for t in topics])
            await self._sync(0)
            self.refused.clear()
            self.errors.clear()
            return
        for chunk_start in range(0, len(topics), HTTP_CONNECTIONS):
            chunk = topics[chunk_start : chunk_start + HTTP_CONNECTIONS]
            await asyncio.gather(*(self._post(conn, t, [-1]) for conn, t in zip(self.pool, chunk)))
        self.accepted.clear()

    def _line(self, topic: int, n: int) -> bytes:
        # Formatted, not encoded with fanout_client.ingest.record_line: the data is JSON text already, and
        # encoding it again would cost the publisher more than the gateway's parse of it.
        return b'{"topic":"%s","data":%s}\n' % (self.messages.names[topic], self.messages.data(topic, n))

    def _write_lines(self, topics: list[int], lines: list[bytes]) -> None:
        assert self.ingest is not None
        self.ingest.write(b"".join(lines))
        self.line_topic.extend(topics)

    async def _sync(self, sync_id: int) -> Synced:
        assert self.ingest is not None
        self.line_topic.append(-1)
        return await self.ingest.sync(sync_id, SYNC_TIMEOUT)

    def _ingest_error(self, answer: ErrorAnswer | BadAnswer) -> None:
        if isinstance(answer, BadAnswer):
            self.errors["bad_reply"] += 1
            self._sample(f"bad reply ({answer.reason}): {answer.text[:200]!r}")
            return
        self.errors[answer.code] += 1
        self._sample(msgspec.json.encode(answer).decode()[:300])
        if 1 <= answer.line <= len(self.line_topic) and (topic := self.line_topic[answer.line - 1]) >= 0:
            self.refused[topic] += 1

    async def _send_ingest(self, topics: list[int]) -> None:
        assert self.ingest is not None
        number = self.messages.number
        self._write_lines(topics, [self._line(t, number(t)) for t in topics])
        await self.ingest.drain()

    async def _post(self, conn: HttpConnection, topic: int, numbers: list[int]) -> None:
        """One publish request: nchan takes one raw body, the admin API a batch of messages."""
        target = self.spec.target
        if target.kind == "nchan":
            body = self.messages.data(topic, numbers[0])
            headers = {"Content-Type": "application/json"}
        else:
            datas = [self.messages.data(topic, n) for n in numbers]
            body = b'{"data":%s}' % datas[0] if len(datas) == 1 else b'{"messages":[%s]}' % b",".join(datas)
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {target.admin_token}"}
        try:
            response = await conn.request(
                "POST", target.publish_path(self.spec.topics[topic]), body, headers, timeout=HTTP_TIMEOUT
            )
        except (ConnectionError, asyncio.TimeoutError) as exc:
            self.errors["connection"] += 1
            self._sample(f"{type(exc).__name__}: {exc}")
            return
        if 200 <= response.status < 300:
            self.accepted[topic] += len(numbers)
        else:
            self.errors[f"http_{response.status}"] += 1
            self._sample(f"{response.status} {response.body[:200]!r}")

    def _sample(self, text: str) -> None:
        if len(self.error_samples) < 10:
            self.error_samples.append(text)

    async def _send_admin(self, topics: list[int]) -> None:
        by_topic: dict[int, list[int]] = {}
        for t in topics:
            by_topic.setdefault(t, []).append(self.messages.number(t))
        await self._spread(list(by_topic.items()))

    async def _send_nchan(self, topics: list[int]) -> None:
        await self._spread([(t, [self.messages.number(t)]) for t in topics])

    async def _spread(self, requests: list[tuple[int, list[int]]]) -> None:
        """Run the requests over the connection pool, each connection one request at a time."""
        queue = iter(requests)

        async def drive(conn: HttpConnection) -> None:
            for topic, numbers in queue:
                if conn.closed:
                    self.errors["connection"] += len(numbers)
                    continue
                await self._post(conn, topic, numbers)

        await asyncio.gather(*(drive(conn) for conn in self.pool))

    async def run(self, go_ns: int) -> dict[str, Any]:
        """Publish from ``go_ns`` until the duration or the message cap is reached."""
        spec = self.spec
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, (go_ns - time.time_ns()) / 1e9))
        total_rate = sum(spec.rates)
        closed = not spec.fixed and spec.window > 0 and self.deliveries is not None
        fanout = spec.fanout
        if closed:
            mean_fanout = max(1e-9, sum(r * f for r, f in zip(spec.rates, fanout)) / max(total_rate, 1e-9))
            owed = self._delivered()  # deliveries owed so far, counted like the workers count them
            stuck_since = None
        start = loop.time()
        first_ns = time.time_ns()
        sent = 0
        while sent < spec.messages:
            elapsed = loop.time() - start
            if elapsed >= spec.duration:
                break
            due = MAX_BURST if not spec.fixed else min(MAX_BURST, int(total_rate * elapsed) + 1 - sent)
            if closed:
                delivered = self._delivered()
                room = spec.window - (owed - delivered)
                if room <= 0:
                    now = loop.time()
                    if stuck_since is None or delivered != stuck_since[1]:
                        stuck_since = (now, delivered)
                    elif now - stuck_since[0] >= WINDOW_STUCK:
                        owed, stuck_since = delivered, None
                        self.window_resets += 1
                    await asyncio.sleep(WINDOW_POLL)
                    continue
                stuck_since = None
                due = min(due, max(1, int(room / mean_fanout)))
            due = min(due, spec.messages - sent)
            if due > 0:
                topics = self.messages.take(due)
                self.sent.update(topics)
                if closed:
                    owed += sum(fanout[t] for t in topics)
                await self.send(topics)
                sent += due
                self.counter[0] = sent
            await asyncio.sleep(TICK if spec.fixed else 0)
        last_ns = time.time_ns()
        if self.ingest is not None:
            try:
                reply = await self._sync(1)
                if reply.refused:
                    self.errors["refused_total"] += reply.refused
            except (asyncio.TimeoutError, ConnectionError) as exc:
                self.errors["sync_failed"] += 1
                self._sample(f"final sync: {type(exc).__name__}: {exc}")
            accepted = {t: n - self.refused.get(t, 0) for t, n in self.sent.items()}
        else:
            accepted = dict(self.accepted)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        if self.window_resets:
            self.errors["window_resets"] += self.window_resets
        return {
            "sent": sent,
            "accepted": {spec.topics[t]: n for t, n in accepted.items()},
            "errors": dict(self.errors),
            "error_samples": self.error_samples[:10],
            "first_ns": first_ns,
            "last_ns": last_ns,
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "maxrss_kb": usage.ru_maxrss,
        }

    def _delivered(self) -> int:
        """Messages received or announced lost so far by the clients that read (all worker processes)."""
        d = self.deliveries
        return sum(d[i] for i in self._delivery_slots)

    def close(self) -> None:
        if self.ingest is not None:
            self.ingest.close()
        for conn in self.pool:
            conn.close()


async def _serve(spec: PublisherSpec, counter: Any, deliveries: Any, conn: Connection) -> None:
    publisher = Publisher(spec, counter, deliveries)
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: inbox.put_nowait(conn.recv()))
    try:
        await publisher.open()
        await publisher.prime()
    except Exception as exc:
        conn.send(("primed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("primed", ""))
    message = await inbox.get()
    if message[0] != "go":
        publisher.close()
        return
    try:
        result = await publisher.run(message[1])
    finally:
        publisher.close()
    loop.remove_reader(conn.fileno())
    conn.send(("published", result))


def main(spec: PublisherSpec, counter: Any, deliveries: Any, conn: Connection) -> None:
    """Process entry point (multiprocessing target). ``deliveries``: the client workers' shared counters."""
    raise_nofile_limit()
    run_loop(_serve(spec, counter, deliveries, conn))

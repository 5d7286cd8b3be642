"""TCP ingest for publishers and pipelines: newline-delimited JSON records (docs/protocol.md).

The I/O half: `IngestParser` (gateway/transports/ingest_parser.py) frames and parses the lines; this protocol feeds it
what it reads, applies its items in order, synchronously, and writes the answers. A `sync` record is
answered when every record before it on the connection was applied, with how many were accepted and
refused since the last sync. Back-pressure: a record for a full private queue stops the connection (reading
pauses, later lines stay in the parser, unparsed) until the queue frees space. A malformed line gets an
error line naming its line number; the connection and everything else go on.

With a broker (docs/cluster.md §3), the same holds for what waits for Redis: while the publishes waiting on
this node hold `broker.max_pending_bytes` (Redis stalls), a record is held, not refused, and the connection
is not read until they fall to half of it; while Redis is lost, a record gets its `broker_unavailable` line
and the connection is not read until Redis is back. A flood of publishers then costs no CPU: the kernel's
buffers hold what they send (refusing 4 KiB records from 48 connections one by one kept /healthz
at ~700 ms).

Answers are flow-controlled too: a publisher that does not read them (error lines, `synced`) has its
records left unprocessed, and reading paused, while more than `ingest.max_answer_bytes` of answers wait to
be written (asyncio's `pause_writing` / `resume_writing`): what it can make the gateway hold is that much
plus its read buffer (`max_buffer_bytes`), not every answer (+276 MiB without it).

With `ingest.token` set, the first line must be `{"auth": TOKEN}` within `server.header_timeout_s`;
otherwise the connection gets one `unauthorized` error line and is closed before anything is published.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import orjson
from prometheus_client.core import CounterMetricFamily, Metric

from core import Published, QueueFull, RequestError

from ..catalog import TopicCatalog
from ..config import GatewayConfig
from ..edge.ratelog import BadInputLog
from ..errors import BrokerUnavailable, InternalError, Unauthorized
from ..ops.tracing import Tracing
from .ingest_parser import Authed, AuthFailed, IngestParser, Item, LineError, Publish, Sync

log = logging.getLogger("gateway.ingest")


class IngestCounters:
    """Per-process counts for /metrics (gateway/ops/metrics.py)."""

    #: times a publisher's unread answers reached `ingest.max_answer_bytes` (its records wait)
    answer_pauses = 0
    #: records accepted, and error lines sent
    records = 0
    errors = 0

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("fanout_ingest_records", "records accepted on the TCP ingest", value=self.records)
        yield CounterMetricFamily("fanout_ingest_errors", "error lines sent on the TCP ingest", value=self.errors)
        yield CounterMetricFamily(
            "fanout_ingest_answer_pauses",
            "times a publisher's unread answers reached ingest.max_answer_bytes (its records waited)",
            value=self.answer_pauses,
        )


ingest_counters = IngestCounters()


#: Bytes of records all the ingest connections of one server apply in one turn of the event loop, at most
#: (about 2 ms of parsing and encoding): with large records the count alone would let a turn run long.
TURN_BYTES = 256 * 1024


class LoopTurn:
    """What all the ingest connections of one server may apply in one turn of the event loop together:
    `ingest.max_records_per_turn` records and `TURN_BYTES` bytes. Without it, 48 publishers whose reads are
    ready at once each applied a turn's worth in the same loop turn, and another client's request waited
    for all of them."""

    def __init__(self, records: int, size: int = TURN_BYTES) -> None:
        self.records = records
        self.size = size
        self.left = records
        self.bytes_left = size
        self._refill: asyncio.Handle | None = None

    @property
    def spent(self) -> bool:
        """This turn's budget is spent: go on in a later turn."""
        return self.left <= 0 or self.bytes_left <= 0

    def spend(self, records: int, size: int) -> None:
        """`records` items and `size` bytes of input were framed this turn."""
        if self._refill is None:
            self._refill = asyncio.get_running_loop().call_soon(self._refilled)  # runs in the next turn
        self.left -= records
        self.bytes_left -= size

    def _refilled(self) -> None:
        self._refill = None
        self.left = self.records
        self.bytes_left = self.size


def _error_line(line_no: int, code: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "line": line_no, "code": code, "message": message}) + b"\n"


class IngestParts(NamedTuple):
    """What the ingest's connections use of the gateway, given by the process that serves them."""

    config: GatewayConfig
    catalog: TopicCatalog
    #: one span per turn that took records, when tracing is on
    tracing: Tracing
    bad_input: BadInputLog


class IngestProtocol(asyncio.Protocol):
    def __init__(self, parts: IngestParts, turn: LoopTurn | None = None) -> None:
        self.parts = parts
        config = parts.config.ingest
        #: the loop turn's budget, shared by the server's connections
        self.turn = turn if turn is not None else LoopTurn(config.max_records_per_turn)
        self.parser = IngestParser(config.max_line_bytes, config.token)
        self.max_buffer = config.max_buffer_bytes
        self.accepted = 0
        self.refused = 0
        self.transport: asyncio.Transport | None = None
        #: the record waiting for space in a private queue, or for the broker (`_wait_for_broker`)
        self.blocked: Publish | None = None
        #: not read until the broker takes publishes again (`Broker.when_accepting`)
        self.broker_wait: asyncio.Future[None] | None = None
        self.reading_paused = False
        #: more than `max_answer_bytes` of answers wait to be written: records are not processed
        self.write_paused = False
        self.max_answer = config.max_answer_bytes
        self.max_per_turn = config.max_records_per_turn
        #: a scheduled continuation: this connection yielded the loop to the fan-out after a full turn
        self.continuation: asyncio.Handle | None = None
        self.auth_timeout = parts.config.server.header_timeout_s
        self.auth_timer: asyncio.TimerHandle | None = None
        self.peer: object = None
        #: with a broker (docs/cluster.md): publishes sent and not yet answered, and a `sync` waiting on them
        self.landing = 0
        self.sync_waiting: Sync | None = None
        #: a graceful drain: nothing more is read; what was received is answered, then the connection closes
        self.draining = False
        self.on_lost: Callable[[IngestProtocol], None] = lambda conn: None

    def drain(self) -> None:
        """Stop reading: the records already received are still answered (`drained` tells when)."""
        self.draining = True
        if self.transport is not None and not self.reading_paused:
            self.transport.pause_reading()
            self.reading_paused = True

    @property
    def drained(self) -> bool:
        """Nothing left to answer: every complete record received was processed (`_process` stops only when
        none is left, or held, or paused, or yielding the turn) and has landed; a partial last line is dropped."""
        return (
            self.transport is None
            or self.transport.is_closing()
            or (
                not self.held
                and self.landing == 0
                and self.continuation is None
                and not self.write_paused
                and self.sync_waiting is None
            )
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream protocol is given a Transport
        self.peer = transport.get_extra_info("peername")
        self.transport.set_write_buffer_limits(high=self.max_answer, low=self.max_answer // 4)  # type: ignore[union-attr]
        if not self.parser.authed:
            self.auth_timer = asyncio.get_running_loop().call_later(self.auth_timeout, self._auth_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.on_lost(self)
        if self.broker_wait is not None:
            self.broker_wait.cancel()
        if self.auth_timer is not None:
            self.auth_timer.cancel()

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # refused: nothing more from this peer is looked at
        self.parser.feed(data)
        if not self.held and self.continuation is None and not self.write_paused:
            self._process()
        if self.parser.buffered > self.max_buffer and not self.reading_paused and self.transport:
            self.transport.pause_reading()
            self.reading_paused = True

    @property
    def held(self) -> bool:
        """A record waits (a full private queue, the broker) or the broker takes none now: nothing is processed."""
        return self.blocked is not None or self.broker_wait is not None

    def pause_writing(self) -> None:
        """The answers not yet written passed `max_answer_bytes`: stop processing and reading."""
        self.write_paused = True
        ingest_counters.answer_pauses += 1
        self._pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.transport is not None and not self.held and self.continuation is None:
            self._process()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _continue(self) -> None:
        self.continuation = None
        if not self.held and self.transport is not None and not self.write_paused:
            self._process()

    def _process(self) -> None:
        tracing = self.parts.tracing
        if not tracing.enabled:  # off: not even the counts a span would carry
            self._process_records()
            return
        # one span per turn that took records (gateway/ops/tracing.py), made after the fact: an empty turn makes none
        started, lines, buffered = time.time_ns(), self.parser.lines, self.parser.buffered
        records, errors = ingest_counters.records, ingest_counters.errors
        self._process_records()
        if self.parser.lines != lines:
            tracing.record(
                "ingest batch",
                started,
                {
                    "fanout.ingest.lines": self.parser.lines - lines,
                    "fanout.ingest.bytes": buffered - self.parser.buffered,
                    "fanout.ingest.accepted": ingest_counters.records - records,
                    "fanout.ingest.errors": ingest_counters.errors - errors,
                },
            )

    def _process_records(self) -> None:
        budget = self.max_per_turn
        while not self.held and not self.write_paused:
            if self.sync_waiting is not None or self.landing >= self.max_per_turn:
                self._pause()  # the broker's answers resume it (`_landed`)
                break
            if budget == 0 or self.turn.spent:
                # A publisher at full speed must not starve the fan-out: after a turn (its own, or every
                # connection's together), let a cycle run (the scheduler was woken by these publishes),
                # then go on with what is buffered.
                self.continuation = asyncio.get_running_loop().call_soon(self._continue)
                break
            budget -= 1
            try:
                buffered = self.parser.buffered
                item = self.parser.next_item()
                if item is None:
                    break
                self.turn.spend(1, buffered - self.parser.buffered)
                self._apply(item)
            except Exception as exc:
                # The parser consumed the line before failing on it: that line is lost, the next ones go on.
                self._internal_error(self.parser.lines, exc)
        if (
            self.reading_paused
            and not self.held
            and not self.write_paused
            and not self.draining
            and self.parser.buffered <= self.max_buffer
            and self.transport
        ):
            self.transport.resume_reading()
            self.reading_paused = False

    def _apply(self, item: Item) -> None:
        if isinstance(item, Publish):
            self._publish(item)
        elif isinstance(item, Sync):
            if self.landing:
                self.sync_waiting = item  # answered when every record before it has landed
                return
            self._write(
                orjson.dumps({"type": "synced", "id": item.id, "accepted": self.accepted, "refused": self.refused}) + b"\n"
            )
            self.accepted = self.refused = 0
        elif isinstance(item, LineError):
            self.refused += 1
            self._error(item.line, item.code, item.message)
        elif isinstance(item, Authed):
            if self.auth_timer is not None:
                self.auth_timer.cancel()
            self._write(b'{"type":"authed"}\n')
        elif isinstance(item, AuthFailed):
            self._unauthorized(item.line, item.message)

    def _error(self, line_no: int, code: str, message: str) -> None:
        ingest_counters.errors += 1
        self._write(_error_line(line_no, code, message))

    def _auth_expired(self) -> None:
        self.auth_timer = None
        if not self.parser.authed and self.transport is not None:
            self._unauthorized(0, f"no auth line within {self.auth_timeout:g} s")

    def _unauthorized(self, line_no: int, reason: str) -> None:
        self.parts.bad_input("ingest", "unauthorized connection from %s: %s", self.peer, reason)
        self._error(line_no, Unauthorized.code, reason)
        if self.transport is not None:
            self.transport.close()  # after the error line is written

    def _internal_error(self, line_no: int, exc: Exception) -> None:
        # A bug met by one record must cost that record only, not the connection and the rest of its batch.
        self.refused += 1
        self.parts.bad_input("ingest", "line %d from %s: unexpected %s: %.200s", line_no, self.peer, type(exc).__name__, exc)
        self._error(line_no, InternalError.code, "internal error while handling this record")

    def _pause(self) -> None:
        if self.transport is not None and not self.reading_paused:
            self.transport.pause_reading()
            self.reading_paused = True

    def _landed(self, line_no: int, future: asyncio.Future[Published]) -> None:
        """A publish sent to the broker was answered: count it, then go on if it held the connection."""
        self.landing -= 1
        exc = future.exception()
        if isinstance(exc, RequestError):
            self.refused += 1
            self._error(line_no, exc.code, exc.message)
        elif exc is not None:
            self._internal_error(line_no, exc)  # type: ignore[arg-type]  # a BaseException from the future
        else:
            self.accepted += 1
            ingest_counters.records += 1
        if self.landing == 0 and self.sync_waiting is not None:
            sync, self.sync_waiting = self.sync_waiting, None
            self._apply(sync)
        if self.transport is not None and not self.held and self.continuation is None:
            self._process()

    def _publish(self, item: Publish) -> None:
        record = item.record
        catalog = self.parts.catalog
        try:  # at once when the topic lives in this process
            published = catalog.publish_nowait(record.topic, record.data, seq=record.seq, owner=record.client)
        except QueueFull:
            self._block(item)
            return
        except RequestError as exc:
            self.refused += 1
            self._error(item.line, exc.code, exc.message)
            return
        if published is not None:
            self.accepted += 1
            ingest_counters.records += 1
            return
        # the topic lives in the broker: the answer comes when it has landed
        if catalog.congested:
            self._wait_for_broker(item)  # over broker.max_pending_bytes: held, not refused
            return
        try:
            future = catalog.publish(record.topic, record.data, seq=record.seq, owner=record.client)
        except RequestError as exc:
            if isinstance(exc, BrokerUnavailable) and catalog.congested:
                self._wait_for_broker(item)  # this one met the bound
                return
            self.refused += 1
            self._error(item.line, exc.code, exc.message)
            if isinstance(exc, BrokerUnavailable):
                self._wait_for_broker(None)  # Redis lost: one answer, then no reading until it is back
            return
        self.landing += 1
        future.add_done_callback(lambda done: self._landed(item.line, done))

    def _block(self, item: Publish) -> None:
        self.blocked = item
        if self.transport is not None and not self.reading_paused:
            self.transport.pause_reading()
            self.reading_paused = True
        future = self.parts.catalog.space_freed(item.record.topic, item.record.client)
        future.add_done_callback(self._on_space)

    def _on_space(self, _future: asyncio.Future[None]) -> None:
        if self.blocked is None or self.transport is None:
            return
        item = self.blocked
        self.blocked = None
        try:
            self._publish(item)
        except Exception as exc:
            self._internal_error(item.line, exc)
        if self.blocked is None and self.broker_wait is None:
            self._process()

    def _wait_for_broker(self, item: Publish | None) -> None:
        """The broker takes no publish now: hold `item` (None: it was answered) and stop reading until it
        does (`Broker.when_accepting`)."""
        self._pause()
        if item is not None:
            self.blocked = item
        self.broker_wait = self.parts.catalog.when_accepting()
        self.broker_wait.add_done_callback(self._broker_accepting)

    def _broker_accepting(self, future: asyncio.Future[None]) -> None:
        if future.cancelled() or self.transport is None:
            return
        self.broker_wait = None
        if self.blocked is not None:
            self._on_space(future)
        elif self.continuation is None and not self.write_paused:
            self._process()


class IngestServer:
    def __init__(self, parts: IngestParts) -> None:
        self.parts = parts
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        #: the connections open now (a drain stops them reading and closes them once answered)
        self.connections: set[IngestProtocol] = set()

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> None:
        """`reuse_port`: several worker processes serve the port (server.workers, docs/cluster.md §5)."""
        loop = asyncio.get_running_loop()
        turn = LoopTurn(self.parts.config.ingest.max_records_per_turn)

        def protocol() -> IngestProtocol:
            conn = IngestProtocol(self.parts, turn)
            conn.on_lost = self.connections.discard
            self.connections.add(conn)
            return conn

        self.server = await loop.create_server(protocol, host, port, reuse_port=reuse_port or None)
        self.port = self.server.sockets[0].getsockname()[1]
        log.info("TCP ingest on %s:%d", host, self.port)

    def stop_accepting(self) -> None:
        if self.server is not None:
            self.server.close()

    async def drain(self, timeout: float) -> None:
        """Graceful drain: no new connection, nothing more read; each connection is closed once what it sent
        was answered (at the latest after `timeout` seconds)."""
        self.stop_accepting()
        for conn in list(self.connections):
            conn.drain()
        deadline = time.monotonic() + timeout
        while True:
            for conn in list(self.connections):
                if conn.drained or time.monotonic() >= deadline:
                    if conn.transport is not None:
                        conn.transport.close()  # after the buffered answers are written
                    self.connections.discard(conn)
            if not self.connections:
                return
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

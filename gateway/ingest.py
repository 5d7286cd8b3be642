"""TCP ingest for publishers and pipelines: newline-delimited JSON records (docs/protocol.md).

The I/O half: `IngestParser` (gateway/ingest_parser.py) frames and parses the lines; this protocol feeds it
what it reads, applies its items in order, synchronously, and writes the answers. A `sync` record is
answered when every record before it on the connection was applied, with how many were accepted and
refused since the last sync. Back-pressure: a record for a full private queue stops the connection (reading
pauses, later lines stay in the parser, unparsed) until the queue frees space. A malformed line gets an
error line naming its line number; the connection and everything else go on.

Answers are flow-controlled too: a publisher that does not read them (error lines, `synced`) has its
records left unprocessed, and reading paused, while more than `ingest.max_answer_bytes` of answers wait to
be written (asyncio's `pause_writing` / `resume_writing`): what it can make the gateway hold is that much
plus its read buffer (`max_buffer_bytes`), not every answer (issue 24: +276 MiB).

With `ingest.token` set, the first line must be `{"auth": TOKEN}` within `server.header_timeout_s`;
otherwise the connection gets one `unauthorized` error line and is closed before anything is published.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from core import QueueFull, RequestError

from .errors import InternalError, Unauthorized
from .hub import Hub
from .ingest_parser import Authed, AuthFailed, IngestParser, Item, LineError, Publish, Sync

log = logging.getLogger("gateway.ingest")


class IngestCounters:
    """Per-process counts for /metrics (gateway/metrics.py)."""

    #: times a publisher's unread answers reached `ingest.max_answer_bytes` (its records wait)
    answer_pauses = 0


ingest_counters = IngestCounters()


def _error_line(line_no: int, code: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "line": line_no, "code": code, "message": message}) + b"\n"


class IngestProtocol(asyncio.Protocol):
    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        config = hub.config.ingest
        self.parser = IngestParser(config.max_line_bytes, config.token)
        self.max_buffer = config.max_buffer_bytes
        self.accepted = 0
        self.refused = 0
        self.transport: asyncio.Transport | None = None
        #: the record waiting for space in a private queue
        self.blocked: Publish | None = None
        self.reading_paused = False
        #: more than `max_answer_bytes` of answers wait to be written: records are not processed
        self.write_paused = False
        self.max_answer = config.max_answer_bytes
        self.max_per_turn = config.max_records_per_turn
        #: a scheduled continuation: this connection yielded the loop to the fan-out after a full turn
        self.continuation: asyncio.Handle | None = None
        self.auth_timeout = hub.config.server.header_timeout_s
        self.auth_timer: asyncio.TimerHandle | None = None
        self.peer: object = None
        #: with a broker (docs/cluster.md): publishes sent and not yet answered, and a `sync` waiting on them
        self.landing = 0
        self.sync_waiting: Sync | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream protocol is given a Transport
        self.peer = transport.get_extra_info("peername")
        self.transport.set_write_buffer_limits(high=self.max_answer, low=self.max_answer // 4)  # type: ignore[union-attr]
        if not self.parser.authed:
            self.auth_timer = asyncio.get_running_loop().call_later(self.auth_timeout, self._auth_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.auth_timer is not None:
            self.auth_timer.cancel()

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # refused: nothing more from this peer is looked at
        self.parser.feed(data)
        if self.blocked is None and self.continuation is None and not self.write_paused:
            self._process()
        if self.parser.buffered > self.max_buffer and not self.reading_paused and self.transport:
            self.transport.pause_reading()
            self.reading_paused = True

    def pause_writing(self) -> None:
        """The answers not yet written passed `max_answer_bytes`: stop processing and reading."""
        self.write_paused = True
        ingest_counters.answer_pauses += 1
        self._pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.transport is not None and self.blocked is None and self.continuation is None:
            self._process()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _continue(self) -> None:
        self.continuation = None
        if self.blocked is None and self.transport is not None and not self.write_paused:
            self._process()

    def _process(self) -> None:
        budget = self.max_per_turn
        while self.blocked is None and not self.write_paused:
            if self.sync_waiting is not None or self.landing >= self.max_per_turn:
                self._pause()  # the broker's answers resume it (`_landed`)
                break
            if budget == 0:
                # A publisher at full speed must not starve the fan-out: after a turn, let a cycle run
                # (the scheduler was woken by these publishes), then go on with what is buffered.
                self.continuation = asyncio.get_running_loop().call_soon(self._continue)
                break
            budget -= 1
            try:
                item = self.parser.next_item()
                if item is None:
                    break
                self._apply(item)
            except Exception as exc:
                # The parser consumed the line before failing on it: that line is lost, the next ones go on.
                self._internal_error(self.parser.lines, exc)
        if (self.reading_paused and self.blocked is None and not self.write_paused
                and self.parser.buffered <= self.max_buffer and self.transport):
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
                orjson.dumps({"type": "synced", "id": item.id, "accepted": self.accepted, "refused": self.refused})
                + b"\n"
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
        self.hub.metrics.ingest_errors += 1
        self._write(_error_line(line_no, code, message))

    def _auth_expired(self) -> None:
        self.auth_timer = None
        if not self.parser.authed and self.transport is not None:
            self._unauthorized(0, f"no auth line within {self.auth_timeout:g} s")

    def _unauthorized(self, line_no: int, reason: str) -> None:
        self.hub.bad_input("ingest", "unauthorized connection from %s: %s", self.peer, reason)
        self._error(line_no, Unauthorized.code, reason)
        if self.transport is not None:
            self.transport.close()  # after the error line is written

    def _internal_error(self, line_no: int, exc: Exception) -> None:
        # A bug met by one record must cost that record only, not the connection and the rest of its batch.
        self.refused += 1
        self.hub.bad_input("ingest", "line %d from %s: unexpected %s: %.200s", line_no, self.peer,
                           type(exc).__name__, exc)
        self._error(line_no, InternalError.code, "internal error while handling this record")

    def _pause(self) -> None:
        if self.transport is not None and not self.reading_paused:
            self.transport.pause_reading()
            self.reading_paused = True

    def _landed(self, line_no: int, future: asyncio.Future) -> None:
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
            self.hub.metrics.ingest_records += 1
        if self.landing == 0 and self.sync_waiting is not None:
            sync, self.sync_waiting = self.sync_waiting, None
            self._apply(sync)
        if self.transport is not None and self.blocked is None and self.continuation is None:
            self._process()

    def _publish(self, item: Publish) -> None:
        record = item.record
        if self.hub.broker.distributed and (self.hub.via_broker(record.topic) or self.hub.queued_in_broker(record.topic)):
            try:
                future = self.hub.publish_later(record.topic, record.data, seq=record.seq, owner=record.client)
            except RequestError as exc:
                self.refused += 1
                self._error(item.line, exc.code, exc.message)
                return
            self.landing += 1
            future.add_done_callback(lambda done: self._landed(item.line, done))
            return
        try:
            self.hub.publish(record.topic, record.data, seq=record.seq, owner=record.client)
        except QueueFull:
            self._block(item)
            return
        except RequestError as exc:
            self.refused += 1
            self._error(item.line, exc.code, exc.message)
            return
        self.accepted += 1
        self.hub.metrics.ingest_records += 1

    def _block(self, item: Publish) -> None:
        self.blocked = item
        if self.transport is not None and not self.reading_paused:
            self.transport.pause_reading()
            self.reading_paused = True
        future = self.hub.space_freed(item.record.topic, item.record.client)
        future.add_done_callback(self._on_space)

    def _on_space(self, _future: asyncio.Future) -> None:
        if self.blocked is None or self.transport is None:
            return
        item = self.blocked
        self.blocked = None
        try:
            self._publish(item)
        except Exception as exc:
            self._internal_error(item.line, exc)
        if self.blocked is None:
            self._process()

class IngestServer:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> None:
        """`reuse_port`: several worker processes serve the port (server.workers, docs/cluster.md §5)."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: IngestProtocol(self.hub), host, port, reuse_port=reuse_port or None)
        self.port = self.server.sockets[0].getsockname()[1]
        log.info("TCP ingest on %s:%d", host, self.port)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

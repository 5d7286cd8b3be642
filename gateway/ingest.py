"""TCP ingest for publishers and pipelines: newline-delimited JSON records (docs/protocol.md).

Records are applied in order, synchronously, as they arrive. A `sync` record is answered when every record
before it on the connection was applied, with how many were accepted and refused since the last sync.
Back-pressure: a record for a full private queue stops the connection (reading pauses, later lines stay
buffered) until the queue frees space. A malformed line gets an error line naming its line number; the
connection and everything else go on.

With `ingest.token` set, the first line must be `{"auth": TOKEN}` within `server.header_timeout_s`;
otherwise the connection gets one `unauthorized` error line and is closed before anything is published.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from typing import Any

import orjson

from core import QueueFull, RequestError

from .hub import Hub

log = logging.getLogger("gateway.ingest")

#: Bytes an unauthenticated connection may send without a newline: its first line is only an auth record,
#: so a peer without the token cannot make the gateway buffer up to max_buffer_bytes.
AUTH_LINE_MAX = 4096


def _error_line(line_no: int, code: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "line": line_no, "code": code, "message": message}) + b"\n"


class IngestProtocol(asyncio.Protocol):
    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        config = hub.config.ingest
        self.max_line = config.max_line_bytes
        self.max_buffer = config.max_buffer_bytes
        self.buffer = bytearray()
        self.line_no = 0
        self.accepted = 0
        self.refused = 0
        self.transport: asyncio.Transport | None = None
        #: the record waiting for space in a private queue, with its line number
        self.blocked: tuple[int, dict] | None = None
        self.reading_paused = False
        self.skipping = False  # inside an over-long line: drop bytes up to its newline
        self.max_per_turn = config.max_records_per_turn
        #: a scheduled continuation: this connection yielded the loop to the fan-out after a full turn
        self.continuation: asyncio.Handle | None = None
        self.token = config.token.encode()
        self.authed = not self.token  # no token configured: every connection may publish
        self.auth_timeout = hub.config.server.header_timeout_s
        self.auth_timer: asyncio.TimerHandle | None = None
        self.peer: object = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peer = transport.get_extra_info("peername")
        if not self.authed:
            self.auth_timer = asyncio.get_running_loop().call_later(self.auth_timeout, self._auth_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.auth_timer is not None:
            self.auth_timer.cancel()

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # refused: nothing more from this peer is looked at
        self.buffer += data
        if self.blocked is None and self.continuation is None:
            self._process()
        if len(self.buffer) > self.max_buffer and not self.reading_paused and self.transport:
            self.transport.pause_reading()
            self.reading_paused = True

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _continue(self) -> None:
        self.continuation = None
        if self.blocked is None and self.transport is not None:
            self._process()

    def _process(self) -> None:
        buffer = self.buffer
        start = 0
        budget = self.max_per_turn
        while self.blocked is None:
            if budget == 0:
                # A publisher at full speed must not starve the fan-out: after a turn, let a cycle run
                # (the scheduler was woken by these publishes), then go on with what is buffered.
                self.continuation = asyncio.get_running_loop().call_soon(self._continue)
                break
            budget -= 1
            end = buffer.find(b"\n", start)
            if end < 0:
                if not self.authed and len(buffer) - start > AUTH_LINE_MAX:
                    self._unauthorized(1, f"no auth line in the first {AUTH_LINE_MAX} bytes")
                    break
                if len(buffer) - start > self.max_line and not self.skipping:
                    self.line_no += 1
                    self.refused += 1
                    self._error(self.line_no, "too_large", f"line longer than {self.max_line} bytes")
                    self.skipping = True
                if self.skipping:
                    start = len(buffer)
                break
            line = bytes(buffer[start:end])
            start = end + 1
            if self.skipping:
                self.skipping = False
                continue
            self.line_no += 1
            if not self.authed:
                if not self._authenticate(line):
                    break
            elif len(line) > self.max_line:
                self.refused += 1
                self._error(self.line_no, "too_large", f"line longer than {self.max_line} bytes")
            elif line.strip():
                self._guarded(self.line_no, self._apply, self.line_no, line)
        del buffer[:start]
        if self.reading_paused and self.blocked is None and len(buffer) <= self.max_buffer and self.transport:
            self.transport.resume_reading()
            self.reading_paused = False

    def _error(self, line_no: int, code: str, message: str) -> None:
        self.hub.metrics.ingest_errors += 1
        self._write(_error_line(line_no, code, message))

    def _authenticate(self, line: bytes) -> bool:
        """Check the first line against the token; False when the connection was refused (and is closing)."""
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
        offered = record.get("auth") if isinstance(record, dict) else None
        if not isinstance(offered, str):
            self._unauthorized(1, "the first line must be {\"auth\": TOKEN}")
            return False
        if not hmac.compare_digest(offered.encode(), self.token):
            self._unauthorized(1, "wrong token")
            return False
        self.authed = True
        if self.auth_timer is not None:
            self.auth_timer.cancel()
        self._write(b'{"type":"authed"}\n')
        return True

    def _auth_expired(self) -> None:
        self.auth_timer = None
        if not self.authed and self.transport is not None:
            self._unauthorized(0, f"no auth line within {self.auth_timeout:g} s")

    def _unauthorized(self, line_no: int, reason: str) -> None:
        self.hub.bad_input("ingest", "unauthorized connection from %s: %s", self.peer, reason)
        self._error(line_no, "unauthorized", reason)
        self.buffer.clear()
        if self.transport is not None:
            self.transport.close()  # after the error line is written

    def _guarded(self, line_no: int, handler: Callable[..., None], *args: Any) -> None:
        # A bug met by one record must cost that record only, not the connection and the rest of its batch.
        try:
            handler(*args)
        except Exception as exc:
            self.refused += 1
            self.hub.bad_input("ingest", "line %d from %s: unexpected %s: %.200s", line_no, self.peer,
                               type(exc).__name__, exc)
            self._error(line_no, "internal_error", "internal error while handling this record")

    def _apply(self, line_no: int, line: bytes) -> None:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            self.refused += 1
            self._error(line_no, "bad_json", f"not JSON: {exc}")
            return
        if not isinstance(record, dict):
            self.refused += 1
            self._error(line_no, "bad_record", "a record is a JSON object")
            return
        if "sync" in record:
            self._sync(line_no, record["sync"])
            return
        if "auth" in record:
            # Line 1 reaches here only when no token is set: clients may always send the auth line.
            if line_no == 1:
                self._write(b'{"type":"authed"}\n')
            else:
                self.refused += 1
                self._error(line_no, "bad_record", "`auth` is only accepted as the first line")
            return
        self._publish(line_no, record)

    def _sync(self, line_no: int, sync_id: Any) -> None:
        # The id is echoed back: only scalars, so a hostile id (e.g. nested past what orjson writes) is refused.
        if not (sync_id is None or isinstance(sync_id, str | int)) or isinstance(sync_id, bool):
            self.refused += 1
            self._error(line_no, "bad_record", "a `sync` id is a string, an integer or null")
            return
        self._write(
            orjson.dumps({"type": "synced", "id": sync_id, "accepted": self.accepted, "refused": self.refused}) + b"\n"
        )
        self.accepted = self.refused = 0

    def _publish(self, line_no: int, record: dict[str, Any]) -> None:
        topic, seq, client = record.get("topic"), record.get("seq"), record.get("client")
        if not isinstance(topic, str) or not topic or "data" not in record:
            self.refused += 1
            self._error(line_no, "bad_record", "a record needs `topic` (string) and `data`")
            return
        if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool)):
            self.refused += 1
            self._error(line_no, "bad_record", "`seq` must be an integer")
            return
        if client is not None and not isinstance(client, str):
            self.refused += 1
            self._error(line_no, "bad_record", "`client` must be a string (a client id)")
            return
        try:
            self.hub.publish(topic, record["data"], seq=seq, owner=client)
        except QueueFull:
            self._block(line_no, record)
            return
        except RequestError as exc:
            self.refused += 1
            self._error(line_no, exc.code, exc.message)
            return
        self.accepted += 1
        self.hub.metrics.ingest_records += 1

    def _block(self, line_no: int, record: dict) -> None:
        self.blocked = (line_no, record)
        if self.transport is not None and not self.reading_paused:
            self.transport.pause_reading()
            self.reading_paused = True
        future = self.hub.space_freed(record["topic"], record.get("client"))
        future.add_done_callback(self._on_space)

    def _on_space(self, _future: asyncio.Future) -> None:
        if self.blocked is None or self.transport is None:
            return
        line_no, record = self.blocked
        self.blocked = None
        self._guarded(line_no, self._publish, line_no, record)
        if self.blocked is None:
            self._process()


class IngestServer:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: IngestProtocol(self.hub), host, port)
        self.port = self.server.sockets[0].getsockname()[1]
        log.info("TCP ingest on %s:%d", host, self.port)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

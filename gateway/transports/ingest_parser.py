"""The TCP ingest's input, sans-I/O: bytes in, line-numbered items out (docs/protocol.md, "TCP ingest").

`IngestParser` frames newline-delimited lines, numbers them from 1 (every line counts: the auth line, blank
lines, refused ones), parses each with orjson and converts it with `schema.record`, so a record is refused
with the schema's own code and message. It keeps the handshake rule: with a token, the first line must be
`{"auth": TOKEN}`. It never touches a socket, a loop or a clock (the auth deadline is the protocol's).

Items are pulled, not pushed: `feed` only stores bytes and `next_item` frames and parses one line at a time,
so what the protocol cannot apply yet (a full private queue, the end of its turn) stays here as bytes and
`buffered` tells the protocol when to stop reading.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import orjson

from core.errors import BadSeq, MessageTooLarge

from .. import schema
from ..errors import BadJson, BadRecord

#: Bytes an unauthenticated connection may send without a newline: its first line is only an auth record,
#: so a peer without the token cannot make the gateway buffer up to max_buffer_bytes.
AUTH_LINE_MAX = 4096


@dataclass(frozen=True, slots=True)
class Authed:
    """The auth line: the token matched, or none is required (a publisher may always send it)."""

    line: int


@dataclass(frozen=True, slots=True)
class Publish:
    line: int
    record: schema.PublishRecord


@dataclass(frozen=True, slots=True)
class Sync:
    line: int
    id: int | str | None


@dataclass(frozen=True, slots=True)
class LineError:
    """A refused line: it is answered with an error line and the connection goes on."""

    line: int
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class AuthFailed:
    """The handshake failed: answer with an `unauthorized` error line and close. Nothing follows it."""

    line: int
    message: str


Item = Authed | Publish | Sync | LineError | AuthFailed


class IngestParser:
    """One connection's input. `token` empty: no auth line is required."""

    def __init__(self, max_line: int, token: str = "") -> None:
        self.max_line = max_line
        self.token = token.encode()
        #: lines framed so far: the number of the last item's line
        self.lines = 0
        self._authed = not self.token
        self._refused = False  # the handshake failed: nothing more is looked at
        self._buffer = bytearray()
        self._start = 0  # bytes of _buffer before it were already framed
        self._skipping = False  # inside an over-long line: its bytes are dropped up to its newline

    @property
    def authed(self) -> bool:
        """Whether records may come (the auth line was accepted, or none is required)."""
        return self._authed

    @property
    def buffered(self) -> int:
        """Bytes fed and not framed yet."""
        return len(self._buffer) - self._start

    def feed(self, data: bytes) -> None:
        if self._refused:
            return
        del self._buffer[: self._start]
        self._start = 0
        self._buffer += data

    def next_item(self) -> Item | None:
        """The next item, or None until more bytes are fed. A line's bytes are consumed before it is parsed:
        should parsing raise (a bug), the caller may report that line and go on with the next."""
        while not self._refused:
            buffer = self._buffer
            end = buffer.find(b"\n", self._start)
            if end < 0:
                return self._partial_line()
            line = bytes(buffer[self._start : end])
            self._start = end + 1
            if self._skipping:  # the end of a line already refused as too large
                self._skipping = False
                continue
            self.lines += 1
            item = self._item(line)
            if item is not None:
                return item
        return None

    def _partial_line(self) -> Item | None:
        pending = len(self._buffer) - self._start
        if not self._authed:
            return self._refuse(f"no auth line in the first {AUTH_LINE_MAX} bytes") if pending > AUTH_LINE_MAX else None
        item = None
        if pending > self.max_line and not self._skipping:
            # Refused as soon as it is known to be too long, not when (if ever) its newline comes.
            self.lines += 1
            self._skipping = True
            item = self._too_large()
        if self._skipping:
            self._start = len(self._buffer)
        return item

    def _item(self, line: bytes) -> Item | None:
        if not self._authed:
            return self._authenticate(line)
        if len(line) > self.max_line:
            return self._too_large()
        if not line or line.isspace():
            return None
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            return LineError(self.lines, BadJson.code, f"not JSON: {exc}")
        try:
            record = schema.record(value)
        except (BadRecord, BadSeq) as exc:  # BadSeq: a whole number past 64 bits (schema.Seq)
            return LineError(self.lines, exc.code, exc.message)
        if isinstance(record, schema.SyncRecord):
            return Sync(self.lines, record.sync)
        if isinstance(record, schema.AuthRecord):
            # Line 1 gets here only when no token is set: the auth line is still answered.
            if self.lines == 1:
                return Authed(1)
            return LineError(self.lines, BadRecord.code, "`auth` is only accepted as the first line")
        return Publish(self.lines, record)

    def _authenticate(self, line: bytes) -> Item:
        if len(line) > AUTH_LINE_MAX:
            return self._refuse(f"no auth line in the first {AUTH_LINE_MAX} bytes")
        try:
            record = schema.record(orjson.loads(line))
        except (orjson.JSONDecodeError, BadRecord, BadSeq):  # any record but an auth one: refused alike
            record = None
        if not isinstance(record, schema.AuthRecord):
            return self._refuse('the first line must be {"auth": TOKEN}')
        if not hmac.compare_digest(record.auth.encode(), self.token):
            return self._refuse("wrong token")
        self._authed = True
        return Authed(1)

    def _refuse(self, message: str) -> AuthFailed:
        self._refused = True
        self._buffer.clear()
        self._start = 0
        return AuthFailed(1, message)

    def _too_large(self) -> LineError:
        return LineError(self.lines, MessageTooLarge.code, f"line longer than {self.max_line} bytes")

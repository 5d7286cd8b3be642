"""The client of the gateway's TCP ingest (docs/protocol.md, "TCP ingest"): the one used by the pipeline,
the load generator and the tests.

* Lines out: `record_line`, `sync_line`, `auth_line`, `json_line`.
* Answers in, sans-I/O: `AnswerReader` frames the gateway's answer lines and decodes each, strictly, into
  `Authed`, `Synced` or `ErrorAnswer` (msgspec); a line that is none of them is a `BadAnswer`, and the end
  of the connection is `Closed`.
* `IngestSocket`: a blocking connection at the byte level, for a caller with its own answer logic (the
  pipeline's checked client): writes that keep reading (a publisher whose records are all refused gets one
  error line each, and one that does not read them deadlocks against a gateway blocked writing them), reads
  bounded by a timeout.
* `IngestConnection`: a blocking connection at the answer level (tests, scripts): optional auth line, send
  records, `sync` and get the `synced` answer, take answers one by one.
* `AsyncIngestConnection`: the asyncio variant (the load generator's publisher, which runs on an event
  loop): the same lines and answers, with write flow control.

It imports nothing of the gateway nor of the rest of `fanout_client` (whose `__init__` imports nothing
eagerly): Spark executors import it with `fanout_client/__init__.py` alone, without the server's or the
WebSocket client's dependencies (pipeline/spark.py ships exactly these two files).
"""

from __future__ import annotations

import asyncio
import selectors
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import orjson

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT",
    "Answer",
    "AnswerReader",
    "AsyncIngestConnection",
    "AuthRefused",
    "Authed",
    "BadAnswer",
    "Closed",
    "ErrorAnswer",
    "IngestConnection",
    "IngestError",
    "IngestProtocolError",
    "IngestSocket",
    "MAX_ANSWER_LINE_BYTES",
    "Synced",
    "auth_line",
    "json_line",
    "record_line",
    "sync_line",
]

#: The gateway's default ingest port.
DEFAULT_PORT = 7002

#: Seconds without progress (nothing written, nothing read) before a blocking connection gives up. Far above
#: a healthy gateway's answer time (milliseconds), short enough that a stuck Spark task fails in time.
DEFAULT_TIMEOUT = 30.0

#: Bytes asked of the socket per read.
READ_SIZE = 65536

#: The longest answer line taken from the gateway (`AnswerReader`): its largest answer, a ``synced`` echoing a
#: sync id, comes from a line of at most the gateway's ``ingest.max_line_bytes`` (1 MiB by default).
MAX_ANSWER_LINE_BYTES = (1 << 20) + 4096
#: Bytes of a refused line kept in its `BadAnswer`.
BAD_ANSWER_TEXT = 200
_A = TypeVar("_A")
_T = TypeVar("_T")


class IngestError(Exception):
    """Base class of the failures of one ingest connection."""


class IngestProtocolError(IngestError):
    """The gateway broke the protocol, closed the connection early or did not answer in time."""


class AuthRefused(IngestError):
    """The gateway answered the auth line with an error (then it closes the connection)."""


# -- lines out ----------------------------------------------------------------------------------------------


def json_line(value: Any) -> bytes:
    """Any JSON value as one line (orjson never writes a raw newline inside a value)."""
    return orjson.dumps(value, option=orjson.OPT_APPEND_NEWLINE)


def record_line(topic: str, data: Any, *, seq: int | None = None, client: str | None = None) -> bytes:
    record: dict[str, Any] = {"topic": topic, "data": data}
    if seq is not None:
        record["seq"] = seq
    if client is not None:
        record["client"] = client
    return json_line(record)


def sync_line(sync_id: int | str | None) -> bytes:
    return json_line({"sync": sync_id})


def auth_line(token: str) -> bytes:
    return json_line({"auth": token})


# -- answers in ---------------------------------------------------------------------------------------------


class Authed(msgspec.Struct, frozen=True, tag_field="type", tag="authed"):
    pass


class Synced(msgspec.Struct, frozen=True, tag_field="type", tag="synced"):
    id: int | str | None
    accepted: int
    refused: int


class ErrorAnswer(msgspec.Struct, frozen=True, tag_field="type", tag="error"):
    #: the 1-based line number of the refused line on this connection (0: the connection as a whole)
    line: int
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class BadAnswer:
    """A line that is no answer of the protocol (not JSON, an answer with a missing or mistyped field)."""

    text: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class Closed:
    """The gateway closed the connection."""


Answer = Authed | Synced | ErrorAnswer | BadAnswer | Closed

_decode_answer = msgspec.json.Decoder(Authed | Synced | ErrorAnswer).decode


class _Typed(msgspec.Struct):
    type: Any = None


_decode_typed = msgspec.json.Decoder(_Typed).decode
_KNOWN_TYPES = frozenset({"authed", "synced", "error"})


class AnswerReader:
    """The gateway's answer lines, framed and decoded. Feed it every byte read; ``b""`` means the gateway
    closed the connection (an unfinished line before it is a `BadAnswer`).

    Linear in what is fed: the unfinished line is kept in one buffer and only the bytes fed since are searched
    for its end. Bounded: a line longer than ``max_line_bytes`` is one `BadAnswer` (its first bytes) and the
    rest of it is skipped up to its newline, held nowhere (a gateway's answer is far smaller: a synced answer,
    the largest, echoes a sync id from a line of at most its ``ingest.max_line_bytes``, 1 MiB).
    """

    def __init__(self, max_line_bytes: int = MAX_ANSWER_LINE_BYTES) -> None:
        self.max_line_bytes = max_line_bytes
        self._buffer = bytearray()
        self._skipping = False  # inside a line already refused as too long: dropped up to its newline

    @property
    def buffered(self) -> int:
        """Bytes of the unfinished line held."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Answer]:
        if not data:
            return self._closed()
        answers: list[Answer] = []
        start = 0
        while start < len(data):
            end = data.find(b"\n", start)
            if end < 0:
                self._hold(data, start, answers)
                break
            if self._skipping:
                self._skipping = False
            elif self._buffer:
                self._buffer += data[start:end]
                self._answer(bytes(self._buffer), answers)
                self._buffer.clear()
            else:
                self._answer(data[start:end], answers)
            start = end + 1
        return answers

    def _hold(self, data: bytes, start: int, answers: list[Answer]) -> None:
        """The start of a line whose end is still to come: kept, unless the line is already too long."""
        if self._skipping:
            return
        if len(self._buffer) + len(data) - start <= self.max_line_bytes:
            self._buffer += data[start:]
            return
        head = (bytes(self._buffer[:BAD_ANSWER_TEXT]) + data[start : start + BAD_ANSWER_TEXT])[:BAD_ANSWER_TEXT]
        answers.append(BadAnswer(head, f"an answer line longer than {self.max_line_bytes} bytes"))
        self._buffer.clear()
        self._skipping = True

    def _answer(self, line: bytes, answers: list[Answer]) -> None:
        if len(line) > self.max_line_bytes:  # whole in one feed, yet too long: refused as a held one would be
            answers.append(BadAnswer(line[:BAD_ANSWER_TEXT], f"an answer line longer than {self.max_line_bytes} bytes"))
        elif line.strip():
            answer = _decode(line)
            if answer is not None:
                answers.append(answer)

    def _closed(self) -> list[Answer]:
        tail = bytes(self._buffer)  # empty while skipping a refused line: refused once is enough
        self._buffer.clear()
        self._skipping = False
        unfinished = [BadAnswer(tail, "the connection closed inside a line")] if tail.strip() else []
        return [*unfinished, Closed()]


def _decode(line: bytes) -> Answer | None:
    try:
        answer: Answer = _decode_answer(line)
        return answer
    except msgspec.DecodeError as exc:  # ValidationError included
        failure = str(exc)
    try:
        kind = _decode_typed(line).type
    except msgspec.DecodeError:
        kind = None
    if isinstance(kind, str) and kind not in _KNOWN_TYPES:
        # Not an answer of today's protocol: skipping it keeps an older client working against a newer
        # gateway that adds informational lines.
        return None
    return BadAnswer(line, failure)


# -- blocking -----------------------------------------------------------------------------------------------


class IngestSocket:
    """A blocking ingest connection at the byte level: every byte read goes to ``received`` as it arrives
    (``b""`` once when the gateway closed the connection), also while a write is under way.

    Raises `IngestProtocolError` when a write makes no progress for ``timeout`` seconds or the socket
    fails, and ``OSError`` when the connection cannot be made.
    """

    def __init__(self, host: str, port: int, received: Callable[[bytes], None], timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout
        self.received = received
        #: the gateway closed the connection (its b"" was handed to `received`)
        self.eof = False
        self._sock = socket.create_connection((host, port), timeout=timeout)
        # A sync line right after records is a small write behind unacknowledged data: with Nagle's
        # algorithm it waits for the peer's delayed ACK (~40 ms on Linux), once per sync.
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)

    def close(self) -> None:
        self._selector.close()
        self._sock.close()

    def write(self, data: bytes) -> None:
        """Write all of ``data``, reading meanwhile (an answer that makes ``received`` raise ends the write)."""
        view = memoryview(data)
        while view:
            readable, writable = self._wait(True, self.timeout)
            if not (readable or writable):
                raise IngestProtocolError(f"gateway neither read nor answered for {self.timeout} s while we wrote")
            if readable:
                self._read()
            if writable:
                sent = self._attempt(self._sock.send, view, "writing")
                if sent is not None:
                    view = view[sent:]

    def read_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Read until ``done()`` is true or ``timeout`` seconds passed (or the gateway closed); ``done()``."""
        deadline = time.monotonic() + timeout
        while not done() and not self.eof:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._wait(False, remaining)[0]:
                break
            self._read()
        return done()

    def _wait(self, writing: bool, timeout: float) -> tuple[bool, bool]:
        """(readable, writable) within ``timeout`` s. After the gateway's close, reading is not waited for:
        the socket would stay readable (at its end) for ever."""
        events = (0 if self.eof else selectors.EVENT_READ) | (selectors.EVENT_WRITE if writing else 0)
        if not events:
            return False, False
        self._selector.modify(self._sock, events)
        ready = self._selector.select(timeout)
        mask = ready[0][1] if ready else 0
        return bool(mask & selectors.EVENT_READ), bool(mask & selectors.EVENT_WRITE)

    def _attempt(self, operation: Callable[[_A], _T], argument: _A, doing: str) -> _T | None:
        """``operation(argument)`` on the non-blocking socket: None when it would block (or was interrupted); a failure
        of the connection raised as `IngestProtocolError`."""
        try:
            return operation(argument)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            raise IngestProtocolError(f"connection to the gateway failed while {doing}: {exc}") from exc

    def _read(self) -> None:
        data = self._attempt(self._sock.recv, READ_SIZE, "reading")
        if data is None:
            return
        self.eof = not data
        self.received(data)


class IngestConnection:
    """A blocking ingest connection at the answer level. With a ``token``, the auth line is sent first and
    its ``authed`` awaited (`AuthRefused` otherwise). Answers are queued as they are read; take them with
    `next_answer`, or `sync`, which skips to its ``synced`` and keeps the error answers met on the way in
    `errors`. Use as a context manager.
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, token: str | None = None, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self.timeout = timeout
        self.reader = AnswerReader()
        #: answers read and not taken yet
        self.answers: deque[Answer] = deque()
        #: error answers `sync` went past
        self.errors: list[ErrorAnswer] = []
        self.socket = IngestSocket(host, port, self._received, timeout)
        if token is not None:
            try:
                self._authenticate(token)
            except BaseException:
                self.socket.close()
                raise

    def __enter__(self) -> IngestConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.socket.close()

    def write(self, data: bytes) -> None:
        """Write raw bytes (whole lines, or not: a test may cut a line anywhere)."""
        self.socket.write(data)

    def send(self, *records: Any) -> None:
        """Write JSON values, one line each, in one write."""
        self.socket.write(b"".join(map(json_line, records)))

    def poll(self, timeout: float) -> bool:
        """Whether an answer is waiting, reading for up to ``timeout`` seconds for one to come."""
        return self.socket.read_until(lambda: bool(self.answers), timeout)

    def next_answer(self, timeout: float | None = None) -> Answer:
        """The next answer (`Closed` for ever once the gateway closed); `IngestProtocolError` when none
        comes within ``timeout`` seconds (default: the connection's)."""
        if not self.poll(self.timeout if timeout is None else timeout):
            if self.socket.eof:
                return Closed()
            raise IngestProtocolError(f"no answer within {self.timeout if timeout is None else timeout} s")
        return self.answers.popleft()

    def sync(self, sync_id: int | str | None = 1) -> Synced:
        """Write ``{"sync": sync_id}`` and return its answer: every record written before it was applied."""
        self.socket.write(sync_line(sync_id))
        while True:
            answer = self.next_answer()
            if isinstance(answer, ErrorAnswer):
                self.errors.append(answer)
            elif isinstance(answer, Synced) and answer.id == sync_id:
                return answer
            else:
                raise IngestProtocolError(f"waiting for synced {sync_id!r}, got {answer!r}")

    def _received(self, data: bytes) -> None:
        self.answers.extend(self.reader.feed(data))

    def _authenticate(self, token: str) -> None:
        self.socket.write(auth_line(token))
        answer = self.next_answer()
        if isinstance(answer, ErrorAnswer):
            raise AuthRefused(f"{answer.code}: {answer.message}")
        if not isinstance(answer, Authed):
            raise IngestProtocolError(f"the auth line was answered {answer!r}")


# -- asyncio ------------------------------------------------------------------------------------------------


class AsyncIngestConnection(asyncio.Protocol):
    """The asyncio variant: ``write`` lines (buffered by the transport), ``await drain()`` to respect flow
    control (it waits while the transport holds more than ``write_high_water`` bytes), ``await sync(id)``.
    Error answers and undecodable lines go to ``on_error`` as they arrive, so that a publisher of millions
    of records keeps counts rather than a list.

    Open with ``loop.create_connection(lambda: AsyncIngestConnection(on_error), host, port)``. Once the
    connection is lost, ``write``, ``drain`` and pending ``sync``s raise ``ConnectionError``.
    """

    def __init__(self, on_error: Callable[[ErrorAnswer | BadAnswer], None], write_high_water: int | None = None) -> None:
        self.on_error = on_error
        self.write_high_water = write_high_water
        self.reader = AnswerReader()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None
        self._synced: dict[int | str | None, asyncio.Future[Synced]] = {}
        self._can_write = asyncio.Event()
        self._can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.write_high_water is not None:
            transport.set_write_buffer_limits(high=self.write_high_water)  # type: ignore[attr-defined]  # a stream's
        # uvloop's transports are not asyncio.Transport subclasses
        self.transport = transport  # type: ignore[assignment]

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("ingest connection closed")
        self._can_write.set()
        for future in self._synced.values():
            if not future.done():
                future.set_exception(self.lost)

    def data_received(self, data: bytes) -> None:
        for answer in self.reader.feed(data):
            if isinstance(answer, Synced):
                future = self._synced.pop(answer.id, None)
                if future is not None and not future.done():
                    future.set_result(answer)
            elif isinstance(answer, (ErrorAnswer, BadAnswer)):
                self.on_error(answer)

    def write(self, data: bytes) -> None:
        if self.lost is not None or self.transport is None:
            raise ConnectionError(f"ingest connection lost: {self.lost}")
        self.transport.write(data)

    async def drain(self) -> None:
        await self._can_write.wait()
        if self.lost is not None:
            raise ConnectionError(f"ingest connection lost: {self.lost}")

    async def sync(self, sync_id: int | str | None, timeout: float) -> Synced:
        """Write ``{"sync": sync_id}`` and wait up to ``timeout`` seconds for its answer."""
        future: asyncio.Future[Synced] = asyncio.get_running_loop().create_future()
        self._synced[sync_id] = future
        self.write(sync_line(sync_id))
        async with asyncio.timeout(timeout):
            return await future

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

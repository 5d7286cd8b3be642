"""fanout_client.ingest against a hostile ingest server on 127.0.0.1 (issue 34, item 12): an answer line that
never ends is refused once it passes the bound (`BadAnswer`, then `IngestProtocolError` for the blocking
connection), and the client holds at most that bound of it, whatever the server sends after."""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import fanout_client.ingest as ingest
from fanout_client.ingest import AsyncIngestConnection, BadAnswer, ErrorAnswer, IngestConnection, IngestProtocolError

pytestmark = pytest.mark.timeout(60)

#: what the server sends: far more than the bound, without a newline
ENDLESS_BYTES = 32 << 20
LIMIT = getattr(ingest, "MAX_ANSWER_LINE_BYTES", 1 << 20)


def _buffered(reader: ingest.AnswerReader) -> int:
    return int(getattr(reader, "buffered", len(getattr(reader, "_buffer", b""))))


@contextmanager
def endless_line_server() -> Iterator[tuple[int, threading.Event]]:
    """A server answering each connection with ENDLESS_BYTES of one line that never ends (then it holds the
    connection open); the event is set once everything was sent."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent_all = threading.Event()
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                chunk = b"x" * 65536
                try:
                    for _ in range(ENDLESS_BYTES // len(chunk)):
                        conn.sendall(chunk)
                except OSError:
                    pass  # the client gave up: what we want
                sent_all.set()
                while not stop.wait(0.05):
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], sent_all
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_the_blocking_connection_refuses_an_answer_line_that_never_ends() -> None:
    with endless_line_server() as (port, _), IngestConnection("127.0.0.1", port, timeout=5) as conn:
        started = time.monotonic()
        with pytest.raises(IngestProtocolError, match="longer than"):
            conn.sync(1)
        assert time.monotonic() - started < 4
        assert _buffered(conn.reader) <= LIMIT


def test_the_asyncio_connection_reports_an_answer_line_that_never_ends_once() -> None:
    async def main() -> None:
        errors: list[ErrorAnswer | BadAnswer] = []
        with endless_line_server() as (port, sent_all):
            loop = asyncio.get_running_loop()
            _, conn = await loop.create_connection(lambda: AsyncIngestConnection(errors.append), "127.0.0.1", port)
            try:
                conn.write(ingest.sync_line(1))
                async with asyncio.timeout(20):
                    while not sent_all.is_set() or _pending(conn):  # until we read all the server sent
                        await asyncio.sleep(0.01)
                        assert _buffered(conn.reader) <= LIMIT
                await asyncio.sleep(0.2)
                assert _buffered(conn.reader) <= LIMIT
                assert len(errors) == 1 and isinstance(errors[0], BadAnswer), errors
                assert "longer than" in errors[0].reason and len(errors[0].text) <= 200
            finally:
                conn.close()

    asyncio.run(main())


def _pending(conn: AsyncIngestConnection) -> bool:
    """Whether the kernel still holds bytes for us to read."""
    assert conn.transport is not None
    sock = conn.transport.get_extra_info("socket")
    raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, struct.pack("i", 0))
    return bool(struct.unpack("i", raw)[0])

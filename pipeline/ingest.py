"""The pipeline's side of the gateway's TCP ingest (docs/protocol.md, "TCP ingest"), for one connection:
exactly-once accounting over the gateway's ingest client (gateway/ingest_client.py).

Two layers, as in h11 / websockets:

* :class:`IngestClient` is sans-I/O: it turns records into line-delimited JSON bytes, checks the gateway's
  answers (bytes fed to :meth:`IngestClient.receive_data`, decoded by the shared ``AnswerReader``), and
  decides whether the connection ended well. It never touches a socket or a clock.
* :class:`IngestConnection` is the blocking adapter over the shared ``IngestSocket``: ``send`` a chunk,
  ``sync`` and wait, with the answers read concurrently with the writes (the gateway may answer every record
  of a retried batch with an error line, so a writer that does not read could deadlock against a gateway
  blocked on writing to us), all bounded by timeouts. :func:`publish` is what a Spark task calls once per
  partition: one connection, records written in chunks, one ``{"sync": id}`` at the end.

Neither imports Spark: the module runs inside Python workers and in plain tests.

Error split (whose fault):

* :class:`IngestRefused`: the gateway answered a record with an error other than ``duplicate_seq`` /
  ``stale_seq`` (for instance ``unknown_topic``, ``forbidden``, ``queue_full``). Carries the gateway's code,
  line number and message.
* :class:`IngestProtocolError`: the gateway misbehaved or went away: an answer that is not JSON, a ``synced``
  whose counts do not add up, the connection closed before ``synced``, or a timeout.
* :class:`ValueError`: our own input is wrong (a record without a topic, ``data`` that is not JSON text).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

import orjson

from gateway.ingest_client import (
    DEFAULT_PORT,
    DEFAULT_TIMEOUT,
    Answer,
    AnswerReader,
    BadAnswer,
    Closed,
    ErrorAnswer,
    IngestError,
    IngestProtocolError,
    IngestSocket,
    Synced,
    record_line,
    sync_line,
)

__all__ = [
    "ALREADY_LANDED",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT",
    "IngestClient",
    "IngestConnection",
    "IngestError",
    "IngestProtocolError",
    "IngestRefused",
    "Record",
    "SyncResult",
    "chunks",
    "encode_record",
    "publish",
]

#: Lines per write. 500 lines of ~100 bytes is ~50 KB: large enough that the per-write cost (a syscall, a
#: wake-up of the gateway's reader) is amortised, small enough to stay well under a default socket buffer
#: (~200 KB on Linux) so a chunk usually leaves in one send. It is also the unit of interleaving between
#: concurrent partitions, hence of the reorder window needed in spread mode (docs/pipeline.md).
DEFAULT_CHUNK_SIZE = 500

#: Error codes meaning "this record is already there" (a retried batch with explicit seqs): not a failure.
ALREADY_LANDED = frozenset({"duplicate_seq", "stale_seq"})

#: A record: (topic, seq or None, data as JSON text or None). ``None`` seq lets the gateway assign one.
Record = tuple[str, int | None, str | None]


class IngestRefused(IngestError):
    """The gateway refused a record for a reason other than "already landed"."""

    def __init__(self, code: str, line: int | None, message: str) -> None:
        super().__init__(f"gateway refused line {line}: {code}: {message}")
        self.code = code
        self.line = line
        self.message = message


@dataclass(frozen=True, slots=True)
class SyncResult:
    """The gateway's ``synced`` counts, checked against what we sent, summed over the connection's syncs."""

    #: The last sync's id.
    sync_id: int
    #: Records written before it.
    records: int
    #: Sum of the gateway's ``accepted``.
    accepted: int
    #: Sum of the gateway's ``refused``; all of them ``duplicate_seq`` or ``stale_seq`` (else we raised).
    refused: int
    #: Of ``refused``: answered ``duplicate_seq`` (the seq is there or waiting in the reorder window).
    duplicates: int = 0
    #: Of ``refused``: answered ``stale_seq`` (below the topic's available end: published before, *or a hole
    #: the gateway gave up*, see docs/pipeline.md).
    stale: int = 0


class State(enum.Enum):
    """Where an :class:`IngestClient` is; transitions happen only in :meth:`IngestClient.sync` and
    :meth:`IngestClient.receive_data`."""

    #: Records and a sync may be encoded.
    SENDING = "sending"
    #: A sync line was produced; waiting for its ``synced``. No records meanwhile.
    SYNC_SENT = "sync_sent"
    #: An error was raised from :meth:`IngestClient.receive_data`; the connection is useless.
    FAILED = "failed"


def encode_record(topic: str, seq: int | None, data: str | None) -> bytes:
    """One ingest line (with its newline) for a record whose ``data`` is JSON text.

    ``data`` is parsed and re-encoded rather than spliced: text that is not one JSON value (a stray newline,
    ``1, "client": "x"``) must not be able to break the line framing or add fields. Raises ``ValueError``.
    """
    if topic is None:
        raise ValueError("record without a topic")
    try:
        value = None if data is None else orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"record topic={topic!r} seq={seq!r}: data is not JSON text: {exc}") from None
    return record_line(topic, value, seq=seq)


class IngestClient:
    """The client half of one ingest connection, without I/O.

    Calling contract: write the bytes of :meth:`encode_records` (any number of calls) in order, then the
    bytes of :meth:`sync`; feed every byte read from the connection to :meth:`receive_data` as it arrives. It
    raises :class:`IngestRefused` or :class:`IngestProtocolError` at the first answer that makes the
    connection a failure. Once :attr:`awaiting_sync` is false again, :attr:`result` holds the checked counts
    so far, and more records and syncs may follow.
    """

    def __init__(self) -> None:
        self.state = State.SENDING
        #: Lines written so far (records and sync lines): the gateway numbers lines from 1.
        self.lines = 0
        #: Records written so far.
        self.records = 0
        #: ``duplicate_seq`` / ``stale_seq`` answers received so far.
        self.duplicates = 0
        self.stale = 0
        #: Counts as of the last ``synced``; ``None`` before the first.
        self.result: SyncResult | None = None
        self._sync_id: int | None = None
        self._reader = AnswerReader()

    @property
    def already_landed(self) -> int:
        return self.duplicates + self.stale

    @property
    def awaiting_sync(self) -> bool:
        return self.state is State.SYNC_SENT

    @property
    def done(self) -> bool:
        """Every sync written was answered (and at least one was)."""
        return self.state is State.SENDING and self.result is not None and self.result.records == self.records

    def encode_records(self, records: Iterable[Record]) -> bytes:
        """The bytes for ``records``, one line each. Raises ``ValueError`` for a malformed record."""
        if self.state is not State.SENDING:
            raise RuntimeError(f"cannot send records in state {self.state.value}")
        lines = [encode_record(topic, seq, data) for topic, seq, data in records]
        self.lines += len(lines)
        self.records += len(lines)
        return b"".join(lines)

    def sync(self, sync_id: int) -> bytes:
        """The sync line; after it, only :meth:`receive_data` until :attr:`awaiting_sync` is false."""
        if self.state is not State.SENDING:
            raise RuntimeError(f"cannot sync in state {self.state.value}")
        self.state = State.SYNC_SENT
        self._sync_id = sync_id
        self.lines += 1
        return sync_line(sync_id)

    def receive_data(self, data: bytes) -> None:
        """Feed bytes read from the connection; ``b""`` means the gateway closed it."""
        if self.state is State.FAILED:
            raise RuntimeError("connection already failed")
        try:
            for answer in self._reader.feed(data):
                self._answer(answer)
        except IngestError:
            self.state = State.FAILED
            raise

    def _closed(self) -> None:
        if self.done:
            return
        raise IngestProtocolError(
            f"gateway closed the connection before answering the sync "
            f"({self.records} records written, {self.already_landed} answered as already landed)"
        )

    def _answer(self, answer: Answer) -> None:
        if isinstance(answer, ErrorAnswer):
            self._error(answer)
        elif isinstance(answer, Synced):
            self._synced(answer)
        elif isinstance(answer, Closed):
            self._closed()
        elif isinstance(answer, BadAnswer):
            raise IngestProtocolError(f"gateway answered a line that is not an answer ({answer.reason}): "
                                      f"{answer.text[:200]!r}")
        # Authed: we send no auth line, and the answer changes nothing.

    def _error(self, answer: ErrorAnswer) -> None:
        if answer.code == "duplicate_seq":
            self.duplicates += 1
        elif answer.code == "stale_seq":
            self.stale += 1
        else:
            raise IngestRefused(answer.code, answer.line, answer.message)

    def _synced(self, answer: Synced) -> None:
        if self.state is not State.SYNC_SENT or answer.id != self._sync_id:
            raise IngestProtocolError(f"unexpected synced answer {answer!r} (our sync id {self._sync_id!r})")
        accepted, refused = answer.accepted, answer.refused
        before = self.result or SyncResult(0, 0, 0, 0)
        records = self.records - before.records
        landed = self.already_landed - before.refused
        if accepted + refused != records:
            raise IngestProtocolError(
                f"gateway synced {accepted} accepted + {refused} refused, but {records} records were written"
            )
        if refused != landed:
            raise IngestProtocolError(
                f"gateway refused {refused} records but answered {landed} of them as duplicate_seq/stale_seq"
            )
        self.result = SyncResult(
            self._sync_id, self.records, before.accepted + accepted, self.already_landed, self.duplicates, self.stale
        )
        self.state = State.SENDING


def chunks(records: Iterable[Record], size: int) -> Iterator[list[Record]]:
    """``records`` in lists of ``size`` (the last one shorter)."""
    if size < 1:
        raise ValueError("chunk size must be >= 1")
    iterator = iter(records)
    while chunk := list(islice(iterator, size)):
        yield chunk


class IngestConnection:
    """A blocking ingest connection (the shared ``IngestSocket`` feeding :class:`IngestClient`).

    ``send`` writes one chunk of records as one write (a "sendall" that keeps reading answers meanwhile, so
    an early error line fails the write); ``sync`` writes a sync line and waits for its answer, returning the
    counts so far. Use as a context manager; raises as :func:`publish` does.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout
        self.client = IngestClient()
        self._socket = IngestSocket(host, port, self.client.receive_data, timeout)

    def __enter__(self) -> IngestConnection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._socket.close()

    def send(self, records: Iterable[Record]) -> None:
        self._socket.write(self.client.encode_records(records))

    def sync(self, sync_id: int) -> SyncResult:
        self._socket.write(self.client.sync(sync_id))
        if not self._socket.read_until(lambda: not self.client.awaiting_sync, self.timeout):
            raise IngestProtocolError(
                f"no synced answer within {self.timeout} s ({self.client.records} records written, "
                f"{self.client.already_landed} answered as already landed)"
            )
        assert self.client.result is not None
        return self.client.result

def publish(
    records: Iterable[Record],
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    sync_id: int = 1,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    timeout: float = DEFAULT_TIMEOUT,
) -> SyncResult:
    """Publish ``records`` over one new connection and return the checked ``synced`` counts.

    Records are written ``chunk_size`` lines at a time; answers are read whenever the socket is readable, so
    an early error line fails the call without writing the rest. Raises :class:`IngestRefused`,
    :class:`IngestProtocolError` (including timeouts: ``timeout`` seconds without progress while writing, or
    ``timeout`` seconds for the ``synced`` answer), ``OSError`` for a connection that cannot be made, and
    ``ValueError`` for a malformed record. Nothing is published for an empty ``records`` except the sync.
    """
    with IngestConnection(host, port, timeout) as connection:
        for chunk in chunks(records, chunk_size):
            connection.send(chunk)
        return connection.sync(sync_id)

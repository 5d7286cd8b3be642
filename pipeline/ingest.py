"""The pipeline's side of the gateway's TCP ingest (docs/protocol.md, "TCP ingest"), for one connection:
exactly-once accounting over the ingest client (fanout_client/ingest.py).

Two layers, as in h11 / websockets:

* :class:`IngestClient` is sans-I/O: it turns records into line-delimited JSON bytes, checks the gateway's
  answers (bytes fed to :meth:`IngestClient.receive_data`, decoded by the shared ``AnswerReader``), and
  decides whether the connection ended well. It never touches a socket or a clock.
* :class:`PipelineIngestSender` is the blocking adapter over the shared ``IngestSocket``: ``send`` a chunk,
  ``sync`` and wait, with the answers read concurrently with the writes (the gateway may answer every record
  of a retried batch with an error line, so a writer that does not read could deadlock against a gateway
  blocked on writing to us), all bounded by timeouts. :func:`publish` is what a Spark task calls once per
  partition: one connection, records written in chunks, one ``{"sync": id}`` at the end.

Neither imports Spark: the module runs inside Python workers and in plain tests.

:class:`Publisher` is what a Spark task uses: it writes a partition in groups of chunks, syncs after each
group, and when the connection fails (the gateway restarts, a reset, a timeout) reconnects with bounded
backoff and writes again exactly the records whose fate it does not know (the gateway answers lines in
order, so every line before the last answer was processed). It returns a :class:`PartitionOutcome`: what
was accepted, and which seqs were answered ``duplicate_seq`` / ``stale_seq`` / ``skipped_seq``, which the
driver turns into "delivered" and "lost" (:mod:`pipeline.ledger`).

Answers a record may get that are not failures of the connection:

* ``duplicate_seq`` / ``stale_seq``: the seq is already there (a retried batch): landed before;
* ``skipped_seq``: the seq came after the gateway gave its hole up: **lost** (subscribers were told).

Error split (whose fault):

* :class:`IngestRefused`: the gateway answered a record with any other error (for instance
  ``unknown_topic``, ``forbidden``, ``too_large``). Carries the gateway's code, line number, message and the
  record's topic and seq.
* :class:`IngestProtocolError`: the gateway misbehaved: an answer that is not JSON, a ``synced`` whose
  counts do not add up. Its subclass :class:`ConnectionLost`: the connection closed before ``synced``, failed,
  or timed out (retried by :class:`Publisher`).
* :class:`ValueError`: our own input is wrong (a record without a topic, ``data`` that is not JSON text).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice

import orjson

from fanout_client.ingest import (
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
from pipeline.errors import GatewayUnreachable
from pipeline.retry import DEFAULT_RETRY, RetryPolicy

__all__ = [
    "ALREADY_LANDED",
    "LOST",
    "ConnectionLost",
    "PartitionOutcome",
    "PipelineIngestSender",
    "Publisher",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT",
    "IngestClient",
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
#: Error codes meaning "this record came too late and is lost": counted, reported, never a success.
LOST = frozenset({"skipped_seq"})
#: Answers that are facts about a record's seq, not failures of the connection.
SEQ_ANSWERS = ALREADY_LANDED | LOST

#: Records written between two syncs by :class:`Publisher`: what is written again after a reconnect at most.
DEFAULT_SYNC_EVERY = 10_000

log = logging.getLogger(__name__)

#: A record: (topic, seq or None, data as JSON text or None). ``None`` seq lets the gateway assign one.
Record = tuple[str, int | None, str | None]


class IngestRefused(IngestError):
    """The gateway refused a record for a reason other than "already landed" or "lost"."""

    def __init__(self, code: str, line: int | None, message: str, record: Record | None = None) -> None:
        where = f" (topic {record[0]!r}, seq {record[1]})" if record is not None else ""
        super().__init__(f"gateway refused line {line}{where}: {code}: {message}")
        self.code = code
        self.line = line
        self.message = message
        self.record = record


class ConnectionLost(IngestProtocolError):
    """The connection closed, failed or timed out before the gateway answered: worth a reconnect."""


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
    #: Of ``refused``: answered ``stale_seq`` (below the topic's available end: published before; with a
    #: gateway that does not remember given-up seqs, possibly also a hole given up and gone from the ring).
    stale: int = 0
    #: Of ``refused``: answered ``skipped_seq`` (its hole was given up: lost).
    skipped: int = 0


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
        #: ``duplicate_seq`` / ``stale_seq`` / ``skipped_seq`` answers received so far.
        self.duplicates = 0
        self.stale = 0
        self.skipped = 0
        #: Counts as of the last ``synced``; ``None`` before the first.
        self.result: SyncResult | None = None
        #: Every seq answer so far: (line, record, code).
        self.refusals: list[tuple[int, Record, str]] = []
        #: The gateway processed every line up to this one (answers come in line order).
        self.answered_line = 0
        self._sync_id: int | None = None
        self._sync_line = 0
        self._pending_sync_line = 0
        #: line -> record, for the records written since the last ``synced``
        self._window: dict[int, Record] = {}
        self._reader = AnswerReader()

    @property
    def already_landed(self) -> int:
        return self.duplicates + self.stale

    @property
    def refused(self) -> int:
        return self.duplicates + self.stale + self.skipped

    def unanswered(self) -> list[Record]:
        """Records written since the last ``synced`` whose line the gateway may not have processed yet, in
        order: what to write again on a new connection when this one fails."""
        return [record for line, record in self._window.items() if line > self.answered_line]

    def answered_since_sync(self) -> tuple[int, list[tuple[int, Record, str]]]:
        """(records accepted, seq answers) among the records written since the last ``synced`` whose line
        was processed: what is known of them when the connection fails before the next ``synced``."""
        first = self._sync_line
        refusals = [r for r in self.refusals if r[0] > first]
        processed = sum(1 for line in self._window if line <= self.answered_line)
        return processed - len(refusals), refusals

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
        records = list(records)
        lines = [encode_record(topic, seq, data) for topic, seq, data in records]
        for record in records:
            self.lines += 1
            self._window[self.lines] = record
        self.records += len(lines)
        return b"".join(lines)

    def sync(self, sync_id: int) -> bytes:
        """The sync line; after it, only :meth:`receive_data` until :attr:`awaiting_sync` is false."""
        if self.state is not State.SENDING:
            raise RuntimeError(f"cannot sync in state {self.state.value}")
        self.state = State.SYNC_SENT
        self._sync_id = sync_id
        self.lines += 1
        self._pending_sync_line = self.lines
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
        raise ConnectionLost(
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
            raise IngestProtocolError(f"gateway answered a line that is not an answer ({answer.reason}): {answer.text[:200]!r}")
        # Authed: we send no auth line, and the answer changes nothing.

    def _error(self, answer: ErrorAnswer) -> None:
        record = self._window.get(answer.line)
        if answer.code not in SEQ_ANSWERS:
            raise IngestRefused(answer.code, answer.line, answer.message, record)
        if record is None:
            raise IngestProtocolError(
                f"gateway answered {answer.code} for line {answer.line}, which is no record of ours awaiting an answer"
            )
        if answer.code == "duplicate_seq":
            self.duplicates += 1
        elif answer.code == "stale_seq":
            self.stale += 1
        else:
            self.skipped += 1
        self.refusals.append((answer.line, record, answer.code))
        self.answered_line = max(self.answered_line, answer.line)

    def _synced(self, answer: Synced) -> None:
        if self.state is not State.SYNC_SENT or self._sync_id is None or answer.id != self._sync_id:
            raise IngestProtocolError(f"unexpected synced answer {answer!r} (our sync id {self._sync_id!r})")
        accepted, refused = answer.accepted, answer.refused
        before = self.result or SyncResult(0, 0, 0, 0)
        records = self.records - before.records
        landed = self.refused - before.refused
        if accepted + refused != records:
            raise IngestProtocolError(
                f"gateway synced {accepted} accepted + {refused} refused, but {records} records were written"
            )
        if refused != landed:
            raise IngestProtocolError(
                f"gateway refused {refused} records but answered {landed} of them as duplicate_seq/stale_seq/skipped_seq"
            )
        self.result = SyncResult(
            self._sync_id,
            self.records,
            before.accepted + accepted,
            self.refused,
            self.duplicates,
            self.stale,
            self.skipped,
        )
        self._sync_line = self.answered_line = self._pending_sync_line
        self._window.clear()
        self.state = State.SENDING


def chunks(records: Iterable[Record], size: int) -> Iterator[list[Record]]:
    """``records`` in lists of ``size`` (the last one shorter)."""
    if size < 1:
        raise ValueError("chunk size must be >= 1")
    iterator = iter(records)
    while chunk := list(islice(iterator, size)):
        yield chunk


class PipelineIngestSender:
    """A blocking ingest connection (the shared ``IngestSocket`` feeding :class:`IngestClient`).

    ``send`` writes one chunk of records as one write (a "sendall" that keeps reading answers meanwhile, so
    an early error line fails the write); ``sync`` writes a sync line and waits for its answer, returning the
    counts so far. Use as a context manager; raises as :func:`publish` does.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout
        self.client = IngestClient()
        self._socket = IngestSocket(host, port, self.client.receive_data, timeout)

    def __enter__(self) -> PipelineIngestSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._socket.close()

    def send(self, records: Iterable[Record]) -> None:
        self._socket.write(self.client.encode_records(records))

    def sync(self, sync_id: int) -> SyncResult:
        self._socket.write(self.client.sync(sync_id))
        if not self._socket.read_until(lambda: not self.client.awaiting_sync, self.timeout):
            if self._socket.eof:
                self.client.receive_data(b"")  # raises ConnectionLost
            raise ConnectionLost(
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
    with PipelineIngestSender(host, port, timeout) as connection:
        for chunk in chunks(records, chunk_size):
            connection.send(chunk)
        return connection.sync(sync_id)


# -- a partition, with reconnects ---------------------------------------------------------------------------


def retryable(exc: BaseException) -> bool:
    """Whether a failure of an ingest connection is worth a new connection: it could not be made, it broke,
    or the gateway stopped answering (a restart); not a refusal or a protocol violation."""
    if isinstance(exc, (ConnectionLost, OSError)):
        return True
    if isinstance(exc, IngestProtocolError):
        return isinstance(exc.__cause__, OSError) or "neither read nor answered" in str(exc)
    return False


def compress(seqs: Iterable[int]) -> list[tuple[int, int, int]]:
    """Sorted distinct seqs as runs ``(start, step, count)``: a spread partition's seqs (every n-th) and a
    topic's contiguous range are one run each."""
    runs: list[list[int]] = []
    for seq in sorted(set(seqs)):
        if runs:
            start, step, count = runs[-1]
            last = start + step * (count - 1)
            if count == 1 and seq > start:
                runs[-1] = [start, seq - start, 2]
                continue
            if seq - last == step:
                runs[-1][2] += 1
                continue
        runs.append([seq, 1, 1])
    return [(start, step, count) for start, step, count in runs]


def expand(runs: Iterable[tuple[int, int, int]]) -> Iterator[int]:
    for start, step, count in runs:
        yield from range(start, start + step * count, step)


@dataclass
class PartitionOutcome:
    """What one Spark task's publishing did, returned to the driver (picklable, small: seqs as runs)."""

    #: distinct records handed to the gateway (a record written again after a reconnect counts once)
    records: int = 0
    accepted: int = 0
    #: ``duplicate_seq`` / ``stale_seq`` answers to records written again after a reconnect: they had landed
    #: on the connection that broke
    landed_on_resend: int = 0
    #: (topic, code) -> seqs as runs, for the seq answers to records written for the first time in this task
    refusals: dict[tuple[str, str], list[tuple[int, int, int]]] = field(default_factory=dict)
    #: seqs answered ``skipped_seq`` when written again after a reconnect, (topic) -> runs
    lost_on_resend: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    #: records without a seq written again after a reconnect (they may have been published twice)
    unsequenced_resent: int = 0
    reconnects: int = 0
    #: records skipped because the same (topic, seq) came right before in the partition
    input_duplicates: int = 0

    def counts(self) -> dict[str, int]:
        refused: dict[str, int] = {}
        for (_topic, code), runs in self.refusals.items():
            refused[code] = refused.get(code, 0) + sum(r[2] for r in runs)
        return {"records": self.records, "accepted": self.accepted, **refused}


class Publisher:
    """Publishes groups of records over one ingest connection at a time, syncing after each group; when
    the connection fails, reconnects (bounded backoff, ``retry``) and writes again the records whose lines
    the gateway had not processed. Raises :class:`IngestRefused`, :class:`IngestProtocolError` (not
    retryable), :class:`GatewayUnreachable` (the retries ran out) and ``ValueError`` (a malformed record)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy = DEFAULT_RETRY,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        sync_base: int = 0,
    ) -> None:
        self.host = host
        self.port = port
        self.chunk_size = chunk_size
        self.timeout = timeout
        self.retry = retry
        self.outcome = PartitionOutcome()
        self._sync_id = sync_base
        self._settled_accepted = 0
        self._connection: PipelineIngestSender | None = None
        self._refused: dict[tuple[str, str], list[int]] = {}
        self._lost_on_resend: dict[str, list[int]] = {}

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def publish(self, records: list[Record]) -> None:
        """Write ``records`` (one write per ``chunk_size`` lines) and sync; on return the gateway has processed
        every one of them."""
        self.outcome.records += len(records)
        resent = 0  # the first `resent` of `records` were written on a connection that broke
        delays = self.retry.delays()
        started = time.monotonic()
        while records:
            handed = 0  # records given to this connection: a write that fails still holds its chunk
            try:
                if self._connection is None:
                    self._connection = PipelineIngestSender(self.host, self.port, self.timeout)
                for chunk in chunks(records, self.chunk_size):
                    handed += len(chunk)
                    self._connection.send(chunk)
                self._sync_id = (self._sync_id + 1) % (1 << 53)
                self._connection.sync(self._sync_id)
                self._settle(self._connection.client, resent, complete=True)
                return
            except Exception as exc:
                if not retryable(exc):
                    self.close()
                    raise
                client = self._connection.client if self._connection is not None else None
                self.close()
                if client is not None and client.records:
                    # what the gateway may not have read, then what was never written (the connection broke
                    # while the chunks were being written)
                    again = self._settle(client, resent, complete=False)
                    self.outcome.unsequenced_resent += sum(1 for r in again if r[1] is None)
                    records, resent = again + records[handed:], len(again)
                delay = next(delays, None)
                if delay is None:
                    raise GatewayUnreachable(
                        f"cannot reach the gateway's ingest at {self.host}:{self.port} "
                        f"({self.retry.attempts} retries over {time.monotonic() - started:.0f} s): {exc}"
                    ) from exc
                self.outcome.reconnects += 1
                log.warning("ingest %s:%s: %s; reconnecting in %.1f s", self.host, self.port, exc, delay)
                time.sleep(delay)

    def _settle(self, client: IngestClient, resent: int, complete: bool) -> list[Record]:
        """Fold what ``client`` learnt into the outcome; the records to write again (none when complete)."""
        if complete:
            assert client.result is not None
            # the connection's counts are cumulative over its syncs; earlier groups were settled already
            accepted = client.result.accepted - self._settled_accepted
            self._settled_accepted = client.result.accepted
            again: list[Record] = []
        else:
            accepted, _ = client.answered_since_sync()
            again = client.unanswered()
            self._settled_accepted = 0  # the next connection counts from 0
        self.outcome.accepted += accepted
        for line, (topic, seq, _data), code in client.refusals:
            if seq is None:
                continue
            if line <= resent:  # written before, on a connection that broke (a fresh one numbers from 1)
                if code in ALREADY_LANDED:
                    self.outcome.landed_on_resend += 1
                else:
                    self._lost_on_resend.setdefault(topic, []).append(seq)
            else:
                self._refused.setdefault((topic, code), []).append(seq)
        # a new connection starts its own line numbering and refusal list
        client.refusals = []
        return again

    def finish(self) -> PartitionOutcome:
        """Close the connection; the outcome with its seqs compressed into runs."""
        self.close()
        self.outcome.refusals = {key: compress(seqs) for key, seqs in self._refused.items()}
        self.outcome.lost_on_resend = {topic: compress(seqs) for topic, seqs in self._lost_on_resend.items()}
        return self.outcome

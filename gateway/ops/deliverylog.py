"""A sampled log of what the gateway delivered, for the live audit (`python -m pipeline audit --follow`).

Config section `[deliverylog]` (off by default). When on, the scheduler stamps each publish (`Membership.apply`:
`DeliveryLog.published`) and makes one call per delivered batch (`Scheduler._deliver`):
`DeliveryLog.delivered(batch, conn)`, which only decides whether the client is sampled (a
cached hash of its id) and, if so, appends a reference to the batch's entries to an in-memory queue. A
writer thread does the rest off the event loop: it picks the message entries (`{"type":"msg",...}`) out of
each batch, and writes one JSON line per delivered message:

    {"client": ID, "transport": "ws", "topic": T, "seq": N, "publish_ns": P, "deliver_ns": D, "batch_id": B}

`deliver_ns` is the wall-clock time the batch was handed to the client's transport (a batch staged for a
scheduler round, gateway/transports/staging.py, is stamped by `written` when the round writes it); `publish_ns` the time
the engine accepted the message (`Hub.publish` stamps (topic, seq) when the log is enabled;
null when the stamp is gone, `max_publish_stamps` later); `batch_id` numbers the logged batches.

Sampling is per client (`sample_rate` of the clients, chosen by a hash of the client id, so the same clients
for the whole run): every delivery of a sampled client is logged, so its loss, gaps and rate are complete;
skew is among sampled clients.

Files: `directory/.deliveries-<instance>-<n>.jsonl` while written (hidden: Spark's file source skips it),
renamed `deliveries-<instance>-<n>.jsonl` once complete, every `rotate_s` seconds or `rotate_bytes` bytes;
beyond `max_files` complete files the oldest are deleted. The queue is bounded (`max_queue` batches): beyond
it batches are dropped and counted (`dropped_batches`), never waited for.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, BinaryIO

import orjson

log = logging.getLogger(__name__)

_MSG = re.compile(rb'^\{"type":"msg","topic":("(?:[^"\\]|\\.)*"),"seq":(\d+),')
_NOT_SAMPLED = ""
_CACHE_LIMIT = 100_000


class DeliveryLog:
    def __init__(self, config: Any, instance: str = "0", stopped: Callable[[], bool] = lambda: False) -> None:
        """`stopped`: whether the scheduler has ended (the writer thread then ends too)."""
        self.sample_rate = float(config.sample_rate)
        self.directory = Path(config.directory)
        self.rotate_s = float(config.rotate_s)
        self.rotate_bytes = int(config.rotate_bytes)
        self.max_files = int(config.max_files)
        self.flush_interval_s = float(config.flush_interval_s)
        self.max_queue = int(config.max_queue)
        self.max_stamps = int(config.max_publish_stamps)
        self.instance = instance
        self.directory.mkdir(parents=True, exist_ok=True)
        self.dropped_batches = 0
        self.written_rows = 0
        self._stopped = stopped
        self._queue: collections.deque[tuple[int, Hashable, str, list[bytes]]] = collections.deque()
        self._sampled: dict[Hashable, str] = {}
        #: sampled batches staged in a round, by connection, until `written` (at most a round's worth)
        self._unwritten: dict[Any, list[tuple[Hashable, str, list[bytes]]]] = {}
        self._stamps: dict[tuple[str, int], int] = {}
        self._batch_id = 0
        self._file: BinaryIO | None = None
        self._file_path: Path | None = None
        self._file_started = 0.0
        self._file_bytes = 0
        self._files = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deliverylog", daemon=True)
        self._thread.start()

    # -- event loop side: cheap -------------------------------------------------------------------------
    def delivered(self, batch: Any, conn: Any, staged: bool = False) -> None:
        """`staged`: the batch waits in `conn` for the round's write, which stamps it (`written`)."""
        transport = self._sampled.get(batch.client_id)
        if transport is None:
            transport = self._sample(batch.client_id, conn)
        if transport is _NOT_SAMPLED:
            return
        if staged:
            self._unwritten.setdefault(conn, []).append((batch.client_id, transport, batch.entries))
            return
        self._enqueue(time.time_ns(), batch.client_id, transport, batch.entries)

    def written(self, conn: Any) -> None:
        """`conn`'s staged batches were handed to its transport (or dropped with it): stamp them now."""
        batches = self._unwritten.pop(conn, None)
        if batches:
            now = time.time_ns()
            for client_id, transport, entries in batches:
                self._enqueue(now, client_id, transport, entries)

    def _enqueue(self, deliver_ns: int, client_id: Hashable, transport: str, entries: list[bytes]) -> None:
        if len(self._queue) >= self.max_queue:
            self.dropped_batches += 1
            return
        self._queue.append((deliver_ns, client_id, transport, entries))

    def _sample(self, client_id: Hashable, conn: Any) -> str:
        if len(self._sampled) >= _CACHE_LIMIT:
            self._sampled.clear()
        digest = hashlib.blake2b(str(client_id).encode(), digest_size=8).digest()
        chosen = int.from_bytes(digest, "big") / 2**64 < self.sample_rate
        identity = getattr(conn, "identity", None)
        transport = (getattr(identity, "transport", None) or "?") if chosen else _NOT_SAMPLED
        self._sampled[client_id] = transport
        return transport

    def published(self, topic: str, seq: int) -> None:
        """Stamp (topic, seq) with the time the engine accepted it (called by `Hub.publish`)."""
        stamps = self._stamps
        stamps[(topic, seq)] = time.time_ns()
        if len(stamps) > self.max_stamps:
            del stamps[next(iter(stamps))]

    # -- writer thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._stop.wait(self.flush_interval_s)
                self.flush()
                if self._stopped():
                    break
        except Exception:  # noqa: BLE001 - the log must never take the gateway down
            log.exception("delivery log writer failed; no more deliveries are logged")
        finally:
            self._close_file()

    def flush(self) -> None:
        """Write what is queued (the writer thread calls it every `flush_interval_s`)."""
        lines = []
        stamps = self._stamps
        while self._queue:
            deliver_ns, client_id, transport, entries = self._queue.popleft()
            self._batch_id += 1
            client = str(client_id)
            for entry in entries:
                match = _MSG.match(entry)
                if match is None:
                    continue
                topic = orjson.loads(match.group(1))
                seq = int(match.group(2))
                lines.append(orjson.dumps({
                    "client": client, "transport": transport, "topic": topic, "seq": seq,
                    "publish_ns": stamps.get((topic, seq)), "deliver_ns": deliver_ns, "batch_id": self._batch_id,
                }, option=orjson.OPT_APPEND_NEWLINE))  # fmt: skip
        if lines:
            self._write(b"".join(lines), len(lines))
        elif self._file is not None and time.monotonic() - self._file_started >= self.rotate_s:
            self._close_file()

    def _write(self, data: bytes, rows: int) -> None:
        if self._file is not None and (
            time.monotonic() - self._file_started >= self.rotate_s or self._file_bytes >= self.rotate_bytes
        ):
            self._close_file()
        if self._file is None:
            self._files += 1
            name = f"deliveries-{self.instance}-{time.time_ns() // 1_000_000}-{self._files}.jsonl"
            self._file_path = self.directory / name
            self._file = open(self.directory / f".{name}", "ab")  # noqa: SIM115 - kept open across flushes
            self._file_started = time.monotonic()
            self._file_bytes = 0
        file = self._file
        file.write(data)
        file.flush()
        self._file_bytes += len(data)
        self.written_rows += rows

    def _close_file(self) -> None:
        if self._file is None or self._file_path is None:
            return
        self._file.close()
        self._file = None
        os.replace(self.directory / f".{self._file_path.name}", self._file_path)
        self._prune()

    def _prune(self) -> None:
        done = sorted(self.directory.glob("deliveries-*.jsonl"), key=lambda p: p.stat().st_mtime)
        for path in done[: max(0, len(done) - self.max_files)]:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Write what is queued, complete the current file and stop the writer."""
        self._stop.set()
        self._thread.join(10)
        if self._thread.is_alive():
            return
        self.flush()
        self._close_file()

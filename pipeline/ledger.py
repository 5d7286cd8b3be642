"""The feed's ledger, in the checkpoint (``CHECKPOINT/feed-ledger/``): what each micro-batch delivered and
lost, so that a re-run never turns loss into success.

Why the feed keeps its own: the gateway answers a seq it gave up as a hole ``skipped_seq`` only while that
seq is still in the ring; once the ring moved past it, the same seq is answered ``stale_seq``, which also
means "already landed". A replay of a batch that lost records would then count them as landed. So, per
micro-batch, the ledger records:

* at the start of each attempt: the attempt number and, per topic, its epoch and available end (the first
  attempt's, per epoch);
* at the end of an attempt: the outcome: delivered, already present, lost seq ranges per topic (with the
  epochs they were lost in), reconnects, bad input records.

How an attempt's answers are classified (:func:`classify`), per record with an explicit seq:

* accepted: delivered now;
* ``skipped_seq``: lost;
* ``duplicate_seq`` / ``stale_seq`` to a record written again after a reconnect: landed on the connection that
  broke (delivered);
* ``duplicate_seq`` / ``stale_seq`` when an earlier attempt of this batch ran in the same epoch: lost if that
  attempt's outcome lists the seq as lost, else landed by it (delivered). If that attempt died before
  recording its outcome (kill -9), landed, counted as *unverified*: only a gateway that answers a given-up seq
  ``skipped_seq`` for its whole epoch can tell these apart;
* ``stale_seq`` on the first attempt in this epoch to a seq at or above the topic's end when the attempt
  started: it was not there, this attempt did not write it twice (repeated input is dropped before), so the
  gateway gave it up and it left the ring: lost;
* otherwise (below that end, or ``duplicate_seq``): already present, published before this batch (another
  checkpoint, another producer): not delivered by this feed, not lost.

Storage: small JSON files, written whole (temporary name, then rename) by the driver; local paths with
plain file I/O, other URIs (``hdfs://``, ``s3a://``) through Spark's Hadoop file system.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["BatchOutcome", "CheckpointStore", "Ledger", "classify", "intervals"]

LEDGER_DIR = "feed-ledger"
#: Batch files kept (the summary keeps every batch that lost records).
KEEP_BATCHES = 100


def intervals(seqs: Iterable[int]) -> list[list[int]]:
    """Sorted distinct seqs as half-open ``[from, to)`` ranges."""
    out: list[list[int]] = []
    for seq in sorted(set(seqs)):
        if out and out[-1][1] == seq:
            out[-1][1] = seq + 1
        else:
            out.append([seq, seq + 1])
    return out


def _contains(ranges: list[list[int]], seq: int) -> bool:
    i = bisect.bisect_right(ranges, [seq, float("inf")]) - 1
    return i >= 0 and ranges[i][0] <= seq < ranges[i][1]


def _count(ranges: Iterable[list[int]]) -> int:
    return sum(b - a for a, b in ranges)


@dataclass
class BatchOutcome:
    batch: int
    attempt: int = 1
    #: records handed to the gateway (input duplicates and bad records excluded)
    records: int = 0
    accepted: int = 0
    #: refused as duplicate/stale and known (or, ``unverified``, assumed) to have landed earlier
    landed_earlier: int = 0
    unverified: int = 0
    #: refused as duplicate/stale, present before this batch: not delivered by this feed, not lost
    already_present: int = 0
    #: topic -> {"epoch": E, "ranges": [[from, to), ...]}
    lost: dict[str, dict[str, Any]] = field(default_factory=dict)
    input_duplicates: int = 0
    bad_records: int = 0
    reconnects: int = 0
    unsequenced_resent: int = 0
    #: topic -> epoch after the attempt (None: unknown)
    epochs: dict[str, str | None] = field(default_factory=dict)
    #: recorded with --allow-loss (the batch was committed despite its loss)
    allowed: bool = False
    seconds: float = 0.0

    @property
    def delivered(self) -> int:
        return self.accepted + self.landed_earlier

    @property
    def lost_count(self) -> int:
        return sum(_count(entry["ranges"]) for entry in self.lost.values())

    def lost_text(self, limit: int = 3) -> str:
        parts = []
        for topic in sorted(self.lost)[:limit]:
            ranges = self.lost[topic]["ranges"]
            shown = ", ".join(f"[{a}, {b})" for a, b in ranges[:3]) + (", ..." if len(ranges) > 3 else "")
            parts.append(f"{topic} {_count(ranges)} ({shown})")
        more = f", {len(self.lost) - limit} more topics" if len(self.lost) > limit else ""
        return "; ".join(parts) + more

    def set_epochs(self, epochs: dict[str, str | None]) -> None:
        """The topics' epochs after the attempt; loss noted before a topic existed gets the epoch it was
        created with."""
        self.epochs = dict(epochs)
        for topic, entry in self.lost.items():
            if entry.get("epoch") is None:
                entry["epoch"] = epochs.get(topic)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> BatchOutcome:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def classify(
    batch: int,
    *,
    accepted: int,
    refusals: dict[tuple[str, str], list[int]],
    lost_on_resend: dict[str, list[int]],
    landed_on_resend: int,
    start: dict[str, dict[str, Any]],
    prior: dict | None,
) -> BatchOutcome:
    """An attempt's outcome from its answers. ``start``: topic -> {"epoch", "end"} read when this attempt
    started; ``prior``: the ledger's record of this batch before this attempt (None: first attempt)."""
    outcome = BatchOutcome(batch=batch, accepted=accepted, landed_earlier=landed_on_resend)
    prior_start = (prior or {}).get("start", {})
    prior_outcome = (prior or {}).get("outcome")
    prior_lost = (prior_outcome or {}).get("lost", {})
    prior_epochs = (prior_outcome or {}).get("epochs", {})
    lost: dict[str, set[int]] = {topic: set(seqs) for topic, seqs in lost_on_resend.items() if seqs}
    for (topic, code), seqs in refusals.items():
        now = start.get(topic, {})
        epoch_now = now.get("epoch")
        prior_epoch = prior_epochs.get(topic) or prior_start.get(topic, {}).get("epoch")
        same_epoch = topic in prior_start and epoch_now is not None and prior_epoch in (None, epoch_now)
        if code == "skipped_seq":
            lost.setdefault(topic, set()).update(seqs)
            continue
        if same_epoch:
            if prior_outcome is None:
                outcome.landed_earlier += len(seqs)
                outcome.unverified += len(seqs)
                continue
            entry = prior_lost.get(topic)
            ranges = entry["ranges"] if entry and entry.get("epoch") in (None, epoch_now) else []
            for seq in seqs:
                if _contains(ranges, seq):
                    lost.setdefault(topic, set()).add(seq)
                else:
                    outcome.landed_earlier += 1
            continue
        end = now.get("end", 0)
        for seq in seqs:
            if code == "stale_seq" and end is not None and seq >= end:
                lost.setdefault(topic, set()).add(seq)
            else:
                outcome.already_present += 1
    outcome.lost = {
        topic: {"epoch": start.get(topic, {}).get("epoch"), "ranges": intervals(seqs)}
        for topic, seqs in sorted(lost.items())
        if seqs
    }
    return outcome


# -- storage ---------------------------------------------------------------------------------------------


class CheckpointStore:
    """Small files under a directory that may be local or any Hadoop file system URI."""

    def __init__(self, root: str, spark: SparkSession | None = None) -> None:
        self.root = root
        scheme = root.split("://", 1)[0] if "://" in root else ""
        self.local = scheme in ("", "file")
        if self.local:
            self._dir = Path(root[len("file://") :] if root.startswith("file://") else root)
            self._dir.mkdir(parents=True, exist_ok=True)
        else:
            if spark is None:
                raise ValueError(f"a non-local checkpoint ({root}) needs the Spark session")
            jvm = spark.sparkContext._jvm
            if jvm is None:
                raise ValueError(f"a non-local checkpoint ({root}) needs a running Spark session (it has no JVM)")
            self._jvm = jvm
            self._path = jvm.org.apache.hadoop.fs.Path(root)
            self._fs = self._path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
            self._fs.mkdirs(self._path)

    def read(self, name: str) -> bytes | None:
        if self.local:
            try:
                return (self._dir / name).read_bytes()
            except FileNotFoundError:
                return None
        path = self._jvm.org.apache.hadoop.fs.Path(self._path, name)
        if not self._fs.exists(path):
            return None
        stream = self._fs.open(path)
        try:
            out = self._jvm.java.io.ByteArrayOutputStream()
            self._jvm.org.apache.hadoop.io.IOUtils.copyBytes(stream, out, 65536, False)
            return bytes(out.toByteArray())
        finally:
            stream.close()

    def write(self, name: str, data: bytes) -> None:
        if self.local:
            tmp = self._dir / f".{name}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self._dir / name)
            return
        path = self._jvm.org.apache.hadoop.fs.Path(self._path, name)
        tmp = self._jvm.org.apache.hadoop.fs.Path(self._path, f".{name}.tmp")
        stream = self._fs.create(tmp, True)
        try:
            stream.write(bytearray(data))
        finally:
            stream.close()
        self._fs.delete(path, False)
        self._fs.rename(tmp, path)

    def delete(self, name: str) -> None:
        if self.local:
            (self._dir / name).unlink(missing_ok=True)
        else:
            self._fs.delete(self._jvm.org.apache.hadoop.fs.Path(self._path, name), False)


class Ledger:
    """The per-batch records and a summary (every batch that lost records, the latest epochs)."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        raw = store.read("summary.json")
        self.summary: dict[str, Any] = orjson.loads(raw) if raw else {"lossy": {}, "epochs": {}, "last_batch": None}

    @classmethod
    def in_checkpoint(cls, checkpoint: str, spark: SparkSession | None = None) -> Ledger:
        return cls(CheckpointStore(checkpoint.rstrip("/") + "/" + LEDGER_DIR, spark))

    @staticmethod
    def _name(batch: int) -> str:
        return f"batch-{batch}.json"

    def record(self, batch: int) -> dict | None:
        raw = self.store.read(self._name(batch))
        return orjson.loads(raw) if raw else None

    def begin(self, batch: int, start: dict[str, dict[str, Any]]) -> tuple[dict | None, dict[str, dict[str, Any]], int]:
        """Note an attempt of ``batch`` before it publishes. Returns (the record before this attempt, the
        per-topic start state classification uses, the attempt number)."""
        prior = self.record(batch)
        attempt = (prior or {}).get("attempts", 0) + 1
        merged = dict((prior or {}).get("start", {}))
        for topic, now in start.items():
            before = merged.get(topic)
            if before is None or (before.get("epoch") not in (None, now.get("epoch")) and now.get("epoch") is not None):
                merged[topic] = now  # first seen, or a new epoch: this attempt is the first in it
        record = {"batch": batch, "attempts": attempt, "start": merged, "outcome": (prior or {}).get("outcome")}
        self.store.write(self._name(batch), orjson.dumps(record))
        return prior, start, attempt

    def finish(self, outcome: BatchOutcome) -> None:
        record = self.record(outcome.batch) or {"batch": outcome.batch, "attempts": outcome.attempt, "start": {}}
        record["outcome"] = outcome.to_json()
        self.store.write(self._name(outcome.batch), orjson.dumps(record))
        lossy = self.summary.setdefault("lossy", {})
        if outcome.lost:
            lossy[str(outcome.batch)] = {"lost": outcome.lost_count, "allowed": outcome.allowed, "topics": sorted(outcome.lost)}
        else:
            lossy.pop(str(outcome.batch), None)
        self.summary.setdefault("epochs", {}).update({t: e for t, e in outcome.epochs.items() if e is not None})
        self.summary["last_batch"] = outcome.batch
        self.store.write("summary.json", orjson.dumps(self.summary))
        old = outcome.batch - KEEP_BATCHES
        if old >= 0 and str(old) not in lossy:
            self.store.delete(self._name(old))

    def earlier_loss(self, before_batch: int | None = None) -> tuple[int, list[int]]:
        """(records lost, batch ids) over the batches recorded as lossy (before ``before_batch``)."""
        batches = sorted(int(b) for b in self.summary.get("lossy", {}) if before_batch is None or int(b) < before_batch)
        return sum(self.summary["lossy"][str(b)]["lost"] for b in batches), batches

    @property
    def epochs(self) -> dict[str, str]:
        return dict(self.summary.get("epochs", {}))

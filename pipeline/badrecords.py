"""Malformed input records of the feed's file source: why each is bad, where it is (file and line), and the
dead-letter directory they go to with ``--bad-records DIR``.

Spark reads JSON and CSV in PERMISSIVE mode with a ``_corrupt_record`` column, so one bad line no longer
fails the whole micro-batch with a plan dump; :func:`bad_reason` is the Spark expression that says what is
wrong with a row. Spark does not know line numbers: the driver finds them (:func:`locate`) by reading the
few files that had bad records, when they are on its own file system (else the line is left out and the
record's text says which one it is).
"""

from __future__ import annotations

import csv
import io
import json
import os
import urllib.parse
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from pyspark.sql import Column

__all__ = ["BadRecord", "CORRUPT", "MAX_SEQ", "bad_reason", "locate", "write_dead_letters"]

#: The column Spark puts a line it could not parse into (JSON, CSV).
CORRUPT = "_corrupt_record"
#: Seqs are integers in [0, 2^53) (docs/protocol.md).
MAX_SEQ = 1 << 53

_MALFORMED = {
    "json": "not a JSON object of the feed's schema (topic string, data JSON text, seq integer, event_time timestamp)",
    "csv": "malformed CSV record (field count, quoting, or a value of the wrong type)",
    "parquet": "unreadable record",
}


def bad_reason(fmt: str) -> Column:
    """Spark column: why a row of the source is bad, or null for a good one."""
    from pyspark.sql import functions as F

    seq = F.col("seq")
    data = F.col("data")
    return (
        F.when(F.col(CORRUPT).isNotNull(), F.lit(_MALFORMED[fmt]))
        .when(F.col("topic").isNull() | (F.col("topic") == ""), F.lit("no topic"))
        .when(
            seq.isNotNull() & ((seq < 0) | (seq >= MAX_SEQ)),
            F.concat(F.lit("seq "), seq.cast("string"), F.lit(" outside [0, 2^53)")),
        )
        .when(data.isNotNull() & F.try_parse_json(data).isNull(), F.lit("data is not JSON text"))
    )


@dataclass
class BadRecord:
    file: str
    reason: str
    #: the raw text (a line Spark could not parse), or the parsed fields
    record: Any
    #: 1-based line (JSON, CSV) or row (Parquet) in the file; None when it could not be found
    line: int | None = None

    def where(self) -> str:
        return f"{self.file} line {self.line}" if self.line is not None else f"{self.file} (line not found)"

    def one_line(self) -> str:
        shown = self.record if isinstance(self.record, str) else orjson.dumps(self.record).decode()
        return f"bad input record in {self.where()}: {self.reason}: {shown[:200]}"


def local_path(file: str) -> Path | None:
    """The driver-side path of a file URI from Spark, or None when it is not on a local file system."""
    parsed = urllib.parse.urlsplit(file)
    if parsed.scheme in ("", "file"):
        return Path(urllib.parse.unquote(parsed.path))
    return None


def _matches_fields(obj: dict, record: dict) -> bool:
    if obj.get("topic") != record.get("topic") or obj.get("seq") != record.get("seq"):
        return False
    data, want = obj.get("data"), record.get("data")
    return not isinstance(data, str) or data == want


def _json_lines(path: Path, records: list[BadRecord]) -> None:
    pending = list(records)
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not pending:
                return
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            obj = None
            for bad in pending:
                if isinstance(bad.record, str):
                    hit = text == bad.record
                else:
                    if obj is None:
                        try:
                            obj = json.loads(text)
                        except ValueError:
                            obj = {}
                    hit = isinstance(obj, dict) and _matches_fields(obj, bad.record)
                if hit:
                    bad.line = number
                    pending.remove(bad)
                    break


def _csv_lines(path: Path, records: list[BadRecord]) -> None:
    pending = list(records)
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        text = f.read()
    physical = text.splitlines()
    reader = csv.reader(io.StringIO(text))
    start = 1
    for index, row in enumerate(reader):
        end = reader.line_num
        if index == 0:  # the header
            start = end + 1
            continue
        raw = "\n".join(physical[start - 1 : end])
        for bad in pending:
            if isinstance(bad.record, str):
                hit = raw == bad.record or physical[start - 1] == bad.record
            else:
                fields = dict(zip(("topic", "data", "seq"), row))
                want = bad.record
                hit = (
                    fields.get("topic") == want.get("topic")
                    and fields.get("seq", "") == ("" if want.get("seq") is None else str(want.get("seq")))
                    and fields.get("data") == want.get("data")
                )
            if hit:
                bad.line = start
                pending.remove(bad)
                break
        if not pending:
            return
        start = end + 1


def _parquet_rows(path: Path, records: list[BadRecord]) -> None:
    import pyarrow.parquet as pq

    pending = list(records)
    columns = [c for c in ("topic", "seq", "data") if c in pq.read_schema(path).names]
    for index, row in enumerate(pq.read_table(path, columns=columns).to_pylist(), 1):
        for bad in pending:
            if isinstance(bad.record, dict) and all(row.get(k) == bad.record.get(k) for k in columns):
                bad.line = index
                pending.remove(bad)
                break
        if not pending:
            return


def locate(fmt: str, records: Iterable[BadRecord]) -> None:
    """Fill in ``line`` for the records whose file is on this machine (best effort: I/O errors leave it
    None)."""
    by_file: dict[str, list[BadRecord]] = {}
    for bad in records:
        by_file.setdefault(bad.file, []).append(bad)
    for file, bads in by_file.items():
        path = local_path(file)
        if path is None or not path.is_file():
            continue
        try:
            {"json": _json_lines, "csv": _csv_lines, "parquet": _parquet_rows}[fmt](path, bads)
        except (OSError, ValueError, UnicodeError):
            pass


def write_dead_letters(directory: str, batch_id: int, records: list[BadRecord]) -> str:
    """Write ``records`` as JSON lines to ``DIR/batch-<id>.jsonl`` (replaced when the batch is replayed);
    returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"batch-{batch_id}.jsonl")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for bad in records:
            f.write(orjson.dumps(asdict(bad), option=orjson.OPT_APPEND_NEWLINE))
    os.replace(tmp, path)
    return path

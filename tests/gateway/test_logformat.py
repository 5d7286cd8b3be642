"""gateway/ops/logformat.py in this process: the json line of a record (its fields, its exception) and the text
format of a worker."""

from __future__ import annotations

import json
import logging
import re
import sys

import pytest

from gateway.ops.logformat import JsonFormatter, text_formatter

pytestmark = pytest.mark.unit

RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def record(msg: str, *args: object, level: int = logging.INFO, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            info = sys.exc_info()
    return logging.LogRecord("gateway", level, __file__, 1, msg, args, info)


def test_the_formatter_writes_the_exception_and_the_fields_and_never_fails_on_a_value() -> None:
    formatter = JsonFormatter(worker=3)
    failed = record("failed %s", "x", level=logging.ERROR, exc=True)
    failed.client = "ws-1"
    failed.odd = object()  # not JSON: written as its str()
    failed.counts = {1: "a"}
    line = json.loads(formatter.format(failed))
    assert line["event"] == "failed x" and line["level"] == "error" and line["worker"] == 3
    assert line["client"] == "ws-1" and line["odd"].startswith("<object") and line["counts"] == {"1": "a"}
    huge = record("huge")
    huge.seq = 2**70
    assert json.loads(formatter.format(huge))["seq"] == str(2**70)
    assert "RuntimeError: boom" in line["exc"] and "Traceback" in line["exc"]
    assert RFC3339_MS.match(line["time"])


def test_the_time_is_utc_with_milliseconds_and_a_field_never_replaces_the_keys_every_line_has() -> None:
    stamped = record("x")
    stamped.created = 1_700_000_000.5
    stamped.worker = 9  # as `extra=` would set it: the formatter's worker wins
    line = json.loads(JsonFormatter(worker=None).format(stamped))
    assert line["time"] == "2023-11-14T22:13:20.500Z" and line["worker"] is None


def test_a_workers_text_lines_name_it() -> None:
    assert " INFO worker 2 gateway: hello" in text_formatter(2).format(record("hello"))
    assert " INFO gateway: hello" in text_formatter(None).format(record("hello"))

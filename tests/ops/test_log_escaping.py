"""The text log's escaping and the rate-limited log, in this process (gateway/ops/logformat.py,
gateway/edge/ratelog.py): no record writes a line of its own; a RateLog writes `burst` lines, then its rate."""

from __future__ import annotations

import logging
import sys

import pytest

from gateway.edge.ratelog import RateLog
from gateway.ops.logformat import escape, text_formatter

pytestmark = pytest.mark.unit

FORGED = "2026-01-01 00:00:00,000 ERROR gateway: forged"


def record(msg: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    info = None
    if exc is not None:
        try:
            raise exc
        except BaseException:
            info = sys.exc_info()
    return logging.LogRecord("gateway.input", logging.WARNING, __file__, 1, msg, args, info)


@pytest.mark.parametrize("worker", [None, 1])
@pytest.mark.parametrize("breaker", ["\n", "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029"])
def test_a_line_break_in_a_message_or_its_arguments_stays_in_its_line(worker: int | None, breaker: str) -> None:
    formatter = text_formatter(worker)
    for made in (record("bad request: %s", breaker + FORGED), record("bad request: " + breaker + FORGED)):
        line = formatter.format(made)
        assert "\n" not in line and "\r" not in line and breaker not in line
        assert line.splitlines() == [line]  # str.splitlines breaks at every one of them
        assert FORGED in line and not line.startswith("2026-01-01")


def test_controls_are_written_as_escapes_and_the_rest_as_is() -> None:
    assert escape("a\nb\rc\td\x1b[31me\x00f\x7fg\u2028h") == "a\\nb\\rc\\td\\x1b[31me\\x00f\\x7fg\\u2028h"
    plain = "kicked ws-1 (kicked): kicked by admin, close 4000 é 日本 \\n"
    assert escape(plain) == plain


def _chained() -> None:
    try:
        raise KeyError("inner\n" + FORGED)
    except KeyError as exc:
        error = ValueError("bad\n\n" + FORGED + "\r\x1b[2J")
        error.add_note("note\n" + FORGED)
        raise error from exc


def test_an_exceptions_message_in_a_traceback_cannot_start_a_line() -> None:
    try:
        _chained()
    except ValueError:
        info = sys.exc_info()
    made = logging.LogRecord("gateway", logging.ERROR, __file__, 1, "a command failed", None, info)
    text = text_formatter(None).format(made)
    lines = text.split("\n")
    assert lines[0].endswith("ERROR gateway: a command failed")
    assert not [line for line in lines if line.startswith("2026-01-01")], text
    # Python's shape otherwise: the headers at column 0, the frames indented
    assert lines.count("Traceback (most recent call last):") == 2
    assert "The above exception was the direct cause of the following exception:" in lines
    assert any(line.startswith('  File "') for line in lines)
    assert "ValueError: bad\\n\\n" + FORGED + "\\r\\x1b[2J" in lines
    assert "note\\n" + FORGED in lines
    assert "KeyError: 'inner\\n" + FORGED + "'" in lines  # a KeyError's repr escapes it already


def test_a_rate_log_writes_its_burst_then_its_rate_and_says_how_many_it_did_not(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    logger = logging.getLogger("gateway.test_ratelog")
    rate_log = RateLog(logger, 1.0, 5, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="gateway.test_ratelog"):
        written = [rate_log("cut %s", f"ws-{i}", client=f"ws-{i}") for i in range(20)]
        assert written == [True] * 5 + [False] * 15
        now[0] += 1.0
        assert rate_log("cut %s", "ws-20")
    lines = [r for r in caplog.records if r.name == "gateway.test_ratelog"]
    assert [r.getMessage() for r in lines] == [f"cut ws-{i}" for i in range(5)] + ["cut ws-20 (15 more not logged)"]
    assert lines[0].client == "ws-0" and lines[-1].suppressed == 15  # type: ignore[attr-defined]

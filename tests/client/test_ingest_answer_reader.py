"""`fanout_client.ingest.AnswerReader` fed directly (issue 34, item 12): a long answer line fed in small pieces
costs time linear in its length (each byte scanned once, not the whole buffer again on each feed), and a line
past the bound is refused once and skipped to its end with nothing held."""

from __future__ import annotations

import time

import pytest

import fanout_client.ingest as ingest
from fanout_client.ingest import AnswerReader, BadAnswer, Closed, ErrorAnswer, Synced

pytestmark = pytest.mark.unit

LIMIT = getattr(ingest, "MAX_ANSWER_LINE_BYTES", 1 << 20)


def _buffered(reader: AnswerReader) -> int:
    return int(getattr(reader, "buffered", len(getattr(reader, "_buffer", b""))))


def test_a_long_line_fed_in_small_pieces_costs_linear_time() -> None:
    sync_id = "i" * (LIMIT - 100)
    line = b'{"type":"synced","id":"' + sync_id.encode() + b'","accepted":1,"refused":0}\n'
    assert len(line) <= LIMIT
    reader = AnswerReader()
    answers = []
    started = time.monotonic()
    for i in range(0, len(line), 64):  # ~16,000 feeds; re-scanning the buffer on each: ~8 GB copied
        answers += reader.feed(line[i : i + 64])
    elapsed = time.monotonic() - started
    assert answers == [Synced(id=sync_id, accepted=1, refused=0)]
    assert elapsed < 1.5, elapsed  # linear: ~20 ms; quadratic: seconds


def test_a_line_past_the_bound_is_refused_once_and_skipped_to_its_end() -> None:
    reader = AnswerReader()
    answers = []
    for _ in range(3 * LIMIT // 65536):
        answers += reader.feed(b"y" * 65536)
        assert _buffered(reader) <= LIMIT
    assert len(answers) == 1 and isinstance(answers[0], BadAnswer), answers
    assert "longer than" in answers[0].reason and len(answers[0].text) <= 200
    # the rest of the long line is skipped; the next line is read as usual
    error = b'{"type":"error","line":3,"code":"bad_json","message":"not JSON"}\n'
    assert reader.feed(b"yyy\n" + error) == [ErrorAnswer(line=3, code="bad_json", message="not JSON")]
    assert reader.feed(b"") == [Closed()]
    assert _buffered(reader) == 0


def test_lines_split_anywhere_and_the_close_inside_a_line() -> None:
    data = b'{"type":"authed"}\n\n{"type":"synced","id":1,"accepted":2,"refused":0}\n{"type":"sy'
    for cut in range(len(data) + 1):
        reader = AnswerReader()
        pieces = [piece for piece in (data[:cut], data[cut:]) if piece]  # b"" would be the close
        answers = [answer for piece in pieces for answer in reader.feed(piece)] + reader.feed(b"")
        assert answers[:2] == [ingest.Authed(), Synced(id=1, accepted=2, refused=0)]
        assert isinstance(answers[2], BadAnswer) and answers[2].text == b'{"type":"sy'
        assert answers[3:] == [Closed()]

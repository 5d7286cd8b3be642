"""The TCP ingest's sans-I/O parser (gateway/transports/ingest_parser.py): bytes in, items out, no socket, no loop."""

from __future__ import annotations

import dataclasses

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.schema import PublishRecord
from gateway.transports.ingest_parser import AUTH_LINE_MAX, Authed, AuthFailed, IngestParser, LineError, Publish, Sync

pytestmark = pytest.mark.unit

TOKEN = "s3cret"


def items_of(parser: IngestParser, *chunks: bytes) -> list:
    """Feed each chunk and take every item it makes, as the protocol does."""
    items = []
    for chunk in chunks:
        parser.feed(chunk)
        while (item := parser.next_item()) is not None:
            items.append(item)
    return items


def parse(data: bytes, *, max_line: int = 1000, token: str = "") -> list:
    return items_of(IngestParser(max_line, token), data)


def errors(items) -> list[tuple[int, str]]:
    return [(i.line, i.code) for i in items if isinstance(i, LineError)]


# -- records ------------------------------------------------------------------------------------------------


def test_every_record_kind_with_its_line_number():
    data = (
        b'{"topic":"t","data":{"a":[1]}}\n{"topic":"t","seq":7,"data":null}\n'
        b'{"topic":"private.q","client":"u1","data":"x"}\n{"sync":1}\n{"sync":"s"}\n{"sync":null}\n'
    )
    assert parse(data) == [
        Publish(1, PublishRecord("t", {"a": [1]})),
        Publish(2, PublishRecord("t", None, seq=7)),
        Publish(3, PublishRecord("private.q", "x", client="u1")),
        Sync(4, 1),
        Sync(5, "s"),
        Sync(6, None),
    ]


def test_items_are_frozen_and_slotted():
    item = parse(b'{"sync":1}\n')[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.line = 2
    assert not hasattr(item, "__dict__")


def test_seq_range_is_left_to_the_engine():
    # bad_seq is the engine's answer: the parser passes any integer on
    items = parse(b'{"topic":"t","seq":-1,"data":0}\n{"topic":"t","seq":18446744073709551615,"data":0}\n')
    assert [i.record.seq for i in items] == [-1, 2**64 - 1]


@pytest.mark.parametrize(
    "line",
    [
        b'{"topic":"t","seq":"1","data":0}',
        b'{"topic":"t","seq":1.5,"data":0}',
        b'{"topic":"t","seq":true,"data":0}',
        b'{"topic":"t","client":5,"data":0}',
        b'{"topic":"","data":0}',
        b'{"topic":"t"}',
        b'{"data":0}',
        b'{"topic":"t","data":0,"extra":1}',
        b'{"sync":true}',
        b'{"sync":1.5}',
        b'{"sync":{"a":1}}',
        b'{"sync":[1]}',
        b"[1]",
        b'"text"',
        b"3",
        b"null",
        b'{"auth":"x"}',
    ],
)
def test_bad_records_get_bad_record(line):
    assert errors(parse(b'{"sync":0}\n' + line + b"\n")) == [(2, "bad_record")]


def test_bad_record_carries_the_schema_message():
    (error,) = parse(b'{"topic":"t","seq":"1","data":0}\n')
    assert error == LineError(1, "bad_record", "Expected `int | null`, got `str` - at `$.seq`")


@pytest.mark.parametrize("line", [b"not json", b"{", b'{"topic":"t","data":"\\ud800"}', b"\xff\xfe"])
def test_not_json_gets_bad_json(line):
    (error,) = parse(line + b"\n")
    assert (error.line, error.code) == (1, "bad_json") and error.message.startswith("not JSON: ")


# -- framing ------------------------------------------------------------------------------------------------


def test_blank_lines_are_ignored_but_numbered():
    items = parse(b'\n  \n\r\n{"sync":1}\n\t\n{"sync":2}\n')
    assert items == [Sync(4, 1), Sync(6, 2)]


def test_a_line_without_its_newline_waits():
    parser = IngestParser(1000)
    assert items_of(parser, b'{"sync":') == []
    assert parser.buffered == 8
    assert items_of(parser, b'1}\n{"sy') == [Sync(1, 1)]
    assert parser.buffered == 4


def test_a_line_over_max_line_is_refused_once_and_skipped_to_its_newline():
    parser = IngestParser(10)
    long_line = b'{"sync":"' + b"x" * 20 + b'"}'
    # in one piece: the whole line is there
    assert items_of(IngestParser(10), long_line + b'\n{"sync":1}\n') == [
        LineError(1, "too_large", "line longer than 10 bytes"),
        Sync(2, 1),
    ]
    # in pieces: refused as soon as it is too long, its rest dropped (not buffered) up to its newline
    assert items_of(parser, long_line[:11]) == [LineError(1, "too_large", "line longer than 10 bytes")]
    assert parser.buffered == 0
    assert items_of(parser, long_line[11:], long_line, b'\n{"sync":1}\n') == [Sync(2, 1)]


def test_a_line_of_exactly_max_line_bytes_is_accepted():
    line = b'{"sync":"' + b"x" * 9 + b'"}'  # 20 bytes
    assert items_of(IngestParser(20), line[:-1], line[-1:] + b"\n") == [Sync(1, "x" * 9)]
    assert errors(parse(line + b"\n", max_line=19)) == [(1, "too_large")]


def test_line_numbers_count_refused_and_blank_lines():
    items = parse(b'bad\n\n{"topic":"t","data":1}\n' + b"x" * 50 + b'\n[]\n{"sync":1}\n', max_line=40)
    assert errors(items) == [(1, "bad_json"), (4, "too_large"), (5, "bad_record")]
    assert [i.line for i in items if not isinstance(i, LineError)] == [3, 6]


# -- the auth line ------------------------------------------------------------------------------------------


def test_without_a_token_the_auth_line_is_optional_and_answered():
    assert parse(b'{"auth":"anything"}\n{"sync":1}\n') == [Authed(1), Sync(2, 1)]
    assert parse(b'{"sync":1}\n{"auth":"late"}\n') == [
        Sync(1, 1),
        LineError(2, "bad_record", "`auth` is only accepted as the first line"),
    ]
    assert IngestParser(1000).authed


def test_the_right_token_lets_records_come_in_the_same_chunk():
    parser = IngestParser(1000, TOKEN)
    assert not parser.authed
    assert items_of(parser, b'{"auth":"s3cret"}\n{"topic":"t","data":1}\n{"auth":"s3cret"}\n') == [
        Authed(1),
        Publish(2, PublishRecord("t", 1)),
        LineError(3, "bad_record", "`auth` is only accepted as the first line"),
    ]
    assert parser.authed


@pytest.mark.parametrize(
    "first, message",
    [
        (b'{"auth":"wrong"}', "wrong token"),
        (b'{"auth":1}', 'the first line must be {"auth": TOKEN}'),
        (b'{"auth":"s3cret","x":1}', 'the first line must be {"auth": TOKEN}'),
        (b'{"topic":"t","data":0}', 'the first line must be {"auth": TOKEN}'),
        (b"not json", 'the first line must be {"auth": TOKEN}'),
        (b"", 'the first line must be {"auth": TOKEN}'),
    ],
)
def test_a_wrong_first_line_fails_the_handshake_and_nothing_follows(first, message):
    parser = IngestParser(1000, TOKEN)
    assert items_of(parser, first + b'\n{"topic":"t","data":1}\n{"sync":1}\n') == [AuthFailed(1, message)]
    assert items_of(parser, b'{"sync":2}\n') == [] and parser.buffered == 0 and not parser.authed


def test_an_auth_line_longer_than_allowed_fails_before_its_newline():
    parser = IngestParser(100, TOKEN)
    assert items_of(parser, b'{"auth":"' + b"x" * (AUTH_LINE_MAX - 9)) == []  # 4 KiB pending: still waiting
    assert items_of(parser, b"x") == [AuthFailed(1, f"no auth line in the first {AUTH_LINE_MAX} bytes")]
    assert parser.buffered == 0
    # the same line in one piece: the same answer
    assert parse(b'{"auth":"' + b"x" * AUTH_LINE_MAX + b'"}\n', token=TOKEN) == [
        AuthFailed(1, f"no auth line in the first {AUTH_LINE_MAX} bytes")
    ]


def test_the_auth_line_has_its_own_limit_not_max_line():
    token = "t" * 200
    assert parse(orjson.dumps({"auth": token}) + b"\n", max_line=100, token=token) == [Authed(1)]


# -- chunk boundaries ---------------------------------------------------------------------------------------

records = st.fixed_dictionaries(
    {},
    optional={
        "topic": st.sampled_from(["t", ""]) | st.integers(0, 9),
        "data": st.integers(0, 9) | st.text(max_size=30),
        "seq": st.integers(-2, 5) | st.text(max_size=2),
        "client": st.none() | st.text(max_size=3),
        "sync": st.none() | st.integers(-9, 9) | st.booleans(),
        "auth": st.sampled_from([TOKEN, "no"]),
    },
)
lines = (
    records.map(orjson.dumps)
    | st.binary(max_size=60)
    | st.sampled_from([b"", b" ", b"\r", b"x" * 70])
    | st.just(b'{"auth":"s3cret"}')
)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(lines, max_size=15), st.lists(st.integers(0, 2000), max_size=10), st.booleans(), st.integers(8, 64), st.booleans()
)
def test_items_do_not_depend_on_where_the_bytes_are_cut(body, cuts, with_token, max_line, end_with_newline):
    data = b"\n".join(body) + (b"\n" if end_with_newline else b"")
    token = TOKEN if with_token else ""
    whole = parse(data, max_line=max_line, token=token)
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]
    assert items_of(IngestParser(max_line, token), *pieces) == whole
    # byte by byte, too
    assert items_of(IngestParser(max_line, token), *(data[i : i + 1] for i in range(len(data)))) == whole
    numbers = [item.line for item in whole]
    assert numbers == sorted(set(numbers)) and all(n >= 1 for n in numbers)
    assert all(not isinstance(i, AuthFailed) for i in whole[:-1])
    assert all(i.line == 1 for i in whole if isinstance(i, (Authed, AuthFailed)))

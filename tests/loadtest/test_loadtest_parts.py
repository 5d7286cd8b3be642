"""The load generator's small parts: HTTP response parser, scenarios and plans, topic mix, recorder, CLI."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from collections import Counter

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest import scenarios
from loadtest.__main__ import main
from loadtest.httpclient import HttpProtocolError, ResponseParser
from loadtest.publisher import Messages, topic_cycle
from loadtest.recorder import Recorder

pytestmark = pytest.mark.unit


def test_parser_content_length_split_anywhere() -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\nX-A: b\r\n\r\nhello world"
    for cut in range(1, len(raw)):
        parser = ResponseParser()
        responses = parser.feed(raw[:cut]) + parser.feed(raw[cut:])
        assert [(r.status, r.body, r.headers["x-a"]) for r in responses] == [(200, b"hello world", "b")]


def test_parser_chunked_and_pipelined() -> None:
    raw = (
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6;x=y\r\n world\r\n0\r\n\r\n"
        b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"
    )
    parser = ResponseParser()
    out = []
    for byte in raw:
        out += parser.feed(bytes([byte]))
    assert [(r.status, r.body) for r in out] == [(201, b"hello world"), (204, b"")]


def test_parser_refuses_garbage() -> None:
    with pytest.raises(HttpProtocolError):
        ResponseParser().feed(b"SSH-2.0-OpenSSH\r\n\r\n")


def test_plan_is_deterministic_and_shaped() -> None:
    s = scenarios.Scenario("t", clients=50, topics=20, subs=4, stall_frac=0.2, transport="mixed", seed=7)
    p1, p2 = scenarios.plan(s), scenarios.plan(s)
    assert p1 == p2
    assert len(p1.clients) == 50 and all(len(c.topics) == 4 == len(set(c.topics)) for c in p1.clients)
    assert Counter(c.role for c in p1.clients) == {"light": 40, "stalled": 10}
    assert Counter(c.transport for c in p1.clients) == {"ws": 25, "longpoll": 25}
    assert sum(p1.rates) == pytest.approx(1000.0)


def test_plan_hot_topics_and_dominator() -> None:
    s = scenarios.Scenario(
        "t", clients=10, topics=12, subs=5, rate=1000, hot_topics=2, hot_share=0.9, dominator_topics=5, dominator_rate=500
    )
    p = scenarios.plan(s)
    assert p.classes.count("hot") == 2 and p.classes.count("busy") == 5
    assert all(sum(p.classes[t] == "hot" for t in c.topics) == 1 for c in p.clients if c.role == "light")
    dom = [c for c in p.clients if c.role == "dominator"]
    assert len(dom) == 1 and {p.classes[t] for t in dom[0].topics} == {"busy"} and len(dom[0].topics) == 5
    hot_rate = sum(r for r, c in zip(p.rates, p.classes) if c == "hot")
    assert hot_rate == pytest.approx(900) and sum(p.rates) == pytest.approx(1500)
    without = scenarios.plan(dataclasses.replace(s, dominator=False))
    assert not [c for c in without.clients if c.role == "dominator"]


def test_flags_override_the_named_scenario() -> None:
    parser = argparse.ArgumentParser()
    scenarios.add_arguments(parser)
    s = scenarios.from_args(parser.parse_args(["smoke", "--clients", "7", "--rate", "max", "--transport", "longpoll"]))
    assert (s.name, s.clients, s.rate, s.transport, s.topics) == ("smoke", 7, None, "longpoll", 10)
    with pytest.raises(ValueError):
        scenarios.from_args(parser.parse_args(["smoke", "--subs", "99"]))


def test_topic_cycle_keeps_proportions() -> None:
    cycle = topic_cycle((9.0, 1.0, 0.0, 0.001))
    counts = Counter(cycle)
    assert counts[0] == pytest.approx(9 * counts[1], rel=0.01)
    assert 2 not in counts and counts[3] >= 1
    assert max(len(list(g)) for g in _runs(cycle, 1)) == 1  # topic 1 never twice in a row: spread evenly


def _runs(items: list[int], value: int) -> list[list[int]]:
    out, run = [], []
    for x in items:
        if x == value:
            run.append(x)
        elif run:
            out.append(run)
            run = []
    return out + ([run] if run else [])


def test_messages_carry_timestamp_topic_and_number() -> None:
    import orjson

    m = Messages(("x", "y"), (1.0, 1.0), payload=5)
    topics = m.take(4)
    assert sorted(topics) == [0, 0, 1, 1]
    data = orjson.loads(m.data(1, m.number(1)))
    assert data["t"] == "y" and data["n"] == 0 and data["pad"] == "xxxxx" and data["ts"] > 0


def test_recorder_rows_losses_and_starts() -> None:
    r = Recorder({"a": 0, "b": 1}, stalled=[False, True])
    subscribed = r.entries(
        0,
        [
            {"type": "subscribed", "topic": "a", "seq": 5},
            {"type": "msg", "topic": "a", "seq": 5, "data": {"ts": 100, "n": -1}},  # priming message
            {"type": "msg", "topic": "a", "seq": 6, "data": {"ts": 200, "n": 0}},
            {"type": "msg", "topic": "zz", "seq": 1, "data": {}},
            {"type": "loss", "topic": "a", "from": 7, "to": 9, "reason": "lagged"},
            {"type": "error", "code": "forbidden"},
        ],
        batch_id=3,
        now=1000,
    )
    assert subscribed == 1
    assert list(r.seq) == [6] and list(r.publish_ns) == [200] and list(r.batch_id) == [3]
    assert r.starts == {(0, 0): 6}
    assert r.losses == [(0, 0, 7, 9, "lagged", 1000)] and r.lost == [2, 0]
    assert r.foreign == 1 and r.errors == {"forbidden": 1} and r.msgs == [1, 0]
    r.raw_message(1, b"", {"t": "b", "n": 4, "ts": 50}, 1, 2000)
    assert list(r.client) == [0, 1] and r.msgs == [1, 1]


def test_recorder_stops_keeping_rows_at_its_cap() -> None:
    r = Recorder({"a": 0}, stalled=[False], max_rows=2)
    r.entries(0, [{"type": "msg", "topic": "a", "seq": s, "data": {"ts": 1, "n": s}} for s in range(5)], 1, 1)
    assert len(r.seq) == 2 and r.dropped_rows == 3 and r.msgs == [5, 0]


@pytest.mark.parametrize("command, module", [("core", "loadtest.core_bench"), ("rawtcp", "loadtest.rawtcp_bench")])
def test_bench_subcommands_are_delegated(command: str, module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    fake = types.ModuleType(module)
    fake.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined, func-returns-value]
    monkeypatch.setitem(sys.modules, module, fake)
    assert main([command, "--quick", "x"]) == 0
    assert seen == [["--quick", "x"]]


def test_list_names_every_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in scenarios.SCENARIOS)


def test_recorder_survives_entries_that_are_not_ours() -> None:
    r = Recorder({"a": 0}, stalled=[False])
    r.entries(
        0,
        [
            {"type": "msg", "topic": "a", "seq": "7", "data": {}},
            {"type": "msg", "topic": "a", "seq": 1, "data": {"ts": "soon", "n": "x"}},
            {"type": "msg", "topic": "a", "seq": 2, "data": [1, 2]},
            {"type": "loss", "topic": "a", "from": None, "to": 3},
            "not an entry",
        ],
        1,
        5,
    )
    assert list(r.seq) == [1, 2] and list(r.publish_ns) == [-1, -1]
    assert r.errors == {"bad_seq": 1, "bad_loss": 1, "unknown_entry:None": 1}
    assert r.entries(0, "junk", 2, 6) == 0 and r.errors["bad_batch"] == 1
    r.raw_message(0, b"{}", {"t": "a", "n": "1"}, 3, 7)
    assert r.errors["bad_message"] == 1 and len(r.seq) == 2


def _recorded(r: Recorder) -> tuple[object, ...]:
    arrays = tuple(list(getattr(r, name)) for name in ("topic", "client", "seq", "publish_ns", "deliver_ns", "batch_id"))
    return arrays, r.starts, r.losses, r.lost, r.msgs, r.foreign, r.frames, r.dropped_rows, dict(r.errors)


_LOAD_MSG = st.fixed_dictionaries(
    {
        "type": st.just("msg"),
        "topic": st.sampled_from(["a", "b", "zz"]),
        "seq": st.integers(0, 99),
        "data": st.fixed_dictionaries({"ts": st.integers(0, 2**62), "n": st.integers(-1, 3), "pad": st.just("x" * 20)}),
    }
)
_ENTRY = st.one_of(
    _LOAD_MSG,
    st.fixed_dictionaries(
        {
            "type": st.just("msg"),
            "topic": st.just("a"),
            "seq": st.one_of(st.integers(0, 9), st.text(max_size=2)),
            "data": st.one_of(st.none(), st.fixed_dictionaries({"ts": st.text(max_size=2)})),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("loss"),
            "topic": st.just("a"),
            "from": st.integers(0, 5),
            "to": st.integers(6, 9),
            "reason": st.just("lagged"),
        }
    ),
    st.fixed_dictionaries({"type": st.just("subscribed"), "topic": st.just("b"), "seq": st.integers(0, 9)}),
)


@given(st.lists(st.one_of(st.lists(_LOAD_MSG, max_size=6), st.lists(_ENTRY, max_size=6)), max_size=5), st.integers(0, 12))
@settings(max_examples=200, deadline=None)
def test_recorder_fast_path_records_what_the_general_path_does(frames: list[list[dict]], max_rows: int) -> None:
    """`msg_frame` takes the frames of nothing but well-formed load messages, and must keep exactly what
    `entries` keeps for them; every other frame it refuses, leaving it to `entries`."""
    general = Recorder({"a": 0, "b": 1}, stalled=[False, True], max_rows=max_rows)
    fast = Recorder({"a": 0, "b": 1}, stalled=[False, True], max_rows=max_rows)
    took = 0
    for batch_id, frame in enumerate(frames):
        body = orjson.dumps(frame)
        general.entries(1, frame, batch_id, 1000 + batch_id)
        if fast.msg_frame(1, body, batch_id, 1000 + batch_id):
            took += 1
        else:
            fast.entries(1, orjson.loads(body), batch_id, 1000 + batch_id)
    assert _recorded(fast) == _recorded(general)
    common = sum(
        all(
            e["type"] == "msg" and type(e["seq"]) is int and isinstance(e["data"], dict) and type(e["data"].get("n")) is int
            for e in frame
        )
        for frame in frames
    )
    assert took == common


def test_recorder_raw_fast_path_matches() -> None:
    bodies = [
        orjson.dumps({"ts": 5, "t": "a", "n": 1, "pad": "x"}),
        orjson.dumps({"ts": 6, "t": "zz", "n": 2}),
        orjson.dumps({"ts": 7, "t": "a", "n": -1}),
        b'{"t": "a", "n": "1"}',
        b"not json",
    ]
    general, fast = Recorder({"a": 0}, stalled=[False]), Recorder({"a": 0}, stalled=[False])
    for i, body in enumerate(bodies):
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        general.raw_message(0, body, data, i, 10 + i)
        if not fast.raw_frame(0, body, i, 10 + i):
            fast.raw_message(0, body, data, i, 10 + i)
    assert _recorded(fast) == _recorded(general)
    assert list(fast.seq) == [1] and fast.foreign == 1 and fast.errors["bad_message"] == 2


@given(
    st.lists(st.binary(max_size=64), max_size=8),
    st.sampled_from(
        [
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n",
            b"",
        ]
    ),
)
@settings(max_examples=300, deadline=None)
def test_parser_takes_any_bytes_or_says_protocol_error(chunks: list[bytes], head: bytes) -> None:
    parser = ResponseParser()
    try:
        for chunk in [head, *chunks]:
            for response in parser.feed(chunk):
                assert response.status >= 0 and isinstance(response.body, bytes)
    except HttpProtocolError:
        pass


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 2\xb2 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\n",
    ],
)
def test_parser_refuses_odd_numbers(raw: bytes) -> None:
    with pytest.raises(HttpProtocolError):
        ResponseParser().feed(raw)

"""Fuzz every parser of peer input: it accepts the input or answers with a protocol error, nothing else."""

import asyncio

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.commands import handle
from gateway.config import load_config
from gateway.edge.origin import OriginGuard, parse_allowed_origins
from gateway.hub import Hub
from gateway.scheduler import Delivered
from gateway.session import ClientSession
from gateway.testing import DEFAULTS, make_token
from gateway.transports.ingest import IngestParts, IngestProtocol
from gateway.transports.ingest_parser import AUTH_LINE_MAX, Authed, AuthFailed, IngestParser, LineError, Publish, Sync

pytestmark = pytest.mark.unit

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
commands = st.fixed_dictionaries(
    {},
    optional={
        "op": st.sampled_from(["subscribe", "unsubscribe", "publish", "rpc", "ping", "auth", "bogus"]) | json_values,
        "token": st.sampled_from([make_token("fuzz"), make_token("other", ttl=-60), "x.y.z"]) | json_values,
        "topic": st.sampled_from(["chat.a", "t", "private.x", "state.s", ""]) | json_values,
        "since": st.fixed_dictionaries({"epoch": st.text(max_size=5) | json_values, "seq": st.integers(-3, 10) | json_values})
        | json_values,
        "data": json_values,
        "id": json_values,
        "method": st.sampled_from(["echo", "time", "topics", "whoami", "nope"]) | json_values,
        "params": json_values,
    },
)
payloads = (
    st.binary(max_size=200)
    | commands.map(orjson.dumps)
    | st.lists(commands, max_size=5).map(orjson.dumps)
    | json_values.map(orjson.dumps)
    | st.sampled_from(
        [
            b'{"op":"publish","topic":"chat.a","data":123456789012345678901234567890}',
            b'{"op":"subscribe","topic":"t","since":{"epoch":"x","seq":1e400}}',
            b'{"op":"publish","topic":"chat.a","data":"\\ud800"}',
            b"[" * 2000 + b"]" * 2000,
            '{"op":"ping","id":"\u00e9"}'.encode(),
        ]
    )
)


class RecordingConnection:
    """The smallest transport: it records what the hub hands it."""

    def __init__(self, session):
        self.session = session
        self.identity = session.identity
        self.frames = []
        self.kicked = None

    def deliver(self, batch, frame):
        self.frames.append(frame)
        return Delivered.DONE

    def kick(self, code, reason, retry_ms=None):
        self.kicked = (code, reason)

    def describe(self):
        return {}


def _hub():
    return Hub(load_config(overrides=DEFAULTS, environ={}), instance_id="fuzz")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(payloads, min_size=1, max_size=6))
def test_client_commands_are_run_or_answered_with_an_error(frames):
    asyncio.run(_run_frames(frames))  # the hub arms timers (token expiry, idle): it needs a running loop


async def _run_frames(frames):
    hub = _hub()
    session = ClientSession.begin(hub.services, "ws", ("127.0.0.1", 1))
    session.open(RecordingConnection(session))
    for frame in frames:
        handle(session, frame)  # not `session.handle`: a failure must fail the test, not close the client
        if not session.live:
            break
        for batch in hub.scheduler.engine.run_cycle():
            for entry in map(orjson.loads, batch.entries):
                assert entry["type"] in {"subscribed", "unsubscribed", "reply", "error", "msg", "loss", "closed"}
                if entry["type"] == "error":
                    assert isinstance(entry["code"], str) and isinstance(entry["message"], str)
            hub.scheduler.engine.write_done(batch.client_id)


class RecordingTransport:
    def __init__(self):
        self.written = bytearray()
        self.paused = False

    def write(self, data):
        self.written += data

    def is_closing(self):
        return False

    def set_write_buffer_limits(self, high=None, low=None):
        pass

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default

    def close(self):
        pass

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False


records = st.fixed_dictionaries(
    {},
    optional={
        "topic": st.sampled_from(["t", "private.x", "state.s", ""]) | json_values,
        "data": json_values,
        "seq": st.integers(-2, 200) | json_values,
        "client": json_values,
        "sync": json_values,
        "auth": st.sampled_from(["s3cret", "x"]) | json_values,
    },
)
lines = st.binary(max_size=80).map(lambda b: b.replace(b"\n", b"")) | records.map(orjson.dumps)
#: what a peer's bytes can make of a line, besides records of the schema (protocol.md, TCP ingest)
INGEST_ERROR_CODES = {"bad_json", "bad_record", "bad_seq", "too_large"}  # bad_seq: a whole number past 2**53


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(lines.map(lambda line: line + b"\n") | st.binary(max_size=100), max_size=12), st.booleans(), st.integers(1, 120))
def test_ingest_parser_makes_items_or_error_items_of_any_bytes(chunks, with_token, max_line):
    """Sans-I/O: the parser alone, no loop. Any bytes in any pieces: items of the documented kinds, numbered
    in order, error codes of the protocol, and nothing after a failed handshake."""
    parser = IngestParser(max_line, "s3cret" if with_token else "")
    items = []
    for chunk in chunks:
        parser.feed(chunk)
        while (item := parser.next_item()) is not None:
            items.append(item)
        assert parser.buffered <= max(max_line, AUTH_LINE_MAX)  # refused bytes are not kept
    for item in items:
        assert isinstance(item, (Authed, AuthFailed, LineError, Publish, Sync))
        if isinstance(item, LineError):
            assert item.code in INGEST_ERROR_CODES and isinstance(item.message, str)
        if isinstance(item, Publish):
            assert isinstance(item.record.topic, str) and item.record.topic
    assert [i.line for i in items] == sorted({i.line for i in items}) and all(i.line >= 1 for i in items)
    assert not any(isinstance(i, AuthFailed) for i in items[:-1])


def test_an_auth_line_with_a_seq_out_of_range_is_refused_as_no_auth_line():
    # found by the fuzz above: a seq past 2**53 on the first line raised BadSeq out of the parser
    parser = IngestParser(120, "s3cret")
    parser.feed(b'{"seq":9007199254740992.0}\n')
    item = parser.next_item()
    assert isinstance(item, AuthFailed) and "auth" in item.message, item


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(lines, max_size=12), st.integers(1, 64))
def test_ingest_lines_are_applied_or_answered_with_an_error_line(body_lines, chunk):
    """The protocol over the parser and a real hub: every line is applied or answered, the sync counts add up."""
    asyncio.run(_run_lines(body_lines, chunk))  # the protocol arms its auth deadline: it needs a running loop


async def _run_lines(body_lines, chunk):
    hub = _hub()
    protocol = IngestProtocol(IngestParts(hub.config, hub.catalog, hub.tracing, hub.bad_input))
    transport = RecordingTransport()
    protocol.connection_made(transport)
    data = b"".join(line + b"\n" for line in body_lines) + b'{"sync":"end"}\n'
    for i in range(0, len(data), chunk):
        protocol.data_received(data[i : i + chunk])
    answers = [orjson.loads(line) for line in transport.written.splitlines()]
    assert answers[-1]["type"] == "synced" and answers[-1]["id"] == "end"
    errors = [a for a in answers if a["type"] == "error"]
    assert all(1 <= e["line"] <= len(body_lines) and isinstance(e["code"], str) for e in errors)
    synced = answers[-1]
    assert synced["accepted"] + synced["refused"] <= len(body_lines)


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=60) | st.sampled_from(["http://[::1", "https://a:99999", "null", "http://x:80"]), st.text(max_size=30))
def test_any_origin_header_is_allowed_or_refused_never_an_exception(origin, host):
    guard = OriginGuard(None, parse_allowed_origins(["https://app.example.com"]))
    assert guard.allows(origin, host) in (True, False)

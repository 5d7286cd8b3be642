"""The pieces of Centrifugo's client protocol, in process: the Protobuf codec against the classes protoc made
from centrifugal/protocol's client.proto (as centrifuge-python ships them), our entries converted once per
frame (offset = seq + 1, a loss as an `unsubscribe` push 2500, a recovery's publications inside its reply,
errors and closes as Centrifugo's codes), and a fuzz of both codecs' readers."""

from __future__ import annotations

import random

import orjson
import pytest
from centrifuge.protocol import client_pb2 as pb  # type: ignore[import-untyped]

from core.entries import encode_error, encode_loss, encode_message, encode_reply, encode_subscribed
from gateway import close_codes
from gateway.centrifugo import client_codes as codes
from gateway.centrifugo.client_codec import BadFrame, JsonCodec, Raw
from gateway.centrifugo.client_frames import CentrifugoFramer
from gateway.centrifugo.client_proto import ProtobufCodec, decode_frame, delimited, encode, publication

pytestmark = pytest.mark.unit


def replies_of(payload: bytes) -> list[pb.Reply]:
    """A Protobuf frame's payload read by protoc's classes."""
    out, at = [], 0
    while at < len(payload):
        size, shift = 0, 0
        while True:
            byte = payload[at]
            at += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        out.append(pb.Reply.FromString(payload[at : at + size]))
        at += size
    return out


def test_replies_read_by_protocs_classes():
    reply = pb.Reply.FromString(
        encode("Reply", {"id": 7, "connect": {"client": "cf-1", "ping": 25, "pong": True, "expires": True, "ttl": 60}})
    )
    assert (reply.id, reply.connect.client, reply.connect.ping, reply.connect.pong, reply.connect.ttl) == (
        7,
        "cf-1",
        25,
        True,
        60,
    )
    reply = pb.Reply.FromString(
        encode(
            "Reply",
            {
                "id": 3,
                "subscribe": {
                    "recoverable": True,
                    "positioned": True,
                    "epoch": "e-1",
                    "offset": 2**40,
                    "recovered": True,
                    "was_recovering": True,
                    "publications": [{"data": Raw(b'{"a":1}'), "offset": 5}],
                },
            },
        )
    )
    sub = reply.subscribe
    assert (sub.recoverable, sub.epoch, sub.offset, sub.recovered, sub.was_recovering) == (True, "e-1", 2**40, True, True)
    assert [(p.data, p.offset) for p in sub.publications] == [(b'{"a":1}', 5)]
    reply = pb.Reply.FromString(
        encode("Reply", {"id": 4, "presence": {"presence": {"c1": {"user": "u", "client": "c1", "conn_info": Raw(b'{"n":1}')}}}})
    )
    assert reply.presence.presence["c1"].user == "u" and reply.presence.presence["c1"].conn_info == b'{"n":1}'
    reply = pb.Reply.FromString(encode("Reply", {"id": 5, "error": {"code": 103, "message": "no", "temporary": True}}))
    assert (reply.error.code, reply.error.message, reply.error.temporary) == (103, "no", True)
    reply = pb.Reply.FromString(encode("Reply", {"id": 6, "unsubscribe": {}}))
    assert reply.HasField("unsubscribe")
    reply = pb.Reply.FromString(
        encode("Reply", {"id": 8, "history": {"publications": [{"data": [1, 2], "offset": 1}], "offset": 9, "epoch": "e"}})
    )
    assert (reply.history.offset, reply.history.publications[0].data) == (9, b"[1,2]")
    push = pb.Reply.FromString(publication("news", 41, b'"x"')).push
    assert (push.channel, push.pub.data, push.pub.offset) == ("news", b'"x"', 42)
    assert publication("news", 41, b'"x"') == encode(
        "Reply", {"push": {"channel": "news", "pub": {"data": Raw(b'"x"'), "offset": 42}}}
    )
    assert delimited([encode("Reply", {})]) == b"\x00"  # the ping: one empty Reply


def test_commands_written_by_protocs_classes():
    commands = [
        pb.Command(id=1, connect=pb.ConnectRequest(token="t", name="python")),
        pb.Command(
            id=2, subscribe=pb.SubscribeRequest(channel="c", recover=True, offset=2**35, epoch="e", recoverable=True, flag=2)
        ),
        pb.Command(
            id=3, history=pb.HistoryRequest(channel="c", limit=-1, since=pb.StreamPosition(offset=4, epoch="e"), reverse=True)
        ),
        pb.Command(id=4, rpc=pb.RPCRequest(method="m", data=b'{"a":1}')),
        pb.Command(id=5, ping=pb.PingRequest()),
        pb.Command(),
    ]
    decoded = decode_frame(delimited([c.SerializeToString() for c in commands]))
    assert decoded == [
        {"id": 1, "connect": {"token": "t", "name": "python"}},
        {"id": 2, "subscribe": {"channel": "c", "recover": True, "offset": 2**35, "epoch": "e", "recoverable": True, "flag": 2}},
        {"id": 3, "history": {"channel": "c", "limit": -1, "since": {"offset": 4, "epoch": "e"}, "reverse": True}},
        {"id": 4, "rpc": {"method": "m", "data": b'{"a":1}'}},
        {"id": 5, "ping": {}},
        {},
    ]
    assert ProtobufCodec().data(b'{"a":1}') == {"a": 1}


def payload_of(wire: bytes) -> bytes:
    """A server frame's payload (RFC 6455 §5.2, unmasked)."""
    length = wire[1] & 0x7F
    return wire[2:] if length < 126 else wire[4:] if length == 126 else wire[10:]


def json_lines(framer: CentrifugoFramer, entries: list[bytes], answers=None) -> list[dict]:
    converted = framer.convert(entries, b"[" + b",".join(entries) + b"]", answers)
    assert converted.wire[0] == 0x81  # a text frame
    return [orjson.loads(line) for line in payload_of(converted.wire).split(b"\n")] if converted.wire else []


def test_entries_as_replies_and_pushes():
    framer = CentrifugoFramer(JsonCodec())
    # how the connection answers each of its commands, by id (gateway/centrifugo/client_session.py makes it)
    answers = {9: ("sub", "kwr"), 10: ("pub", ""), 11: ("unsub", ""), 12: ("rpc", ""), 13: ("sub", "")}
    entries = [
        encode_subscribed("t", "ring", "e-1", 5, 9),
        encode_message("t", 5, {"n": 5}),
        encode_message("t", 6, {"n": 6}),
        encode_message("u", 0, "x"),
        encode_reply(10, {"seq": 7}),
        encode_error("not_subscribed", "no", 11),
        encode_error("rpc_error", "403: not you", 12),
        encode_error("forbidden", "no", 13),
        encode_error("token_expired", "expired"),
    ]
    assert json_lines(framer, entries, answers) == [
        {
            "id": 9,
            "subscribe": {
                "recoverable": True,
                "positioned": True,
                "epoch": "e-1",
                "offset": 5,
                "was_recovering": True,
                "recovered": True,
                "publications": [{"data": {"n": 5}, "offset": 6}, {"data": {"n": 6}, "offset": 7}],
            },
        },
        {"push": {"channel": "u", "pub": {"data": "x", "offset": 1}}},
        {"id": 10, "publish": {}},
        {"id": 11, "unsubscribe": {}},
        {"id": 12, "error": {"code": 403, "message": "not you"}},
        {"id": 13, "error": {"code": 103, "message": "no"}},
    ]
    assert answers == {}  # each answer taken as its entry was converted: the table holds what is in flight


def test_a_loss_is_an_unsubscribe_push_and_the_rest_of_the_topic_is_left_out():
    framer = CentrifugoFramer(JsonCodec())
    entries = [encode_message("t", 1, 1), encode_loss("t", 2, 9, "lagged"), encode_message("t", 9, 9), encode_message("v", 3, 3)]
    frame = b"[" + b",".join(entries) + b"]"
    converted = framer.convert(entries, frame)
    assert converted.lost == ("t",)
    assert [orjson.loads(line) for line in payload_of(converted.wire).split(b"\n")] == [
        {"push": {"channel": "t", "pub": {"data": 1, "offset": 2}}},
        {"push": {"channel": "t", "unsubscribe": {"code": 2500, "reason": "insufficient state"}}},
        {"push": {"channel": "v", "pub": {"data": 3, "offset": 4}}},
    ]
    assert framer.convert(entries, frame) is converted  # once per frame, for every client that gets it
    assert converted.shared  # the same for every client: may go to the fan-out writer's crowds
    reply = [encode_reply(1, {"seq": 1})]
    assert not framer.convert(reply, b"[" + reply[0] + b"]").shared  # one client's answer


def test_protobuf_frames_are_binary_and_delimited():
    framer = CentrifugoFramer(ProtobufCodec())
    entries = [encode_message("t", 1, {"a": 1}), encode_message("t", 2, None)]
    wire = framer.convert(entries, b"[" + b",".join(entries) + b"]").wire
    assert wire[0] == 0x82
    replies = replies_of(payload_of(wire))
    assert [(r.push.channel, r.push.pub.data, r.push.pub.offset) for r in replies] == [("t", b'{"a":1}', 2), ("t", b"null", 3)]


def test_no_close_code_of_ours_reaches_a_centrifugo_client():
    ours = [value for name, value in vars(close_codes).items() if name.isupper() and isinstance(value, int)]
    for code in ours:
        mapped = codes.close_code(code)
        assert mapped < 4000, (code, mapped)
    assert codes.close_code(close_codes.BAD_TOKEN) == 3500
    assert codes.close_code(close_codes.DISCONNECTED) == 3503
    assert codes.close_code(close_codes.REPLACED) == 3504
    assert codes.close_code(close_codes.SERVICE_RESTART) == 1012
    assert codes.close_reason('{"reason": "x"}').startswith('"reason"') is True
    assert len(codes.close_reason("é" * 200).encode()) <= 120


def test_fuzzed_frames_are_bad_frames_or_commands():
    rng = random.Random(38)
    codecs = [JsonCodec(), ProtobufCodec()]
    seeds = [b'{"id":1,"connect":{}}', pb.Command(id=2, subscribe=pb.SubscribeRequest(channel="c")).SerializeToString()]
    for _ in range(3000):
        seed = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            seed[rng.randrange(len(seed))] = rng.randrange(256)
        payload = bytes(seed) if rng.random() < 0.7 else rng.randbytes(rng.randint(0, 40))
        for codec in codecs:
            try:
                commands = codec.decode(payload, True)
            except BadFrame:
                continue
            assert all(isinstance(command, dict) for command in commands)


def test_the_path_and_the_timers_are_checked_at_start():
    from gateway.config import ConfigError, load_config

    assert load_config(environ={}).centrifugo.path == "/connection/websocket"
    for bad in ({"path": "/ws"}, {"path": "connection"}, {"ping_interval_s": 0}, {"pong_timeout_s": -1.0}):
        with pytest.raises(ConfigError, match="centrifugo"):
            load_config(overrides={"centrifugo": bad}, environ={})

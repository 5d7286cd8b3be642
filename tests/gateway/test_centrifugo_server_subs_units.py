"""The pieces of server-side subscriptions in Centrifugo's client protocol, in process: `connect` `subs` read
from Protobuf as protoc's classes write it, the connect result's `subs` read back by them, a bad `subs`
refused, and the `subscribed` entry of a subscription the connect result carries left out."""

from __future__ import annotations

import orjson
import pytest
from centrifuge.protocol import client_pb2 as pb  # type: ignore[import-untyped]

from core.entries import encode_error, encode_subscribed
from gateway.centrifugo.client_codec import JsonCodec, Raw
from gateway.centrifugo.client_frames import SERVER_SUB_ID, CentrifugoFramer
from gateway.centrifugo.client_proto import ProtobufCodec, delimited
from gateway.centrifugo.server_subs import asked_positions

pytestmark = pytest.mark.unit


def test_connect_subs_written_by_protocs_classes():
    command = pb.Command(
        id=1,
        connect=pb.ConnectRequest(
            token="t", subs={"a": pb.SubscribeRequest(recover=True, offset=7, epoch="e"), "b": pb.SubscribeRequest()}
        ),
    )
    decoded = ProtobufCodec().decode(delimited([command.SerializeToString()]), False)
    assert decoded == [{"id": 1, "connect": {"token": "t", "subs": {"a": {"recover": True, "offset": 7, "epoch": "e"}, "b": {}}}}]
    assert asked_positions(decoded[0]["connect"]["subs"]) == {"a": (7, "e")}


def test_the_connect_result_subs_read_by_protocs_classes():
    result = {
        "client": "c",
        "subs": {
            "a": {
                "recoverable": True,
                "positioned": True,
                "epoch": "e",
                "offset": 2,
                "was_recovering": True,
                "recovered": True,
                "publications": [{"data": Raw(b'{"n":1}'), "offset": 3}],
            },
            "b": {},
        },
    }
    reply = pb.Reply.FromString(ProtobufCodec().encode({"id": 1, "connect": result}))
    a = reply.connect.subs["a"]
    assert (a.recoverable, a.positioned, a.epoch, a.offset, a.was_recovering, a.recovered) == (True, True, "e", 2, True, True)
    assert [(p.offset, p.data) for p in a.publications] == [(3, b'{"n":1}')]
    assert "b" in reply.connect.subs
    assert orjson.loads(JsonCodec().encode({"id": 1, "connect": result}))["connect"]["subs"]["a"]["publications"] == [
        {"data": {"n": 1}, "offset": 3}
    ]


@pytest.mark.parametrize(
    "subs", [[], {"a": 1}, {"a": {"offset": "1"}}, {"a": {"offset": -1}}, {"a": {"epoch": 3}}, {"a": {"offset": 1 << 60}}]
)
def test_a_bad_subs_is_refused(subs):
    with pytest.raises(ValueError):
        asked_positions(subs)


def test_without_recover_nothing_is_asked():
    assert asked_positions(None) == {} and asked_positions({"a": {"offset": 3, "epoch": "e"}}) == {}


def test_the_subscribed_entry_and_a_late_refusal_of_a_connect_subscription_are_left_out():
    framer = CentrifugoFramer(JsonCodec())
    entries = [encode_subscribed("a", "ring", "e", 0, SERVER_SUB_ID), encode_error("forbidden", "no", SERVER_SUB_ID)]
    assert framer.convert(entries, b"frame").wire == b""
    pushed = framer.convert([encode_subscribed("a", "ring", "e", 0)], b"other").wire  # the server API's: a push
    assert b'"subscribe"' in pushed

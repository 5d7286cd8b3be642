"""Centrifugo's client protocol v2 in Protobuf: binary frames of varint-length-prefixed messages, `Command`
in and `Reply` out, as centrifugal/protocol `definitions/client.proto` defines them.

The messages are read and written from the field tables below (the numbers of client.proto; fields this
gateway never reads or writes are left out, and skipped when they come), to and from the dicts of the JSON
form, so both codecs share everything else. A `bytes` data field holds the data's JSON text: a Protobuf
client of this gateway publishes JSON (docs/centrifugo.md).
"""

from __future__ import annotations

from typing import Any

import orjson

from .client_codec import BadFrame, Raw
from .history import History, Row

#: wire types
VARINT, LEN = 0, 2
#: how deep messages may nest in a command (FilterNode nests itself: never read past this)
MAX_DEPTH = 8

# field kinds: "u" unsigned varint, "i" signed (two's complement) varint, "b" bool, "s" string, "y" bytes,
# a message name, "*Name" a repeated message, "map:Name" a map<string, Name>
_STREAM_POSITION = {"offset": (1, "u"), "epoch": (2, "s")}
_CLIENT_INFO = {"user": (1, "s"), "client": (2, "s"), "conn_info": (3, "y"), "chan_info": (4, "y")}
_PUBLICATION = {"data": (4, "y"), "info": (5, "ClientInfo"), "offset": (6, "u")}

SCHEMA: dict[str, dict[str, tuple[int, str]]] = {
    # client -> server
    "Command": {
        "id": (1, "u"),
        "connect": (4, "ConnectRequest"),
        "subscribe": (5, "SubscribeRequest"),
        "unsubscribe": (6, "ChannelRequest"),
        "publish": (7, "PublishRequest"),
        "presence": (8, "ChannelRequest"),
        "presence_stats": (9, "ChannelRequest"),
        "history": (10, "HistoryRequest"),
        "ping": (11, "Empty"),
        "send": (12, "DataRequest"),
        "rpc": (13, "RPCRequest"),
        "refresh": (14, "TokenRequest"),
        "sub_refresh": (15, "SubRefreshRequest"),
    },
    "ConnectRequest": {
        "token": (1, "s"),
        "data": (2, "y"),
        "subs": (3, "map:SubscribeRequest"),
        "name": (4, "s"),
        "version": (5, "s"),
        "flag": (7, "i"),
    },
    "SubscribeRequest": {
        "channel": (1, "s"),
        "token": (2, "s"),
        "recover": (3, "b"),
        "epoch": (6, "s"),
        "offset": (7, "u"),
        "data": (8, "y"),
        "positioned": (9, "b"),
        "recoverable": (10, "b"),
        "join_leave": (11, "b"),
        "delta": (12, "s"),
        "tf": (13, "Empty"),
        "flag": (14, "i"),
    },
    "ChannelRequest": {"channel": (1, "s")},
    "PublishRequest": {"channel": (1, "s"), "data": (2, "y")},
    "HistoryRequest": {"channel": (1, "s"), "limit": (7, "i"), "since": (8, "StreamPosition"), "reverse": (9, "b")},
    "RPCRequest": {"data": (1, "y"), "method": (2, "s")},
    "DataRequest": {"data": (1, "y")},
    "TokenRequest": {"token": (1, "s")},
    "SubRefreshRequest": {"channel": (1, "s"), "token": (2, "s")},
    "StreamPosition": _STREAM_POSITION,
    "Empty": {},
    # server -> client
    "Reply": {
        "id": (1, "u"),
        "error": (2, "Error"),
        "push": (4, "Push"),
        "connect": (5, "ConnectResult"),
        "subscribe": (6, "SubscribeResult"),
        "unsubscribe": (7, "Empty"),
        "publish": (8, "Empty"),
        "presence": (9, "PresenceResult"),
        "presence_stats": (10, "PresenceStatsResult"),
        "history": (11, "HistoryResult"),
        "ping": (12, "Empty"),
        "rpc": (13, "RPCResult"),
        "refresh": (14, "RefreshResult"),
        "sub_refresh": (15, "SubRefreshResult"),
    },
    "Error": {"code": (1, "u"), "message": (2, "s"), "temporary": (3, "b")},
    "Push": {
        "channel": (2, "s"),
        "pub": (4, "Publication"),
        "join": (5, "Join"),
        "leave": (6, "Join"),
        "unsubscribe": (7, "Unsubscribe"),
        "subscribe": (9, "Subscribe"),
        "disconnect": (11, "Disconnect"),
    },
    "ClientInfo": _CLIENT_INFO,
    "Publication": _PUBLICATION,
    "Join": {"info": (1, "ClientInfo")},
    "Unsubscribe": {"code": (2, "u"), "reason": (3, "s")},
    "Subscribe": {"recoverable": (1, "b"), "epoch": (4, "s"), "offset": (5, "u"), "positioned": (6, "b")},
    "Disconnect": {"code": (1, "u"), "reason": (2, "s")},
    "ConnectResult": {
        "client": (1, "s"),
        "version": (2, "s"),
        "expires": (3, "b"),
        "ttl": (4, "u"),
        "subs": (6, "map:SubscribeResult"),
        "ping": (7, "u"),
        "pong": (8, "b"),
    },
    "RefreshResult": {"expires": (3, "b"), "ttl": (4, "u")},
    "SubRefreshResult": {"expires": (1, "b"), "ttl": (2, "u")},
    "SubscribeResult": {
        "expires": (1, "b"),
        "ttl": (2, "u"),
        "recoverable": (3, "b"),
        "epoch": (6, "s"),
        "publications": (7, "*Publication"),
        "recovered": (8, "b"),
        "offset": (9, "u"),
        "positioned": (10, "b"),
        "was_recovering": (12, "b"),
    },
    "PresenceResult": {"presence": (1, "map:ClientInfo")},
    "PresenceStatsResult": {"num_clients": (1, "u"), "num_users": (2, "u")},
    "HistoryResult": {"publications": (1, "*Publication"), "epoch": (2, "s"), "offset": (3, "u")},
    "RPCResult": {"data": (1, "y")},
}
#: the tables by field number, to read
_BY_NUMBER = {name: {number: (field, kind) for field, (number, kind) in fields.items()} for name, fields in SCHEMA.items()}
#: a map's entries, to read: `MapEntry:VALUE` {1: key, 2: value}
_BY_NUMBER.update(
    {
        f"MapEntry:{kind[4:]}": {1: ("key", "s"), 2: ("value", kind[4:])}
        for fields in SCHEMA.values()
        for _, kind in fields.values()
        if kind.startswith("map:")
    }
)


# -- writing ------------------------------------------------------------------------------------------------


def varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return varint(number << 3 | wire)


def _delimited(number: int, body: bytes) -> bytes:
    return _key(number, LEN) + varint(len(body)) + body


def _data_bytes(value: Any) -> bytes:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, bytes):
        return value
    return orjson.dumps(value)


def encode(name: str, message: dict[str, Any]) -> bytes:
    """A message of the schema from its JSON form; default values are left out, as proto3 writes them."""
    out = []
    fields = SCHEMA[name]
    for field, value in message.items():
        spec = fields.get(field)
        if spec is None or value is None:
            continue
        number, kind = spec
        if kind in ("u", "i"):
            if value:
                out.append(_key(number, VARINT) + varint(int(value)))
        elif kind == "b":
            if value:
                out.append(_key(number, VARINT) + b"\x01")
        elif kind == "s":
            if value:
                out.append(_delimited(number, str(value).encode()))
        elif kind == "y":
            out.append(_delimited(number, _data_bytes(value)))
        elif kind.startswith("*") and isinstance(value, Raw):  # the repeated field's entries, written already
            out.append(value.text)
        elif kind.startswith("*"):
            out += [_delimited(number, encode(kind[1:], item)) for item in value]
        elif kind.startswith("map:"):
            out += [
                _delimited(number, _delimited(1, str(key).encode()) + _delimited(2, encode(kind[4:], item)))
                for key, item in value.items()
            ]
        else:
            out.append(_delimited(number, encode(kind, value)))
    return b"".join(out)


def publication(topic: str, seq: int, data: bytes) -> bytes:
    """The Reply of a publication push, written directly (once per message, shared by every subscriber)."""
    pub = _delimited(4, data) + _key(6, VARINT) + varint(seq + 1)
    return _delimited(4, _delimited(2, topic.encode()) + _delimited(4, pub))


#: the varints of small values, looked up: a history answer writes three per publication
_SMALL_VARINTS = [varint(value) for value in range(1 << 14)]
_PUBLICATION_DATA, _PUBLICATION_OFFSET, _HISTORY_PUBLICATION = _key(4, LEN), _key(6, VARINT), _key(1, LEN)


def history_publications(rows: list[Row]) -> bytes:
    """HistoryResult's `publications` (field 1), each a Publication {data: 4, offset: 6}, written directly."""
    small = _SMALL_VARINTS
    out: list[bytes] = []
    for offset, data in rows:
        size = len(data)
        pub = b"".join(
            (
                _PUBLICATION_DATA,
                small[size] if size < 16384 else varint(size),
                data,
                _PUBLICATION_OFFSET,
                small[offset] if offset < 16384 else varint(offset),
            )
        )
        size = len(pub)
        out += (_HISTORY_PUBLICATION, small[size] if size < 16384 else varint(size), pub)
    return b"".join(out)


def delimited(messages: list[bytes]) -> bytes:
    return b"".join(varint(len(message)) + message for message in messages)


# -- reading ------------------------------------------------------------------------------------------------


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise BadFrame("a varint is cut short or too long")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def decode(name: str, data: bytes, depth: int = 0) -> dict[str, Any]:
    """A message of the schema into its JSON form (unknown fields skipped); raises BadFrame."""
    if depth > MAX_DEPTH:
        raise BadFrame("messages nested too deep")
    fields = _BY_NUMBER[name]
    message: dict[str, Any] = {}
    at = 0
    while at < len(data):
        key, at = _read_varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            value, at = _read_varint(data, at)
            raw: Any = value
        elif wire == LEN:
            size, at = _read_varint(data, at)
            if at + size > len(data):
                raise BadFrame("a field is cut short")
            raw, at = data[at : at + size], at + size
        elif wire in (1, 5):  # fixed 64 / 32 bits: no field of ours, skipped
            at += 8 if wire == 1 else 4
            continue
        else:
            raise BadFrame(f"wire type {wire} is not supported")
        spec = fields.get(number)
        if spec is None:
            continue
        field, kind = spec
        if kind.startswith("map:"):  # repeated {1: key, 2: value} entries, gathered in one dict
            if wire != LEN:
                raise BadFrame("a field of the wrong wire type")
            entry = decode("MapEntry:" + kind[4:], raw, depth + 1)
            message.setdefault(field, {})[entry.get("key", "")] = entry.get("value", {})
        else:
            message[field] = _value(kind, raw, wire, depth)
    return message


def _value(kind: str, raw: Any, wire: int, depth: int) -> Any:
    if (wire == VARINT) != (kind in ("u", "i", "b")):
        raise BadFrame("a field of the wrong wire type")
    if kind == "u":
        return raw
    if kind == "i":
        return raw - (1 << 64) if raw >= 1 << 63 else raw
    if kind == "b":
        return bool(raw)
    if kind == "s":
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise BadFrame("a string field is not UTF-8") from None
    if kind == "y":
        return bytes(raw)
    return decode(kind, raw, depth + 1)


def decode_frame(payload: bytes) -> list[dict[str, Any]]:
    """The Commands of one binary frame."""
    commands = []
    at = 0
    while at < len(payload):
        size, at = _read_varint(payload, at)
        if at + size > len(payload):
            raise BadFrame("a command is cut short")
        commands.append(decode("Command", payload[at : at + size]))
        at += size
    return commands


class ProtobufCodec:
    variant = -2
    frame_first = 0x82
    subprotocol = "centrifuge-protobuf"
    ping = b""  # an empty Reply: the frame is the single byte 0

    def encode(self, reply: dict[str, Any]) -> bytes:
        return encode("Reply", reply)

    def join(self, replies: list[bytes]) -> bytes:
        return delimited(replies)

    def publication(self, topic_json: bytes, seq: int, data: bytes) -> bytes:
        return publication(orjson.loads(topic_json), seq, data)

    def history(self, command_id: int, history: History) -> bytes:
        return encode(
            "Reply",
            {
                "id": command_id,
                "history": {
                    "publications": Raw(history_publications(history.rows)),
                    "epoch": history.epoch,
                    "offset": history.offset,
                },
            },
        )

    def decode(self, payload: bytes, text: bool) -> list[dict[str, Any]]:
        return decode_frame(payload)

    def data(self, value: Any) -> Any:
        if value is None:
            return None
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"`data` is not JSON: {exc}") from None

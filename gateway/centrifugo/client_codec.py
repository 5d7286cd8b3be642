"""The two wire forms of Centrifugo's client protocol v2: JSON (text frames, one object a line) and Protobuf
(binary frames of varint-delimited messages, gateway/centrifugo/client_proto.py).

Both read a frame into commands as dicts of the JSON form (`{"id": N, "subscribe": {...}}`), `data` fields
decoded to JSON values, and write replies given in that form, a `Raw` value standing for a data field's JSON
text (embedded as it is in JSON, its bytes in Protobuf).
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from .history import History, json_publications


class BadFrame(Exception):
    """A frame that is not a sequence of commands of the codec: the connection is closed with 3501."""


class Raw:
    """A data field's JSON text, written as it is (never parsed and encoded again)."""

    __slots__ = ("text",)

    def __init__(self, text: bytes) -> None:
        self.text = text


def _fragment(value: object) -> Any:
    if isinstance(value, Raw):
        return orjson.Fragment(value.text)
    raise TypeError(f"cannot encode {type(value).__name__}")


class Codec(Protocol):
    #: the connection's `wire_variant` (gateway/scheduler.py groups direct writes by it) when uncompressed:
    #: negative, never a `/ws` deflate window's; compressed, gateway/transports/ws_centrifugo.py `wire_variant`
    variant: int
    #: the first byte of its frames (text or binary, final)
    frame_first: int
    #: the subprotocol name of the form
    subprotocol: str
    #: the server's ping, encoded (a reply with neither id nor push)
    ping: bytes

    def encode(self, reply: dict[str, Any]) -> bytes: ...

    def join(self, replies: list[bytes]) -> bytes: ...

    def publication(self, topic_json: bytes, seq: int, data: bytes) -> bytes:
        """The push of a publication: channel, data (its JSON text) and offset = seq + 1."""

    def history(self, command_id: int, history: History) -> bytes:
        """The reply to a `history` command, its publications written in one pass (gateway/centrifugo/history.py)."""

    def decode(self, payload: bytes, text: bool) -> list[dict[str, Any]]:
        """The commands of one frame; raises BadFrame."""

    def data(self, value: Any) -> Any:
        """A command's data field as a JSON value (Protobuf: JSON text bytes); raises ValueError."""


class JsonCodec:
    variant = -1
    frame_first = 0x81
    subprotocol = "centrifuge-json"
    ping = b"{}"

    def encode(self, reply: dict[str, Any]) -> bytes:
        return orjson.dumps(reply, default=_fragment)

    def join(self, replies: list[bytes]) -> bytes:
        return b"\n".join(replies)

    def publication(self, topic_json: bytes, seq: int, data: bytes) -> bytes:
        return b"".join(
            (b'{"push":{"channel":', topic_json, b',"pub":{"data":', data, b',"offset":', str(seq + 1).encode(), b"}}}")
        )

    def history(self, command_id: int, history: History) -> bytes:
        return self.encode(
            {
                "id": command_id,
                "history": {
                    "publications": Raw(json_publications(history.rows)),
                    "offset": history.offset,
                    "epoch": history.epoch,
                },
            }
        )

    def decode(self, payload: bytes, text: bool) -> list[dict[str, Any]]:
        commands = []
        for line in payload.split(b"\n"):
            if not line.strip():
                continue
            try:
                command = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise BadFrame(f"a line is not JSON: {exc}") from None
            if not isinstance(command, dict):
                raise BadFrame("a command is a JSON object")
            commands.append(command)
        return commands

    def data(self, value: Any) -> Any:
        return value

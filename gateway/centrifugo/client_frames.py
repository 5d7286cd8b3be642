"""Our engine's entries (docs/protocol.md) as Centrifugo replies and pushes, converted once per frame.

A Centrifugo connection gets the same batches as a `/ws` one; its framer turns a batch's entries into the
codec's replies and pushes, joined into one WebSocket frame. The conversion depends on the entries alone, so
a frame many subscribers get (a publication) is converted once for all of them (`CentrifugoFramer` keeps the
cycle's frames), and a message entry once for every frame it is in.

Per-client answers carry the Centrifugo command's id as their request id; how to answer it (the method,
the subscribe's flags) is in the connection's table of `Answers` keyed by that id, made as the command is
decoded (gateway/centrifugo/client_session.py) and taken as its answer is converted: a `subscribed` entry
becomes the subscribe reply, a `reply` the method's result, an `error` the reply's error. Entries queued by
the Centrifugo session itself are already in the codec's form, marked by a leading zero byte (`READY`).

Centrifugo's streams have no loss notice: a `loss` entry becomes an `unsubscribe` push with code 2500
(insufficient state), which makes the SDK subscribe again, recovering from its position or saying
`recovered: false`; the subscription it ends is dropped here too (`Converted.lost`), and the rest of the
frame's entries of that topic are left out.
"""

from __future__ import annotations

import math
import time
from typing import Any

import orjson

from core.entries import split_message

from ..wsframes import FrameCache, text_frame_header
from . import client_codes as codes
from .client_codec import Codec, Raw

#: the first byte of an entry already in the codec's form
READY = 0
#: payload bytes of converted frames a framer keeps (a cycle's frames, for the direct writes), and of
#: converted message entries; past either the cache starts again
CACHE_BYTES = 1 << 20
#: the request id of the unsubscribe that drops a lost subscription: its `unsubscribed` entry is not shown
#: (negative: never a command's id, which is a uint32)
LOST_ID = -1
#: the request id of a server-side subscription made by `connect` (gateway/centrifugo/server_subs.py): the
#: connect result carries it, so its `subscribed` entry (and a late refusal's error) is not shown
SERVER_SUB_ID = -2
#: unsubscribe push codes: below 2500 the SDK stays unsubscribed, from 2500 it subscribes again
SERVER_UNSUBSCRIBE = 2000
INSUFFICIENT_STATE = 2500

#: how to answer a command, by its id: (method, flags); flags of a subscribe: k recoverable, p positioned,
#: w was recovering, r recovered (its publications follow in the frame)
Answer = tuple[str, str]
Answers = dict[int, Answer]
#: the answers of the gateway's own request ids, the same for every connection
OWN_ANSWERS: dict[int, Answer] = {LOST_ID: ("lost", ""), SERVER_SUB_ID: ("csub", "")}


def _answer(answers: Answers | None, request_id: Any) -> tuple[int, str, str] | None:
    """The command an entry answers (its id, method, flags), taken from the table: None for an entry that
    answers no command of the client (a server-side subscription's, an expiry's notice)."""
    if type(request_id) is not int:
        return None
    answer = OWN_ANSWERS.get(request_id) if request_id < 0 or answers is None else answers.pop(request_id, None)
    return None if answer is None else (request_id, *answer)


#: the kinds of entries that are the same for every client that gets them (the others answer one client)
SHARED_KINDS = frozenset((b'{"type":"loss"', b'{"type":"closed"', b'{"type":"join"', b'{"type":"leave"'))


class Converted:
    """A frame in Centrifugo's form: its WebSocket frame (b"" when nothing of it is for the client), the
    topics whose subscriptions it ended with an `unsubscribe` push (to drop), and whether it answers no
    client in particular (a frame of publications: many clients get it)."""

    __slots__ = ("wire", "lost", "shared")

    def __init__(self, wire: bytes, lost: tuple[str, ...], shared: bool) -> None:
        self.wire = wire
        self.lost = lost
        self.shared = shared


class CentrifugoFramer:
    """Frames of one codec, converted once per frame (module docstring)."""

    __slots__ = ("codec", "frames", "messages", "last_frame", "last")

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.frames: FrameCache[Converted] = FrameCache(CACHE_BYTES)
        self.messages: FrameCache[bytes] = FrameCache(CACHE_BYTES)
        self.last_frame = b""
        self.last = Converted(b"", (), True)

    def convert(self, entries: list[bytes], frame: bytes, answers: Answers | None = None) -> Converted:
        """The frame in the codec's form; `answers`: the table of the connection it goes to, whose entries
        for the commands the frame answers are taken (a frame of one client's answers is converted once:
        its connection keeps it, `CentrifugoConnection`)."""
        if frame is self.last_frame:
            return self.last
        converted = self.frames.items.get(frame)
        if converted is None:
            converted = self._convert(entries, answers)
            if not converted.shared:  # one client's answers are converted for it alone: not kept
                return converted
            self.frames.put(frame, converted)
        self.last_frame, self.last = frame, converted
        return converted

    def _convert(self, entries: list[bytes], answers: Answers | None) -> Converted:
        codec = self.codec
        lost: list[str] = []
        replies: list[bytes | dict[str, Any]] = []
        #: subscribe replies of a recovery in this frame, by topic: the frame's publications of the topic go
        #: in them (centrifuge-js handles a push of a later frame in the same read before a reply's)
        recovering: dict[str, list[dict[str, Any]]] = {}
        shared = True
        for entry in entries:
            if entry[0] == READY:
                replies.append(entry[1:])
                shared = False
                continue
            message = self.messages.items.get(entry)
            if message is None:
                message = self._message(entry)
            if message is not None:
                if lost or recovering:
                    parts = split_message(entry)
                    assert parts is not None
                    topic = orjson.loads(parts[0])
                    if topic in lost:
                        continue
                    if topic in recovering:
                        recovering[topic].append({"data": Raw(parts[2]), "offset": parts[1] + 1})
                        continue
                replies.append(message)
                continue
            if shared and entry[: entry.find(b",")] not in SHARED_KINDS:
                shared = False
            reply = convert_entry(orjson.loads(entry), lost, answers)
            if reply is not None:
                replies.append(reply)
                publications = reply.get("subscribe", {}).get("publications")
                if publications is not None:
                    recovering[reply["subscribe"].pop("channel")] = publications
        if not replies:
            return Converted(b"", tuple(lost), shared)
        payload = codec.join([reply if isinstance(reply, bytes) else codec.encode(reply) for reply in replies])
        return Converted(text_frame_header(len(payload), codec.frame_first) + payload, tuple(lost), shared)

    def _message(self, entry: bytes) -> bytes | None:
        parts = split_message(entry)
        if parts is None:
            return None
        message = self.codec.publication(*parts)
        self.messages.put(entry, message)
        return message


# -- one entry ------------------------------------------------------------------------------------------------


def convert_entry(entry: dict[str, Any], lost: list[str], answers: Answers | None = None) -> dict[str, Any] | None:
    """One entry (other than a message) as a Centrifugo reply or push; None when it has none. `lost`: the
    topics of the frame whose subscription an earlier entry ended (their entries are left out), appended to;
    `answers`: the connection's table, what an answer entry answers is taken from it."""
    kind = entry.get("type")
    topic = entry.get("topic")
    if topic is not None and topic in lost:
        return None
    if kind == "reply":
        return _reply(entry, answers)
    if kind == "error":
        return _error(entry, answers)
    if kind == "subscribed":
        return _subscribed(entry, answers)
    if kind == "unsubscribed":
        return _unsubscribed(entry, answers)
    if kind == "loss":
        lost.append(str(topic))
        return _push(topic, "unsubscribe", {"code": INSUFFICIENT_STATE, "reason": "insufficient state"})
    if kind == "closed":
        resubscribe = entry.get("reason") == "lost"
        code = INSUFFICIENT_STATE if resubscribe else SERVER_UNSUBSCRIBE
        return _push(topic, "unsubscribe", {"code": code, "reason": f"channel {entry.get('reason')}"})
    if kind in ("join", "leave"):
        return _push(topic, str(kind), {"info": {"user": entry.get("user") or "", "client": entry.get("client")}})
    return None


def _push(channel: Any, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"push": {"channel": channel, kind: body}}


def _subscribed(entry: dict[str, Any], answers: Answers | None) -> dict[str, Any] | None:
    parsed = _answer(answers, entry.get("id"))
    body: dict[str, Any] = {}
    if parsed is None:  # a server-side subscription (the connect hook's, the API's `subscribe`)
        if entry.get("id") is not None:
            return None
        if entry.get("kind") == "ring":
            body = {"recoverable": True, "positioned": True, "epoch": entry["epoch"], "offset": entry["seq"]}
        return _push(entry.get("topic"), "subscribe", body)
    command_id, method, flags = parsed
    if method == "csub":
        return None
    if "k" in flags:
        body["recoverable"] = True
    if "k" in flags or "p" in flags:
        body.update(positioned=True, epoch=entry["epoch"], offset=entry["seq"])
    if "w" in flags:
        body["was_recovering"] = True
    if "r" in flags:  # the publications that follow in the frame go in the reply (`CentrifugoFramer`)
        body.update(recovered=True, publications=[], channel=entry.get("topic"))
    return {"id": command_id, "subscribe": body}


def _unsubscribed(entry: dict[str, Any], answers: Answers | None) -> dict[str, Any] | None:
    parsed = _answer(answers, entry.get("id"))
    if parsed is not None:
        return None if parsed[1] == "lost" else {"id": parsed[0], "unsubscribe": {}}
    if entry.get("id") is not None:
        return None
    return _push(entry.get("topic"), "unsubscribe", {"code": SERVER_UNSUBSCRIBE, "reason": "server unsubscribe"})


def _error(entry: dict[str, Any], answers: Answers | None) -> dict[str, Any] | None:
    parsed = _answer(answers, entry.get("id"))
    if parsed is None:  # about no command of the client (an expiry's notice: the refresh is the SDK's)
        return None
    command_id, method, _ = parsed
    if method == "csub":  # a server-side subscription the broker refused late: the connect was answered
        return None
    if method == "unsub":  # an unsubscribe that errors makes the SDKs reconnect: it always succeeds
        return {"id": command_id, "unsubscribe": {}}
    code, message = codes.error_code(str(entry.get("code"))), str(entry.get("message"))
    if entry.get("code") == "rpc_error":  # the backend's "C: M"
        head, _, rest = message.partition(": ")
        if head.isdigit() and rest:
            code, message = int(head), rest
    return error_reply(command_id, code, message)


def error_reply(command_id: int, code: int, message: str) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if code in codes.TEMPORARY:
        error["temporary"] = True
    return {"id": command_id, "error": error}


def _reply(entry: dict[str, Any], answers: Answers | None) -> dict[str, Any] | None:
    parsed = _answer(answers, entry.get("id"))
    if parsed is None:
        return None
    command_id, method, _ = parsed
    result = entry.get("result")
    if method == "pub":
        return {"id": command_id, "publish": {}}
    if method == "rpc":
        return {"id": command_id, "rpc": {"data": Raw(orjson.dumps(result))}}
    if method == "stats" and isinstance(result, dict):
        return {
            "id": command_id,
            "presence_stats": {"num_clients": result.get("clients", 0), "num_users": result.get("users", 0)},
        }
    if method == "presence" and isinstance(result, dict):
        return _presence(command_id, result)
    if method == "refresh" and isinstance(result, dict):
        return {"id": command_id, "refresh": expiry(result.get("expires_at"))}
    return {"id": command_id, method: {}}


def _presence(command_id: int, result: dict[str, Any]) -> dict[str, Any]:
    members = result.get("members")
    if members is None:
        return error_reply(
            command_id, codes.LIMIT_EXCEEDED, "too many members to list (limits.presence_max_members): ask presence_stats"
        )
    presence = {}
    for member in members:
        info: dict[str, Any] = {"user": member.get("user") or "", "client": member.get("client")}
        if member.get("info") is not None:
            info["conn_info"] = Raw(orjson.dumps(member["info"]))
        presence[member.get("client")] = info
    return {"id": command_id, "presence": {"presence": presence}}


def expiry(expires_at: Any) -> dict[str, Any]:
    """`expires` and `ttl` (whole seconds, at least 1) of a token expiring at `expires_at` (Unix seconds)."""
    if not isinstance(expires_at, (int, float)) or math.isinf(expires_at):
        return {}
    return {"expires": True, "ttl": max(1, math.ceil(expires_at - time.time()))}

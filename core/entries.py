"""Encoding of server-to-client entries (docs/protocol.md), done once per entry.

A message entry is encoded when it is published and the same `bytes` object is handed to every subscriber
(docs/design/shared-rings.md §4): fan-out never re-serialises. Batches are spliced from entries with `frame_batch`.
"""

from __future__ import annotations

from typing import Any, Iterable

import orjson


def _dumps(value: Any) -> bytes:
    """orjson's output, right-sized. orjson (3.12+) returns a bytes object inside a buffer of at least
    4 KiB that it never shrinks: a stored 100-byte entry would hold 4 KiB (ring of 1,024 messages: 4 MiB
    instead of 100 KiB). One copy per encode (~0.1 us) keeps memory what the entries weigh."""
    return bytes(memoryview(orjson.dumps(value)))


#: the parts of a message entry as `encode_message` lays it out: its start, then the topic, seq and data
MSG_HEAD = b'{"type":"msg","topic":'
SEQ_KEY = b',"seq":'
DATA_KEY = b',"data":'


def encode_message(topic: str, seq: int, data: Any) -> bytes:
    return _dumps({"type": "msg", "topic": topic, "seq": seq, "data": data})


def split_message(entry: bytes) -> tuple[bytes, int, bytes] | None:
    """A message entry's encoded topic, seq and data text, cut out of its bytes without a parse (inside the
    encoded topic every `"` is escaped, so the first `,"seq":` and `,"data":` are the keys); None for any
    other entry. The data is last: the text runs to the entry's closing brace."""
    if not entry.startswith(MSG_HEAD):
        return None
    at_seq = entry.find(SEQ_KEY, len(MSG_HEAD))
    at_data = entry.find(DATA_KEY, at_seq)
    if at_seq < 0 or at_data < 0:
        return None
    seq_text = entry[at_seq + len(SEQ_KEY) : at_data]
    if not seq_text.isdigit():
        return None
    return entry[len(MSG_HEAD) : at_seq], int(seq_text), entry[at_data + len(DATA_KEY) : -1]


def encode_loss(topic: str, begin: int, end: int | None, reason: str) -> bytes:
    """A loss notice: seqs in the half-open range [begin, end) will never be delivered."""
    return _dumps({"type": "loss", "topic": topic, "from": begin, "to": end, "reason": reason})


def encode_subscribed(topic: str, kind: str, epoch: str, seq: int, request_id: Any = None, delta: bool | None = None) -> bytes:
    """`delta`: whether deltas were granted, given only when the subscribe asked for them."""
    entry = {"type": "subscribed", "topic": topic, "kind": kind, "epoch": epoch, "seq": seq, "id": request_id}
    if delta is not None:
        entry["delta"] = delta
    return _dumps(entry)


def encode_unsubscribed(topic: str, request_id: Any = None) -> bytes:
    return _dumps({"type": "unsubscribed", "topic": topic, "id": request_id})


def encode_reply(request_id: Any, result: Any) -> bytes:
    return _dumps({"type": "reply", "id": request_id, "result": result})


def encode_error(code: str, message: str, request_id: Any = None) -> bytes:
    return _dumps({"type": "error", "code": code, "message": message, "id": request_id})


def encode_closed(topic: str, reason: str) -> bytes:
    return _dumps({"type": "closed", "topic": topic, "reason": reason})


def encode_join(topic: str, user: str | None, client: str) -> bytes:
    """Another client subscribed to a topic with `join_leave` (a direct entry: no seq, never replayed)."""
    return _dumps({"type": "join", "topic": topic, "user": user, "client": client})


def encode_leave(topic: str, user: str | None, client: str) -> bytes:
    """A subscriber of a topic with `join_leave` unsubscribed, disconnected or was kicked."""
    return _dumps({"type": "leave", "topic": topic, "user": user, "client": client})


#: what `frame_batch` adds to the entries of a batch of one
FRAME_OVERHEAD = 2


def frame_batch(entries: Iterable[bytes]) -> bytes:
    """One JSON array spliced from pre-encoded entries: no per-client serialisation."""
    return b"[" + b",".join(entries) + b"]"

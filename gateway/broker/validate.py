"""The checks a publish through the Redis broker passes before it is queued (shared topics in
publishing.py, private queues in private_queues.py): raised at once, the future never made."""

from __future__ import annotations

from typing import Any

import orjson

from core.config import MAX_SEQ
from core.errors import BadData, BadSeq, MessageTooLarge

from ..errors import BrokerUnavailable

#: Bytes of a `msg` entry besides its topic and data (`{"type":"msg","topic":,"seq":,"data":}` and a seq).
ENTRY_OVERHEAD = 64
#: What a publish waiting for Redis holds besides its data (its record, future, callbacks: about 0.5 KiB in
#: CPython 3.11), counted against broker.max_pending_bytes with the data (Publisher.reserve, publishing.py).
PENDING_OVERHEAD = 512


def check_ready(available: bool, last_error: str, seq: int | None) -> None:
    """`BrokerUnavailable` while Redis does not answer; `BadSeq` for a seq outside [0, 2**53)."""
    if not available:
        raise BrokerUnavailable(f"broker unreachable: {last_error}; retry later")
    if seq is not None and not 0 <= seq < MAX_SEQ:
        raise BadSeq(f"seq must be in [0, 2**53), not {seq}")


def encode_message(topic: str, data: Any, limit: int) -> bytes:
    """`data` as JSON; `BadData` when it cannot be encoded, `MessageTooLarge` when its entry would pass
    `limit` (max_message_bytes)."""
    try:
        raw = orjson.dumps(data)
    except TypeError as exc:
        raise BadData(f"data cannot be encoded: {exc}") from None
    if len(raw) + len(topic.encode()) + ENTRY_OVERHEAD > limit:
        raise MessageTooLarge(f"message of about {len(raw) + ENTRY_OVERHEAD} bytes exceeds {limit}")
    return raw

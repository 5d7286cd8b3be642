"""The hostile gateway both client libraries' delta tests script (tests/client/test_*_delta_hostile.py): its
entries, and the script of the backoff-reset test."""

from __future__ import annotations

from typing import Any

import orjson

from core.fossil import delta

TOPIC = "book.x"
#: a delta with no base to apply it to: it never applies
BAD_DELTA = {"type": "msg", "topic": TOPIC, "seq": 0, "delta": True, "data": "5\n5:hello3NPMmi;"}
SUBSCRIBED = {"type": "subscribed", "topic": TOPIC, "kind": "ring", "epoch": "e1", "seq": 0, "delta": True, "id": None}
#: the reset test's messages: a whole one, a delta that applies to it, then one that fails
WHOLE = b'{"bid":1}'
APPLIES = {"type": "msg", "topic": TOPIC, "seq": 1, "delta": True, "data": delta(WHOLE, b'{"bid":2}').decode()}
FAILS = {**BAD_DELTA, "seq": 2}


def commands(frame: str | bytes) -> list[dict[str, Any]]:
    decoded = orjson.loads(frame)
    return decoded if isinstance(decoded, list) else [decoded]


def reset_answer(asked: int, command: dict[str, Any]) -> list[dict[str, Any]]:
    """The reset test's answer to its `asked`-th subscribe: three failures in a row (the backoff grows), then a
    whole message, a delta that applies and one that fails, then a subscribe from seq 2 (where it resumes)."""
    subscribed = {**SUBSCRIBED, "id": command["id"]}
    if asked <= 3:
        return [subscribed, BAD_DELTA]
    if asked == 4:
        return [subscribed, {"type": "msg", "topic": TOPIC, "seq": 0, "delta": False, "data": WHOLE.decode()}, APPLIES, FAILS]
    return [{**subscribed, "seq": 2}]

"""What every topic kind offers the engine. Kinds: ring.py, snapshot.py, private.py."""

from __future__ import annotations

from typing import Any

from .client import Subscription
from .config import TopicConfig
from .counters import Counters
from .entries import encode_message
from .errors import BadData, MessageTooLarge


class Topic:
    """Base of the topic kinds.

    The engine calls `subscribe`, `unsubscribe`, `publish`, and, from `run_cycle`, `read_into`. A shared topic
    keeps the subscribers that are caught up in `idle`: a publish wakes exactly those (O(1) each) and never
    walks subscribers that are already active.
    """

    kind = ""

    def __init__(self, name: str, epoch: str, config: TopicConfig, counters: Counters) -> None:
        self.name = name
        self.epoch = epoch
        self.config = config
        self.counters = counters
        #: every handle on this topic, for lifecycle only (never walked on a hot path)
        self.subs: dict[Subscription, None] = {}
        #: caught-up subscribers of a shared topic, woken by the next publish (ordered: deterministic)
        self.idle: dict[Subscription, None] = {}
        self.max_message_bytes = 1 << 20
        #: created on first use by a rule (not by an operator): removed when unused (`Engine.reclaim`)
        self.auto = False

    def encode(self, seq: int, data: Any) -> bytes:
        try:
            entry = encode_message(self.name, seq, data)
        except TypeError as exc:  # orjson.JSONEncodeError: e.g. nested deeper than orjson writes (254)
            raise BadData(f"data cannot be encoded: {exc}") from None
        if len(entry) > self.max_message_bytes:
            raise MessageTooLarge(f"message of {len(entry)} bytes exceeds {self.max_message_bytes}")
        return entry

    def attach(self, sub: Subscription, since: tuple[str, int] | None) -> tuple[int, bytes | None]:
        """Set the new handle's cursor. Returns (start seq, entry to put in the direct queue or None)."""
        raise NotImplementedError

    def detach(self, sub: Subscription) -> None:
        self.idle.pop(sub, None)

    def has_data(self, sub: Subscription) -> bool:
        raise NotImplementedError

    def retains_data(self) -> bool:
        """Whether removing the topic would lose something (messages, a last value, queued entries)."""
        raise NotImplementedError

    def read_into(self, sub: Subscription, out: list[bytes], room: int) -> int:
        """Append up to batch-depth entries for `sub` to `out` while fewer than `room` bytes were added.

        Returns the bytes added. The engine asks `has_data` afterwards to keep or park the handle.
        """
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "epoch": self.epoch, "subscribers": len(self.subs), **self.config.as_dict()}

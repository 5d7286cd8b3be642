"""Limits and per-topic settings. Every limit is here, with the reason for its default."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

#: Seqs are below 2**53 so that every client can hold them exactly (JavaScript numbers are doubles).
MAX_SEQ = 1 << 53

#: Upper bounds of the integer topic settings: each sizes memory or work per topic or per publish.
TOPIC_INT_BOUNDS = {
    "capacity": 1 << 20,  # ring slots: 8 MiB of references per topic at the bound
    "batch_depth": 1 << 10,
    "reorder_window": 1 << 20,
    "max_count": 1 << 20,
    "max_bytes": 1 << 30,
}
#: A hole waits at most an hour: a longer wait holds every later message back from all subscribers.
MAX_HOLE_TIMEOUT = 3600.0


class TopicKind(str, Enum):
    #: shared, queued, lossy: a ring of `capacity` messages, each subscriber keeps a cursor (docs/design/shared-rings.md)
    RING = "ring"
    #: shared, last value only: a new subscriber gets the latest at once (docs/design/batching.md §7)
    SNAPSHOT = "snapshot"
    #: one client's queue, not lossy, back-pressure when full, peek/commit (docs/design/private-queues.md)
    PRIVATE = "private"


@dataclass(frozen=True, slots=True)
class TopicConfig:
    kind: TopicKind = TopicKind.RING
    #: ring size in messages. 64 is the batching design's default ring (docs/design/shared-rings.md §8): a
    #: lagging client loses the oldest.
    capacity: int = 64
    #: messages one handle may give per cycle (docs/design/batching.md §8, opt-in); 1 keeps clients in step.
    batch_depth: int = 1
    #: out-of-order publishing window in seqs (docs/design/reorder-window.md §2; 64 covers interleaved producers).
    reorder_window: int = 64
    #: a hole older than this (seconds) is given up and announced as a loss notice.
    hole_timeout: float = 1.0
    #: private queue bounds: count and bytes (docs/design/private-queues.md §3: the writer waits while full).
    max_count: int = 256
    max_bytes: int = 1 << 20
    #: whether connected clients may publish to it (admin and ingest always may).
    client_publish: bool = False
    #: whether clients without a token may subscribe (and publish, with client_publish): the gateway
    #: decides who may do what; the core only carries the setting. Secure default: no.
    anonymous: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", TopicKind(self.kind))
        for name, bound in TOPIC_INT_BOUNDS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= bound:
                raise ValueError(f"{name} must be an integer in [1, {bound}], not {value!r}")
        timeout = self.hole_timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= MAX_HOLE_TIMEOUT:
            raise ValueError(f"hole_timeout must be a number of seconds in (0, {MAX_HOLE_TIMEOUT:g}], not {timeout!r}")
        for name in ("client_publish", "anonymous"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, not {getattr(self, name)!r}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "capacity": self.capacity,
            "batch_depth": self.batch_depth,
            "reorder_window": self.reorder_window,
            "hole_timeout": self.hole_timeout,
            "max_count": self.max_count,
            "max_bytes": self.max_bytes,
            "client_publish": self.client_publish,
            "anonymous": self.anonymous,
        }


@dataclass(frozen=True, slots=True)
class TopicRule:
    """Topics whose name matches `pattern` (fnmatch) are created on first use with `config`."""

    pattern: str
    config: TopicConfig

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    #: bytes one client may be given per cycle; at least one entry always goes (docs/design/batching.md §9).
    cycle_budget_bytes: int = 64 * 1024
    #: direct queue bound per client: replies pile up only when a client does not read; it is then cut.
    direct_queue_max: int = 1024
    #: largest encoded message; bigger payloads are refused with `too_large`.
    max_message_bytes: int = 1 << 20
    #: topic count bound: auto-created topics cannot grow without limit.
    max_topics: int = 100_000
    #: subscriptions per client.
    max_subscriptions: int = 1_000
    #: longest topic name.
    max_topic_name: int = 256
    rules: tuple[TopicRule, ...] = field(default_factory=tuple)

    def rule_for(self, name: str) -> TopicConfig | None:
        for rule in self.rules:
            if rule.matches(name):
                return rule.config
        return None

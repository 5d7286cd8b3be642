"""Limits and per-topic settings. Every limit is here, with the reason for its default."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final, Literal

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
#: A linger holds caught-up subscribers back at most this long (seconds): past it, clients would see a live
#: feed as stalled, and the skew between a topic's subscribers and its other topics grows with it.
MAX_LINGER = 10.0

#: `batch_depth = "auto"` (ring topics, docs/design/batching.md §8): a handle's slice per cycle is sized by
#: its backlog. `TopicConfig` stores this very object, so the read path tests it with `is`.
AUTO_DEPTH: Final = "auto"
#: The most entries an auto slice gives per cycle. 64 is the default ring: a subscriber a whole default ring
#: behind catches up in one cycle. 64 entries of a ~150-byte message are ~10 KB, a sixth of the default
#: 64 KiB cycle budget, so one auto topic leaves room for the client's others; and at that depth the cost
#: of a frame (one `send()`, ~10 us) is already spread over enough messages that a deeper slice would save
#: little CPU per delivery while making the client's cycle turn, and the skew between clients, longer.
AUTO_MAX_SLICE = 64
#: The backlog at which an auto slice reaches `AUTO_MAX_SLICE`: the ring's capacity, counted as at most
#: this many messages. Below it a slice is proportional (backlog x AUTO_MAX_SLICE / span, rounded up), so a
#: subscriber reaches the bound before the ring wraps under it; the cap keeps a large ring from tolerating
#: a long backlog: a subscriber takes at least a quarter of it per cycle, so a steady rate settles at
#: about four cycles' worth of messages behind.
AUTO_MAX_SPAN = 4 * AUTO_MAX_SLICE


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
    #: "auto" (ring topics): one while caught up, a slice sized by the backlog while behind.
    batch_depth: int | Literal["auto"] = 1
    #: out-of-order publishing window in seqs (docs/design/reorder-window.md §2; 64 covers interleaved producers).
    reorder_window: int = 64
    #: a hole older than this (seconds) is given up and announced as a loss notice.
    hole_timeout: float = 1.0
    #: seconds a shared topic holds its caught-up subscribers back after a publish, so that what else is
    #: published meanwhile goes out with it, in one frame (with batch_depth "auto" or > 1) and one write:
    #: less CPU per delivery for added latency, like Kafka's linger.ms. 0: wake them at once.
    linger: float = 0.0
    #: private queue bounds: count and bytes (docs/design/private-queues.md §3: the writer waits while full).
    max_count: int = 256
    max_bytes: int = 1 << 20
    #: whether connected clients may publish to it (admin and ingest always may).
    client_publish: bool = False
    #: whether clients without a token may subscribe (and publish, with client_publish): the gateway
    #: decides who may do what; the core only carries the setting. Secure default: no.
    anonymous: bool = False
    #: whether clients may ask who is subscribed (`presence`, `presence_stats`, docs/integration.md, "Presence"):
    #: the gateway tracks the topic's subscribers as members; the core only carries the setting.
    presence: bool = False
    #: whether subscribers get `join` / `leave` entries as others subscribe and leave (needs `presence`).
    join_leave: bool = False
    #: whether a client's subscribe / publish is also asked of the backend ([proxy] subscribe_url /
    #: publish_url, docs/integration.md), after the gateway's own checks.
    proxy_subscribe: bool = False
    proxy_publish: bool = False
    #: "fossil": subscribers that ask for it get each message as a fossil delta of the one before
    #: (core/delta.py, docs/protocol.md "Deltas"); None: never
    delta: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", TopicKind(self.kind))
        if self.batch_depth == AUTO_DEPTH:
            if self.kind is not TopicKind.RING:
                raise ValueError(f'batch_depth "auto" is for ring topics, not {self.kind.value}: give a number')
            object.__setattr__(self, "batch_depth", AUTO_DEPTH)  # the constant itself: tested with `is`
        for name, bound in TOPIC_INT_BOUNDS.items():
            value = getattr(self, name)
            if name == "batch_depth" and value is AUTO_DEPTH:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= bound:
                also = ' or "auto"' if name == "batch_depth" else ""
                raise ValueError(f"{name} must be an integer in [1, {bound}]{also}, not {value!r}")
        timeout = self.hole_timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= MAX_HOLE_TIMEOUT:
            raise ValueError(f"hole_timeout must be a number of seconds in (0, {MAX_HOLE_TIMEOUT:g}], not {timeout!r}")
        linger = self.linger
        if not isinstance(linger, (int, float)) or isinstance(linger, bool) or not 0 <= linger <= MAX_LINGER:
            raise ValueError(f"linger must be a number of seconds in [0, {MAX_LINGER:g}], not {linger!r}")
        if linger and self.kind is TopicKind.PRIVATE:
            raise ValueError("linger is for shared topics (ring, snapshot), not private")
        for name in ("client_publish", "anonymous", "presence", "join_leave", "proxy_subscribe", "proxy_publish"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, not {getattr(self, name)!r}")
        if self.presence and self.kind is TopicKind.PRIVATE:
            raise ValueError("presence is for shared topics (ring, snapshot), not private: each user reads its own queue")
        if self.join_leave and not self.presence:
            raise ValueError("join_leave needs presence = true")
        if self.delta is not None:
            if self.delta != "fossil":
                raise ValueError(f'delta must be "fossil" (or unset), not {self.delta!r}')
            if self.kind is TopicKind.PRIVATE:
                raise ValueError("delta is for shared topics (ring, snapshot), not private")

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "capacity": self.capacity,
            "batch_depth": self.batch_depth,
            "reorder_window": self.reorder_window,
            "hole_timeout": self.hole_timeout,
            "linger": self.linger,
            "max_count": self.max_count,
            "max_bytes": self.max_bytes,
            "client_publish": self.client_publish,
            "anonymous": self.anonymous,
            "presence": self.presence,
            "join_leave": self.join_leave,
            "proxy_subscribe": self.proxy_subscribe,
            "proxy_publish": self.proxy_publish,
            "delta": self.delta,
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
    #: the same bound in bytes (a reply can be as large as the command it echoes) ...
    direct_queue_max_bytes: int = 1 << 20
    #: ... and over all clients' direct queues; past it, a client holding more than its cycle budget is cut
    #: (a small queue goes on: the clients that do not read pay, not the others).
    direct_total_max_bytes: int = 64 << 20
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

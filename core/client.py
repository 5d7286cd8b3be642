"""Per-client state: the direct queue, the ordered coalesced active-handle set, readiness."""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import TYPE_CHECKING, Any, Hashable

if TYPE_CHECKING:
    from .fairness import Tenant, User
    from .topics import Topic


class ClientState(Enum):
    #: may be handed a batch (WebSocket: not write-blocked; long-poll: a poll waits; TCP: writable)
    READY = "ready"
    #: a batch was handed out and its write has not been reported done
    WRITING = "writing"
    #: connected but not able to take data (long-poll with no poll waiting)
    IDLE = "idle"


class Subscription:
    """One client's handle on one topic. Ring and snapshot handles hold a cursor only (docs/design/shared-rings.md §2)."""

    __slots__ = ("client", "topic", "cursor", "active", "queue", "queued_bytes", "peeked", "waiting", "ack", "delta", "base")

    def __init__(self, client: "Client", topic: "Topic") -> None:
        self.client = client
        self.topic = topic
        #: next seq to deliver (ring, snapshot); for private queues the seq of the next message queued
        self.cursor = 0
        #: in the client's active-handle set; otherwise, for shared topics (`Topic.shared`), in the topic's idle set
        self.active = False
        # private queues only (docs/design/private-queues.md §2): entries, their size
        self.queue: deque[bytes] | None = None
        self.queued_bytes = 0
        #: entries handed out by `read_into` and kept until `commit` (private: docs/design/private-queues.md §4);
        #: 0 on other kinds
        self.peeked = 0
        #: a publisher was refused for lack of space and wants to hear when space frees
        self.waiting = False
        #: private queues: entries leave only when the client acknowledges them (`Engine.ack`), not when the
        #: batch is written; un-acknowledged ones stay peeked (docs/design/private-queues.md §9)
        self.ack = False
        #: shared topics with `delta = "fossil"`: messages go in their delta forms (core/delta.py) ...
        self.delta = False
        #: ... and this is the seq of the last message this handle delivered (-1: none since it attached)
        self.base = -1


class Sink:
    """Where a client's caught-up batches of one entry may go without being handed out one by one: its
    socket as the gateway names it (`token`, and `handle`: both opaque here). The engine gathers such clients
    into crowds (`Engine.crowds`); the gateway keeps `open` false while the client's bytes may not go straight
    out (frames staged before them, its close begun). It also counts what reached the client either way."""

    __slots__ = ("token", "variant", "handle", "owner", "open", "frames", "entries", "bytes")

    def __init__(self, token: int, variant: int, handle: Any, owner: Any) -> None:
        self.token = token
        #: what the bytes for an entry depend on besides it (the gateway's wire variant): crowds never mix them
        self.variant = variant
        self.handle = handle
        #: the gateway's object for the client (its connection)
        self.owner = owner
        self.open = True
        #: frames, entries and frame bytes delivered to the client, through a crowd or not
        self.frames = 0
        self.entries = 0
        self.bytes = 0


class Crowd:
    """The clients whose batch in a cycle is the one entry `entry`, caught up, with sinks of one variant:
    the same bytes go to all of them (`Engine.crowds`). `tokens` and `handles` follow `sinks`."""

    __slots__ = ("entry", "variant", "sinks", "tokens", "handles")

    def __init__(self, entry: bytes, variant: int) -> None:
        self.entry = entry
        self.variant = variant
        self.sinks: list[Sink] = []
        self.tokens: list[int] = []
        self.handles: list[Any] = []


class Client:
    __slots__ = (
        "id",
        "owner",
        "state",
        "direct",
        "direct_bytes",
        "active",
        "subs",
        "budget",
        "peeked_subs",
        "info",
        "sink",
        "tenant",
        "user",
        "in_line",
    )

    def __init__(self, client_id: Hashable, budget: int, ready: bool, info: Any = None, owner: Hashable = None) -> None:
        self.id = client_id
        #: whose private queues this client reads (the authenticated user); by default the client itself
        self.owner = client_id if owner is None else owner
        self.state = ClientState.READY if ready else ClientState.IDLE
        #: made by the first entry queued, dropped once drained (an empty deque holds ~0.6 KiB: an idle
        #: subscriber would hold it for nothing, docs/benchmarks.md)
        self.direct: deque[bytes] | None = None
        #: bytes of the entries in `direct` (bounded by `EngineConfig.direct_queue_max_bytes`)
        self.direct_bytes = 0
        #: ordered, coalesced active-handle set (a dict keeps insertion order, a key appears once)
        self.active: dict[Subscription, None] = {}
        self.subs: dict[str, Subscription] = {}
        self.budget = budget
        #: handles with peeked entries in the batch being written (private): commit or roll them back
        self.peeked_subs: list[Subscription] = []
        #: opaque to the core: identity, transport, permissions live with the gateway
        self.info = info
        #: where its caught-up one-entry batches may go in a crowd (`Engine.attach_sink`), None: as batches
        self.sink: Sink | None = None
        #: with fairness on (core/fairness.py): its tenant and user, and whether it is in its tenant's deque
        self.tenant: Tenant | None = None
        self.user: User | None = None
        self.in_line = False

    def queued(self) -> int:
        """Entries in the direct queue."""
        direct = self.direct
        return 0 if direct is None else len(direct)

    def has_work(self) -> bool:
        return bool(self.direct) or bool(self.active)

"""What every topic kind offers the engine. Kinds: ring.py, snapshot.py, private.py.

The engine never asks which kind a topic is (as h11's events share one protocol): each kind answers the
same calls, all declared on `Topic`. Where a call has nothing to do for some kinds (`claim`, `commit`,
`rollback`, `expire_hole`, `reserve`), `Topic` holds that answer and only the kinds that need more override
it. What the engine reads on its hot paths is an attribute, not a call: `shared`, `pending`.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import Any, ClassVar

from .client import Subscription
from .config import AUTO_DEPTH, TopicConfig
from .counters import Counters
from .delta import DeltaForms
from .entries import encode_message
from .errors import BadData, BadTopic, CoreUsageError, MessageTooLarge


def check_topic_name(name: str, max_chars: int) -> None:
    """The one grammar of topic names (docs/protocol.md, "Topic names"), for every transport and the broker's
    key space: 1..`max_chars` characters, each printable and not whitespace, none of `{` `}`. `{` and `}`
    delimit the topic in a Redis key (`P:{T}:m`, the hash tag, docs/cluster.md §2): a name holding them
    could name another topic's key or a private queue's. Raises `BadTopic`. Cost: O(len(name)), in C;
    called for names not in the topic table only."""
    if not 0 < len(name) <= max_chars:
        raise BadTopic(f"topic name must be 1..{max_chars} characters")
    if not name.isprintable() or " " in name or "{" in name or "}" in name:
        raise BadTopic("topic name may hold printable characters only, no whitespace and no `{` or `}`")


class Topic:
    """Base of the topic kinds.

    Calling contract (the engine is the only caller, but for `info`):

    * `claim(sub)` before `attach(sub, since)` when a client subscribes: a handle it returns loses what the
      new one takes over, and the engine detaches it from its client first; `detach(sub)` when a handle goes
      (unsubscribe, disconnect, topic deleted).
    * `publish(data, seq, owner, now)` -> (seq, woken): the engine activates the handles woken. Then, while
      `pending` is not empty, the engine's `tick` calls `expire_hole(now)`, and `take_idle()` when it
      returns true. `reserve(count)` from `Engine.reserve`.
    * From `run_cycle`: `read_into` per active handle, then `has_data`; a handle with nothing left is parked
      (`active` false), and put in `idle` when the topic is `shared`.
    * A kind whose `read_into` hands entries out without removing them counts them in `sub.peeked`: the
      engine lists such a handle in the client's `peeked_subs` and, once the batch is written or not, calls
      `commit(sub)` or `rollback(sub)`. Other kinds never set `peeked`, so they are never asked.
    * `retains_data()` from `Engine.reclaim`; `info()` from the gateway's admin API.

    A shared topic keeps the subscribers that are caught up in `idle`: a publish wakes exactly those (O(1)
    each) and never walks subscribers that are already active.
    """

    kind: ClassVar[str] = ""
    #: handles hold state keyed by their client's owner (private queues): that owner cannot change
    keyed_by_owner: ClassVar[bool] = False

    def __init__(self, name: str, epoch: str, config: TopicConfig, counters: Counters) -> None:
        self.name = name
        self.epoch = epoch
        self.config = config
        self.counters = counters
        #: one stream read by every subscriber (ring, snapshot): a parked handle waits in `idle` and the next
        #: publish that moves the stream wakes them all. False (private, set by the kind): a parked handle
        #: waits nowhere, the publish that fills its queue wakes it alone. An instance attribute, not a class
        #: one: the engine reads it for every handle that runs dry, and that lookup is the fastest.
        self.shared = True
        #: out-of-order arrivals waiting on a hole, by seq (ring.py): while it is not empty the engine's `tick`
        #: calls `expire_hole`. Kinds that do not reorder leave it empty.
        self.pending: dict[int, bytes] = {}
        #: every handle on this topic, for lifecycle only (never walked on a hot path)
        self.subs: dict[Subscription, None] = {}
        #: caught-up subscribers of a shared topic, woken by the next publish (ordered: deterministic)
        self.idle: dict[Subscription, None] = {}
        #: `config.linger`, read by every publish that wakes subscribers (the engine then holds them instead)
        self.linger = config.linger
        #: `batch_depth = "auto"`, read for every handle a cycle visits
        self.auto_depth = config.batch_depth is AUTO_DEPTH
        self.max_message_bytes = 1 << 20
        #: created on first use by a rule (not by an operator): removed when unused (`Engine.reclaim`)
        self.auto = False
        #: the messages' delta forms, with `delta = "fossil"` (core/delta.py): as many as a ring retains
        self.delta_forms = DeltaForms(config.capacity + 2) if config.delta is not None else None

    def encode(self, seq: int, data: Any) -> bytes:
        try:
            entry = encode_message(self.name, seq, data)
        except TypeError as exc:  # orjson.JSONEncodeError: e.g. nested deeper than orjson writes (254)
            raise BadData(f"data cannot be encoded: {exc}") from None
        if len(entry) > self.max_message_bytes:
            raise MessageTooLarge(f"message of {len(entry)} bytes exceeds {self.max_message_bytes}")
        return entry

    # -- subscribers -------------------------------------------------------------------------------------

    def claim(self, sub: Subscription) -> Subscription | None:
        """The handle holding what the new handle `sub` is about to take over, or None (shared kinds).

        The engine detaches the returned handle from its client (which gets `closed` / `taken_over`) but
        not from the topic, then calls `attach(sub, ...)`, which adopts its state. Called before `attach`.
        """
        return None

    def holder(self, owner: Hashable) -> Subscription | None:
        """The handle holding `owner`'s queue (private), or None (shared kinds)."""
        return None

    def head(self, sub: Subscription) -> int | None:
        """The seq of the first entry `sub` still holds (private: what a commit has not removed), or None."""
        return None

    def attach(self, sub: Subscription, since: tuple[str, int] | None) -> tuple[int, bytes | None]:
        """Set the new handle's cursor. Returns (start seq, entry to put in the direct queue or None)."""
        raise NotImplementedError

    def epoch_of(self, sub: Subscription) -> str:
        """The epoch `sub`'s seqs count in: the topic's, or (private) its queue's own."""
        return self.epoch

    def detach(self, sub: Subscription) -> bool:
        """Forget the handle (unsubscribe, disconnect, topic deleted). Returns whether a publisher refused for
        lack of space waits on it: the engine then reports it in `take_space_freed` (it gets an error)."""
        self.idle.pop(sub, None)
        return False

    # -- producers ---------------------------------------------------------------------------------------

    def publish(self, data: Any, seq: int | None, owner: Hashable, now: float) -> tuple[int, Collection[Subscription]]:
        """Store one message (`seq` None: the next one). Returns (its seq, the handles it woke): parked handles
        that now have something to read, none of them active; the engine moves them into their clients'
        active sets. A shared kind hands over its whole `idle` set (as `take_idle`) when the message is
        readable; a private topic at most the one handle whose queue it filled.

        `owner` names the user whose queue gets the message on a private topic; shared kinds ignore it
        (a message on a shared topic goes to every subscriber, whoever the publisher names).
        Raises `RequestError` subclasses (bad or stale seq, too large, queue full, ...).
        """
        raise NotImplementedError

    def take_idle(self) -> Collection[Subscription]:
        """Empty `idle` and return what it held (the engine wakes them), or () when it is empty."""
        idle = self.idle
        if not idle:
            return ()
        self.idle = {}
        return idle

    def hold(self, woken: Collection[Subscription]) -> bool:
        """A linger: put the handles a publish handed over back in `idle`, in their order (the engine wakes
        them when the linger ends). Returns whether it must end now rather than at its deadline."""
        self.idle = woken if isinstance(woken, dict) else dict.fromkeys(woken)  # the publish left it empty
        return False

    def reserve(self, count: int) -> tuple[int, int]:
        """Hand out `count` seqs as [begin, end) for producers that publish them later (ring topics)."""
        raise CoreUsageError(f"reserve needs a ring topic, {self.name!r} is {self.kind}")

    def restart(self, epoch: str, start: int) -> None:
        """Empty the topic and begin a new epoch whose first seq is `start` (a broker's stream: the seqs are
        Redis's, docs/cluster.md §3). The engine moves the subscribers (`Engine.restart_topic`). Kinds that
        key state by owner cannot restart."""
        raise CoreUsageError(f"a {self.kind} topic cannot restart at a given seq")

    def skip_to(self, upto: int, now: float) -> bool:
        """Announce every seq below `upto` not yet available as lost (a broker's stream dropped them before
        this node read them). Returns whether data became readable (the engine wakes `take_idle`)."""
        raise CoreUsageError(f"a {self.kind} topic has no seqs to skip")

    def expire_hole(self, now: float) -> bool:
        """Give up a hole that waited too long. Returns whether data became readable (the engine then wakes
        the handles of `take_idle`)."""
        return False

    # -- readers -----------------------------------------------------------------------------------------

    def has_data(self, sub: Subscription) -> bool:
        raise NotImplementedError

    def read_into(self, sub: Subscription, out: list[bytes], room: int) -> int:
        """Append up to batch-depth entries for `sub` to `out` while fewer than `room` bytes were added.

        Returns the bytes added. The engine asks `has_data` afterwards to keep or park the handle. Entries
        handed out that stay until a commit are counted in `sub.peeked` (private); other kinds leave it 0.
        """
        raise NotImplementedError

    def commit(self, sub: Subscription) -> bool:
        """The batch holding `sub`'s peeked entries was written: drop them. Returns whether a publisher refused
        for lack of space should hear that there is space now. Shared kinds: nothing to do."""
        return False

    def ack(self, sub: Subscription, seq: int) -> bool:
        """The client acknowledged every entry of `sub` up to `seq` (a handle with `sub.ack`: private queues
        only). Returns whether a publisher refused for lack of space should hear that there is space now."""
        raise CoreUsageError(f"topic {self.name!r} ({self.kind}) has no acknowledged handles")

    def rollback(self, sub: Subscription) -> bool:
        """The batch holding `sub`'s peeked entries was not written: hand them out again. Returns whether the
        handle has entries to read again (the engine activates it). Shared kinds: nothing to do."""
        return False

    def retains_data(self) -> bool:
        """Whether removing the topic would lose something (messages, a last value, queued entries)."""
        raise NotImplementedError

    def activity(self) -> int:
        """A number that changes whenever the topic is published to (`Engine.reclaim` compares two readings
        to tell a retained topic nobody publishes to any more)."""
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "epoch": self.epoch, "subscribers": len(self.subs), **self.config.as_dict()}

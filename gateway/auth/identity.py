"""Who a connection is and what it may do: identity, topic permissions and per-client limits, in one place.

Every transport gets its client's `ClientIdentity` from the one handshake (`open_client`,
gateway/admission.py) and asks it before acting on a client's command, so the same request gets
the same answer on WebSocket, long-poll and SSE.

Permissions (docs/security.md):

* a topic whose config says `anonymous = true` is open to every client: subscribe, and publish when the
  topic also has `client_publish`;
* any other topic needs a token: its `subscribe` / `publish` patterns must match the topic name;
* a private topic is open to every authenticated client, because the queue it reads is its own user's.

A refusal says why (`subscribe_refusal`, `publish_refusal`): the error entry names the rule and the
patterns that refused (docs/security.md, "A worked example: a token-only topic").
"""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field
from typing import Any

from core import TopicConfig, TopicKind

from .tokens import Principal

#: patterns a refusal's message lists at most (a token may hold 256)
SHOWN_PATTERNS = 8


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _shown(patterns: tuple[str, ...]) -> str:
    """A refusal's view of a pattern list: the first few, each cut short, and how many more."""
    shown = repr([pattern[:40] for pattern in patterns[:SHOWN_PATTERNS]])
    more = len(patterns) - SHOWN_PATTERNS
    return f"{shown} (and {more} more)" if more > 0 else shown


class TopicCreations:
    """A connection's topic creations, kept by the topic budget (gateway/topic_budget.py)."""

    __slots__ = ("created", "creating")

    def __init__(self) -> None:
        #: topics this connection caused to be created (bounded by limits.max_created_topics)
        self.created = 0
        #: its publishes and subscribes in flight to a broker that may create a topic
        self.creating = 0


@dataclass(slots=True)
class ClientIdentity:
    """Who a connection is (the core sees it as opaque `info`): set by its handshake and the connect hook,
    changed once it is registered only by its session's `authenticate` (gateway/session.py). What it spends
    (rate buckets, hook calls, the idle clock) is its session's `SessionState`; the creation counts are the
    topic budget's (gateway/topic_budget.py)."""

    client_id: str
    transport: str
    peer: str = ""
    #: the peer's IP address, for per-address limits
    ip: str = ""
    #: the verified token, None while anonymous
    principal: Principal | None = None
    #: whose share its service counts to (gateway/tenancy.py): decided with its first token
    tenant: str = ""
    connected_at: float = field(default_factory=time.time)
    #: the topic budget's count of this connection's creations (gateway/topic_budget.py): the object stays, the
    #: budget changes its counts
    creations: TopicCreations = field(default_factory=TopicCreations)
    #: what the application says about the client (presence members' `info`): a token's `info` claim, or the
    #: connect hook's `info` (gateway/hooks/backend.py); None when neither gave one
    info: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.info is None and self.principal is not None:
            self.info = self.principal.info

    @property
    def user(self) -> str | None:
        return self.principal.user if self.principal is not None else None

    @property
    def owner(self) -> str:
        """Whose private queues this connection reads: its user, or itself when anonymous."""
        return self.principal.user if self.principal is not None else self.client_id

    def may_subscribe(self, name: str, config: TopicConfig) -> bool:
        if config.anonymous:
            return True
        principal = self.principal
        if principal is None:
            return False
        return config.kind is TopicKind.PRIVATE or _matches(name, principal.subscribe)

    def may_publish(self, name: str, config: TopicConfig) -> bool:
        if not config.client_publish or config.kind is TopicKind.PRIVATE:
            return False
        if config.anonymous:
            return True
        return self.principal is not None and _matches(name, self.principal.publish)

    def subscribe_refusal(self, name: str, config: TopicConfig) -> str | None:
        """None when this client may subscribe to `name`, else why not, said of the topic ("is not
        anonymous and ..."): the caller puts the topic's rule in front."""
        if self.may_subscribe(name, config):
            return None
        return self._not_granted("subscribe")

    def publish_refusal(self, name: str, config: TopicConfig) -> str | None:
        """None when this client may publish to `name`, else why not (as `subscribe_refusal`)."""
        if self.may_publish(name, config):
            return None
        if config.kind is TopicKind.PRIVATE:
            return "is private: clients never publish to private topics (the ingest and the admin API do)"
        if not config.client_publish:
            return "does not take client publishes (client_publish = false)"
        return self._not_granted("publish")

    def _not_granted(self, verb: str) -> str:
        """Why a topic that is not anonymous refuses this client: no token, or no pattern of it matches."""
        principal = self.principal
        if principal is None:
            return "is not anonymous and the connection has no token"
        patterns = principal.subscribe if verb == "subscribe" else principal.publish
        if principal.proxied:  # a user and patterns granted by the connect hook (gateway/hooks/backend.py)
            if not patterns:
                return f"is not anonymous and the connect hook granted no {verb} patterns"
            return f"is not anonymous and the {verb} patterns the connect hook granted {_shown(patterns)} do not match"
        if not patterns:
            return f"is not anonymous and the token has no {verb} patterns"
        return f"is not anonymous and the token's {verb} patterns {_shown(patterns)} do not match"

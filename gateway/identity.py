"""Who a connection is and what it may do: identity, topic permissions and per-client limits, in one place.

Every transport gets its client's `ClientIdentity` from the one handshake (`open_client`,
gateway/transports/handshake.py) and asks it before acting on a client's command, so the same request gets
the same answer on WebSocket, long-poll and SSE.

Permissions (docs/security.md):

* a topic whose config says `anonymous = true` is open to every client: subscribe, and publish when the
  topic also has `client_publish`;
* any other topic needs a token: its `subscribe` / `publish` patterns must match the topic name;
* a private topic is open to every authenticated client, because the queue it reads is its own user's.
"""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field
from typing import Any

from core import TopicConfig, TopicKind

from .auth import Principal
from .ratelog import TokenBucket


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


@dataclass(slots=True)
class ClientIdentity:
    """A connection's identity and its per-client counters (the core sees it as opaque `info`)."""

    client_id: str
    transport: str
    peer: str = ""
    #: the peer's IP address, for per-address limits
    ip: str = ""
    #: the verified token, None while anonymous
    principal: Principal | None = None
    connected_at: float = field(default_factory=time.time)
    #: topics this connection caused to be created (bounded by limits.max_created_topics)
    created_topics: int = 0
    #: its publishes and subscribes in flight to a broker that may create a topic (gateway/topic_budget.py)
    creating: int = 0
    #: client publishes (limits.publish_rate / publish_burst); made on first publish
    publish_bucket: TokenBucket | None = None
    #: `auth` and `rpc topics` (auth.rate_per_connection / burst_per_connection); made on first use
    costly_bucket: TokenBucket | None = None
    #: monotonic time of the last command, for the idle timeout
    last_command: float = field(default_factory=time.monotonic)
    #: what the application says about the client (presence members' `info`): a token's `info` claim, or the
    #: connect hook's `info` (gateway/proxy.py); None when neither gave one
    info: dict[str, Any] | None = None
    #: server-side subscriptions granted by the connect hook, made when the connection registers
    proxy_topics: tuple[str, ...] = ()

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

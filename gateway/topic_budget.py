"""Topic creations by clients, bounded per connection, per address across reconnects, and in total.

A client's subscribe or publish to a name no topic has yet creates it by a rule. Each creation costs
memory until `Engine.reclaim` removes the topic (limits.topic_ttl_s unused, limits.topic_history_ttl_s
when it retains messages), so creations are bounded three ways (docs/security.md, "Limits"):

* per connection: `limits.max_created_topics`;
* per peer address, across reconnects: a token bucket of `limits.topic_create_rate` per second and
  `limits.topic_create_burst` at once, kept in a table of at most `ADDRESSES_MAX` addresses (the least
  recently used is forgotten: its next connection starts with a full bucket, which costs an attacker an
  address per burst); with `server.workers` > 1, in memory shared by the workers instead
  (gateway/edge/addrcount.py, `SharedRate`), so one address has one bucket whichever worker serves it;
* in total: no client creation while the gateway holds `limits.max_client_topics` topics (the admin API
  and the ingest create up to `scheduler.max_topics`); with a broker also `broker.max_topics` cluster-wide,
  checked by Redis (broker/topic_lines.py, broker/publishing.py).

Every refusal is `too_many_topics` for that request only, counted in `fanout_topic_creations_refused_total`.
A creation in this engine is asked and charged by the topic catalog (gateway/catalog.py, `check` then
`charge`); one in Redis, which alone knows whether the topic is new, by the Redis broker (`begin`, `end`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from .edge.ratelog import AddressRates
from .errors import TooManyCreatedTopics
from .ops.metrics import counter_family

if TYPE_CHECKING:
    from .auth.identity import ClientIdentity
    from .config import LimitsConfig
    from .edge.addrcount import SharedRate

#: Addresses whose buckets are remembered (about 100 bytes each).
ADDRESSES_MAX = 65_536


class CreationBudget:
    def __init__(
        self, limits: "LimitsConfig", topic_count: Callable[[], int], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.per_connection = limits.max_created_topics
        self.rate = limits.topic_create_rate
        self.burst = float(limits.topic_create_burst)
        self.total = limits.max_client_topics
        self.topic_count = topic_count
        #: a bucket per address; with server.workers > 1 the workers' shared ones (gateway/edge/addrcount.py)
        self.rates: AddressRates | SharedRate = AddressRates(self.rate, self.burst, ADDRESSES_MAX, clock=clock)
        #: refusals by reason ("connection", "address", "total", "cluster"): `/metrics`
        self.refused: dict[str, int] = {"connection": 0, "address": 0, "total": 0, "cluster": 0}

    def refusal(self, identity: "ClientIdentity") -> tuple[str, str] | None:
        """Why `identity` may not create a topic now, (reason, message), or None when it may (nothing is
        taken, nothing counted)."""
        # creations that may be under way through a broker count as made until Redis answered (`begin`)
        if identity.creations.created + identity.creations.creating >= self.per_connection:
            return "connection", f"this connection may create at most {self.per_connection} topics"
        if self.burst > 0 and self.rates.tokens(identity.ip) - identity.creations.creating < 1:
            return "address", (f"topics created from your address above {self.rate:g}/s (burst {self.burst:g}): retry later")
        if self.total > 0 and self.topic_count() >= self.total:
            return "total", f"the gateway holds {self.total} topics: clients may create no more"
        return None

    def refuse(self, reason: tuple[str, str]) -> TooManyCreatedTopics:
        """The error of a refusal, counted."""
        self.refused[reason[0]] += 1
        return TooManyCreatedTopics(reason[1])

    def check(self, identity: "ClientIdentity") -> None:
        """Raise `TooManyCreatedTopics` when `identity` may not create a topic now (nothing is taken)."""
        reason = self.refusal(identity)
        if reason is not None:
            raise self.refuse(reason)

    def begin(self, identity: "ClientIdentity") -> tuple[str, str] | None:
        """A publish or subscribe through a broker that may create a topic (only Redis knows): its refusal
        (Redis then refuses it only if the topic is new), or None, and then it counts as a creation until
        `end` says whether it was one."""
        reason = self.refusal(identity)
        if reason is None:
            identity.creations.creating += 1
        return reason

    def end(self, identity: "ClientIdentity", created: bool) -> None:
        identity.creations.creating -= 1
        if created:
            self.charge(identity)

    def collect(self) -> Iterator[Metric]:
        yield counter_family(
            "fanout_topic_creations_refused",
            "client topic creations refused (too_many_topics) by"
            " bound: connection (limits.max_created_topics), address (limits.topic_create_rate),"
            " total (limits.max_client_topics), cluster (broker.max_topics)",
            "bound",
            self.refused,
        )

    def charge(self, identity: "ClientIdentity") -> None:
        """`identity` created a topic."""
        identity.creations.created += 1
        if self.burst > 0:
            self.rates.charge(identity.ip)

"""What an operator does to a user's connections on this node besides closing them: subscribe them to a topic,
unsubscribe them, extend or end their connections' lifetime (the Centrifugo server API's `subscribe`,
`unsubscribe` and `refresh`, docs/centrifugo.md).

`ControlCommands.run` (gateway/control_commands.py) runs them as the control commands of the same names, so
with a broker they reach the user's connections on every node. Each returns how many connections it changed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable

from core import RequestError

from . import close_codes
from .catalog import TopicCatalog
from .clients import ClientRegistry
from .topic_view import TopicView


class UserCommands:
    def __init__(self, clients: ClientRegistry, topics: TopicView, catalog: TopicCatalog) -> None:
        self.clients = clients
        #: the engine, read-only: which topics a connection holds
        self.topics = topics
        #: where the subscribes and unsubscribes go, as every other one (gateway/catalog.py)
        self.catalog = catalog

    def connections(self, user: str, client: str | None) -> list[Hashable]:
        """The user's connections on this node (only `client`, when given and the user's)."""
        mine = list(self.clients.by_user.get(user, ()))
        return mine if client is None else [cid for cid in mine if cid == client]

    def _holds(self, client_id: Hashable, topic: str) -> bool:
        return self.topics.has_client(client_id) and topic in self.topics.client(client_id).subs

    def subscribe(self, user: str, topic: str, client: str | None, since: tuple[str, int] | None) -> int:
        """Subscribe the user's connections that do not hold `topic` yet, as the connect hook's server-side
        subscriptions are made: no permission check, the connection gets `subscribed` (id null) and the
        topic's entries from `since`, or an error entry (that connection only)."""
        done = 0
        for client_id in self.connections(user, client):
            conn = self.clients.conns.get(client_id)
            if conn is None or self._holds(client_id, topic):
                continue
            try:
                self.catalog.grant(str(client_id), topic, since=since)
            except RequestError as exc:
                self.clients.send_error(client_id, exc)
                continue
            done += 1
        return done

    def unsubscribe(self, user: str, topic: str, client: str | None) -> int:
        """Unsubscribe the user's connections that hold `topic`, as their own `unsubscribe` does (an
        `unsubscribed` entry with id null, presence left, the unsubscribe hook's event)."""
        done = 0
        for client_id in self.connections(user, client):
            conn = self.clients.conns.get(client_id)
            if conn is None or not self._holds(client_id, topic):
                continue
            self.catalog.unsubscribe(str(client_id), topic)
            done += 1
        return done

    def refresh(self, user: str, client: str | None, expired: bool, expire_at: float | None) -> int:
        """`expired`: close the user's connections as expired (4011). Else their token's expiry becomes
        `expire_at` (Unix seconds; None: they no longer expire), the expiry timer re-armed."""
        done = 0
        for client_id in self.connections(user, client):
            conn = self.clients.conns.get(client_id)
            principal = conn.identity.principal if conn is not None else None
            if conn is None or principal is None:
                continue
            if expired:
                done += self.clients.kick(client_id, close_codes.TOKEN_EXPIRED, "expired by admin", "token_expired")
                continue
            # the session renews the identity and re-arms the expiry timer
            conn.session.authenticate(dataclasses.replace(principal, expires_at=math.inf if expire_at is None else expire_at))
            done += 1
        return done

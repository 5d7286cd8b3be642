"""The operators' control commands on this node (docs/integration.md, "User control"): kick a client,
disconnect a user, revoke tokens, list clients; subscribe, unsubscribe and refresh a user's connections
(gateway/user_commands.py, for Centrifugo's server API, docs/centrifugo.md).

The admin API sends them through the broker (`Broker.control`), which runs them here (`ControlCommands.run`,
given to the broker at construction) and, with Redis, on every node (gateway/broker/control.py).
"""

from __future__ import annotations

from typing import Any

from . import close_codes
from .auth.revocations import Revocation
from .catalog import TopicCatalog
from .clients import ClientRegistry
from .errors import BadRequest
from .topic_view import TopicView
from .user_commands import UserCommands


class ControlCommands:
    def __init__(self, clients: ClientRegistry, topics: TopicView, catalog: TopicCatalog) -> None:
        self.clients = clients
        #: the engine's clients, read for `list`
        self.topics = topics
        #: subscribe, unsubscribe, refresh of a user's connections (gateway/user_commands.py)
        self.users = UserCommands(clients, topics, catalog)

    def run(self, command: dict[str, Any]) -> dict[str, Any]:
        """Run one control command on this node: `kick` (`client`), `disconnect` (`user`, optional `client`,
        `keep` and `reason`), `revoke` (`entry`, a `Revocation.as_dict`), `list` (`limit`), `subscribe` and
        `unsubscribe` (`user`, `topic`, optional `client`; `since` [epoch, seq]), `refresh` (`user`, optional
        `client`, `expired`, `expire_at`). Returns this node's answer. Raises a RequestError for a malformed
        command (and TooManyRevocations)."""
        op = command.get("op")
        if op == "kick":
            return {"kicked": self.clients.kick(str(command.get("client")), close_codes.KICKED, "kicked by admin", "kicked")}
        if op == "disconnect":
            return {
                "disconnected": self.disconnect_user(
                    str(command.get("user")),
                    _text(command, "client"),
                    frozenset(command.get("keep") or ()),
                    _text(command, "reason") or "disconnected by admin",
                )
            }
        if op in ("subscribe", "unsubscribe", "refresh"):
            return self._user_command(op, str(command.get("user")), command)
        if op == "revoke":
            entry, closed = self.revoke(Revocation.from_dict(command.get("entry")))
            return {"disconnected": closed, "entry": entry.as_dict()}
        if op == "list":
            limit = command.get("limit")
            if not isinstance(limit, int) or limit < 0:
                raise BadRequest("`limit` must be a non-negative integer")
            return {"clients": self.describe(limit), "total": len(self.clients.conns)}
        raise BadRequest(f"unknown control command {str(op)[:32]!r}")

    def disconnect_user(
        self, user: str, client: str | None = None, keep: frozenset[str] = frozenset(), reason: str = "disconnected by admin"
    ) -> int:
        """Close every connection of `user` on this node (4005), or only `client`, or all but those in `keep`.
        Returns how many."""
        if client is None:
            self.clients.pending.disconnected(user)  # a client on its way is refused as it registers
        closed = 0
        for client_id in self.users.connections(user, client):
            if client_id not in keep:
                closed += self.clients.kick(client_id, close_codes.DISCONNECTED, reason, "disconnected")
        return closed

    def _user_command(self, op: str, user: str, command: dict[str, Any]) -> dict[str, Any]:
        client = _text(command, "client")
        if op == "refresh":
            expire_at = command.get("expire_at")
            if expire_at is not None and not isinstance(expire_at, (int, float)):
                raise BadRequest("`expire_at` must be a number of Unix seconds")
            return {"refreshed": self.users.refresh(user, client, bool(command.get("expired")), expire_at)}
        topic = str(command.get("topic"))
        if op == "unsubscribe":
            return {"unsubscribed": self.users.unsubscribe(user, topic, client)}
        since = command.get("since")
        if since is not None and not (
            isinstance(since, list) and len(since) == 2 and isinstance(since[0], str) and isinstance(since[1], int)
        ):
            raise BadRequest("`since` must be [epoch, seq]")
        return {"subscribed": self.users.subscribe(user, topic, client, None if since is None else (since[0], since[1]))}

    def revoke(self, entry: Revocation) -> tuple[Revocation, int]:
        """Add `entry` to the revocation table and close the connections on this node that hold a token it
        names (4010). Returns the entry in force (an earlier one may be wider) and how many were closed. A
        `jti` entry looks at every authenticated connection (revocations are rare; a user entry only at the
        user's)."""
        entry = self.clients.tokens.revocations.add(entry)
        self.clients.pending.revoked(entry)  # a client on its way is refused as it registers
        if entry.user is not None:
            candidates = list(self.clients.by_user.get(entry.user, ()))
        else:
            candidates = [cid for ids in self.clients.by_user.values() for cid in ids]
        closed = 0
        for client_id in candidates:
            conn = self.clients.conns.get(client_id)
            principal = conn.identity.principal if conn is not None else None
            if principal is not None and entry.names(principal):
                closed += self.clients.kick(client_id, close_codes.TOKEN_REVOKED, "token revoked", "token_revoked")
        return entry, closed

    def describe(self, limit: int) -> list[dict[str, Any]]:
        """At most `limit` of this node's clients as `GET /api/clients` lists them."""
        clients: list[dict[str, Any]] = []
        for client_id, conn in self.clients.conns.items():
            if len(clients) >= limit:
                break
            client = self.topics.client(client_id)
            clients.append(
                {
                    "id": client.id,
                    "user": conn.identity.user,
                    "tenant": conn.identity.tenant,
                    "state": client.state.value,
                    "subscriptions": sorted(client.subs),
                    "direct_queued": client.queued(),
                    "active_handles": len(client.active),
                    **conn.describe(),
                }
            )
        return clients


def _text(command: dict[str, Any], key: str) -> str | None:
    """A command's optional string field (None when absent)."""
    value = command.get(key)
    return None if value is None else str(value)

"""One owner namespace for private queues (docs/security.md, "Isolation"): user ids and anonymous client ids
never collide.

A private queue belongs to an owner: a token's `sub` (a user), or, for an anonymous connection, its client
id (`ws-` / `sse-` / `lp-` and 16 hex digits, `ClientRegistry.new_client_id`). The admin API and the ingest name a queue
by that same string (`client`), in-process and in Redis keys (`P:{T}:qm:OWNER`). So the two sets must be
disjoint: a `sub` of the client id form is refused with every token (`bad_token`), and client ids always
have it. Then a token holder can never name, read or take over an anonymous client's queue.
"""

from __future__ import annotations

import re

#: what every client id is, and what no token's `sub` may be
CLIENT_ID = re.compile(r"[a-z]{1,16}-[0-9a-f]{16}")


def is_client_id(name: str) -> bool:
    return CLIENT_ID.fullmatch(name) is not None


def check_user_id(user: str) -> str | None:
    """Why `user` (a token's `sub`) cannot be a user id, or None when it can."""
    if is_client_id(user):
        return "claim 'sub' has the form of an anonymous client id (letters, '-', 16 hex digits): reserved"
    return None

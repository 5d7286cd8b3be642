"""What a client awaiting the connect hook is refused with as it registers (gateway/pending_connects.py): only
what the admin API did while it waited, matched against its token and against the connect hook's grant."""

from __future__ import annotations

import itertools
import math
import time

import pytest

from gateway.auth.identity import ClientIdentity
from gateway.auth.revocations import Revocation
from gateway.auth.tokens import Principal
from gateway.pending_connects import DISCONNECTED, REVOKED, PendingConnects

pytestmark = pytest.mark.unit


def principal(user: str, *, jti: str | None = None, issued_at: float | None = None, proxied: bool = False) -> Principal:
    return Principal(user, math.inf, (), (), None, proxied=proxied, jti=jti, issued_at=issued_at)


_ids = itertools.count()


def identity(token: Principal | None = None) -> ClientIdentity:
    return ClientIdentity(f"ws-{next(_ids):016x}", "ws", "192.0.2.1:1", "192.0.2.1", token)


def test_a_revocation_or_disconnect_made_while_waiting_names_the_token_or_the_grant():
    table = PendingConnects()
    now = time.time()
    by_token = table.add(identity(principal("ann", jti="j1", issued_at=now - 10)))
    granted = table.add(identity())  # anonymous: the hook grants "bob" below
    table.revoked(Revocation(now + 60, jti="j1"))
    table.revoked(Revocation(now + 60, user="bob", issued_before=now))
    granted.identity.principal = principal("bob", proxied=True)
    assert table.refusal(by_token) is REVOKED
    assert table.refusal(granted) is REVOKED
    # a client that came after the revocation is the backend's to judge: not refused by an older entry
    later = table.add(identity())
    later.identity.principal = principal("bob", proxied=True)
    assert table.refusal(later) is None
    table.disconnected("bob")
    assert table.refusal(later) is DISCONNECTED
    for pending in (by_token, granted, later):
        table.remove(pending)
    assert len(table) == 0


def test_the_drain_refuses_every_client_on_its_way_with_its_own_hint():
    table = PendingConnects()
    pending = table.add(identity())
    assert table.refusal(pending) is None
    table.drain(2.0)
    hints = {table.refusal(pending).retry_ms for _ in range(50)}
    assert len(hints) > 1 and all(0 <= ms <= 2000 for ms in hints)
    refusal = table.refusal(pending)
    assert refusal is not None and (refusal.code, refusal.cause) == (1012, "drain")
    assert refusal.reason == f"restarting: reconnect in {refusal.retry_ms} ms"

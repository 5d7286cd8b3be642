"""State the transports keep beside a connection or the hub is declared on its owner, typed, made with it:
no attribute is added at run time by name (`setattr(hub, "sessions", ...)`, read back with a `getattr`
fallback), which mypy cannot check and a typo would silently split."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import pytest

from gateway.auth.identity import ClientIdentity
from gateway.config import load_config
from gateway.edge.ratelog import TokenBucket
from gateway.hub import Hub
from gateway.session import SessionState
from gateway.session_store import SessionStore, SessionTable
from gateway.session_tables import CHECKPOINT_TTL_S, Checkpoints, ClosedSessions
from gateway.testing import DEFAULTS

pytestmark = pytest.mark.unit

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"


def test_the_hub_holds_the_session_transports_tables_from_the_start():
    async def make() -> Hub:
        return Hub(load_config(overrides={**DEFAULTS, "longpoll": {"session_ttl_s": 7, "max_sessions": 9}}, environ={}))

    hub = asyncio.run(make())
    sessions = hub.sessions
    assert isinstance(sessions, SessionStore)
    assert isinstance(sessions.longpoll, SessionTable) and sessions.longpoll.limit == 9 and len(sessions.longpoll) == 0
    assert isinstance(sessions.sse, SessionTable) and sessions.sse.limit is None and len(sessions.sse) == 0
    assert isinstance(sessions.closed, ClosedSessions)
    assert (sessions.closed.ttl, sessions.closed.limit) == (7, 9)
    assert isinstance(sessions.checkpoints, Checkpoints) and sessions.checkpoints.ttl == CHECKPOINT_TTL_S


def test_a_connections_rate_buckets_are_fields_of_its_session_state_not_its_identity():
    fields = {f.name for f in dataclasses.fields(ClientIdentity)}
    for name in ("publish_bucket", "subscribe_bucket", "costly_bucket", "hook_calls", "waiting", "last_command"):
        assert name in SessionState.__slots__ and name not in fields
    state = SessionState()
    assert state.publish_bucket is None and state.costly_bucket is None and state.hook_calls == 0
    state.costly_bucket = TokenBucket(1, 5)
    with pytest.raises(AttributeError):
        state.unknown = 1  # slotted: no attribute is added by name


def test_an_identitys_fields_are_only_who_it_is_its_topic_creations_are_the_budgets_counts():
    # every field but the budget's ledger object is set by the handshake, the connect hook or `authenticate`
    assert {f.name for f in dataclasses.fields(ClientIdentity)} == {
        "client_id",
        "transport",
        "peer",
        "ip",
        "principal",
        "tenant",
        "connected_at",
        "creations",
        "info",
    }
    identity = ClientIdentity("c1", "ws")
    ledger = identity.creations
    assert (ledger.created, ledger.creating) == (0, 0) and ClientIdentity("c2", "ws").creations is not ledger


def test_no_transport_adds_attributes_to_the_hub_or_an_identity_by_name():
    pattern = re.compile(
        r"\bsetattr\((hub|identity|self\.hub|self\.identity)\b"
        r"|\bgetattr\(\w+, \"(sessions|closed|checkpoints|costly_bucket)\""
    )
    found = [
        f"{path.name}:{n}"
        for path in sorted(GATEWAY.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []

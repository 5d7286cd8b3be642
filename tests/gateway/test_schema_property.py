"""Random JSON in every field of every command, record and admin body: the answer is always a documented
error code or a success, never a 500, a dropped connection or a wrong type accepted in silence."""

from __future__ import annotations

import asyncio
import json

import msgspec
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import BadSeq
from gateway import schema
from gateway.commands import handle
from gateway.config import load_config
from gateway.hub import Hub
from gateway.scheduler import Delivered
from gateway.session import ClientSession
from gateway.testing import DEFAULTS, make_token, run_gateway
from tests import web
from tests.gateway.test_protocol_contract import section, table_rows, ticked

DOCUMENTED = {code for row in table_rows(section("Error codes")) for code in ticked(row[0])}
ENTRY_TYPES = {ticked(row[0])[0] for row in table_rows(section("Entries"))}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)

VALID = {
    "subscribe": {"op": "subscribe", "topic": "chat.a", "since": {"epoch": "e", "seq": 0}, "id": 1},
    "unsubscribe": {"op": "unsubscribe", "topic": "chat.a", "id": 2},
    "publish": {"op": "publish", "topic": "chat.a", "data": {"x": 1}, "id": 3},
    "auth": {"op": "auth", "token": make_token("prop"), "id": 4},
    "rpc": {"op": "rpc", "method": "echo", "params": [1], "id": 5},
    "ping": {"op": "ping", "id": 6},
}
#: what each field must be; a value of another type must be refused
EXPECTED = {
    "topic": (str,),
    "token": (str,),
    "method": (str,),
    "since": (dict, type(None)),
    "id": (int, str, type(None)),
    "op": (str,),
}
FIELD_CASES = [(op, field) for op, command in VALID.items() for field in command]


def wrong_type(field: str, value) -> bool:
    kinds = EXPECTED.get(field)
    return kinds is not None and (isinstance(value, bool) or not isinstance(value, kinds))


class Recording:
    blocked_since: float | None = None

    def __init__(self, session):
        self.session = session
        self.identity = session.identity

    def deliver(self, batch, frame):
        return Delivered.DONE

    def flush(self):
        return True

    def kick(self, code, reason, retry_ms=None):
        pass

    def describe(self):
        return {}


async def answers(command: dict) -> list[dict]:
    hub = Hub(load_config(overrides=DEFAULTS, environ={}), instance_id="prop")
    session = ClientSession.begin(hub.services, "ws", ("127.0.0.1", 1))
    session.open(Recording(session))
    handle(session, json.dumps(command))  # stdlib: it writes integers of any size, as a peer may
    raw = [e for batch in hub.scheduler.engine.run_cycle() for e in batch.entries]
    for entry in raw:
        msgspec.json.decode(entry, type=schema.Entry, strict=True)  # every entry has its declared shape
    await hub.stop()
    return [orjson.loads(e) for e in raw]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(FIELD_CASES), value=json_values)
def test_any_value_in_any_command_field_is_answered_with_a_documented_code(case, value):
    op, field = case
    command = {**VALID[op], field: value}
    got = asyncio.run(answers(command))
    assert {e["type"] for e in got} <= ENTRY_TYPES
    errors = [e for e in got if e["type"] == "error"]
    assert {e["code"] for e in errors} <= DOCUMENTED
    if wrong_type(field, value):
        assert errors, f"{field}={value!r} accepted"


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(["topic", "data", "seq", "client", "sync", "auth", "extra"]), value=json_values)
def test_any_value_in_any_record_field_converts_or_is_a_bad_record(field, value):
    base = {"sync": {"sync": 1}, "auth": {"auth": "t"}}.get(field, {"topic": "t", "data": 1})
    record = {**base, field: value}
    try:
        converted = schema.record(record)
    except schema.BadRecord:
        return
    except BadSeq:  # a whole number outside [0, 2**53), as a JSON parser gives one past 64 bits (protocol.md)
        assert field == "seq" and isinstance(value, (int, float)) and not isinstance(value, bool)
        assert float(value).is_integer() and not 0 <= value < 2**53, value
        return
    assert field != "extra"  # an unknown field is never accepted
    if field in ("seq", "sync"):
        assert not isinstance(value, (bool, float)), f"{field}={value!r} accepted"
    if field in ("topic", "client", "auth"):
        assert isinstance(getattr(converted, field), (str, type(None)))


@pytest.fixture(scope="module")
def admin():
    with (
        run_gateway() as gw,
        web.Client(base_url=gw.http_url, timeout=10, headers={"Authorization": f"Bearer {gw.admin_token}"}) as http,
    ):
        yield http


ADMIN_FIELDS = [("/api/topics", f) for f in schema.CreateTopic.__struct_fields__] + [
    ("/api/topics/t.prop/publish", f) for f in schema.PublishBody.__struct_fields__
]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(ADMIN_FIELDS), value=json_values)
def test_any_value_in_any_admin_body_field_is_a_success_or_a_documented_4xx(admin, case, value):
    path, field = case
    body = {"name": f"t.prop.{abs(hash(repr(value))) % 10**6}"} if path == "/api/topics" else {"data": 1}
    body[field] = value
    r = admin.post(path, json=body)
    assert r.status_code in (200, 201, 400, 404, 409, 413, 503, 507), r.text
    if r.status_code >= 400:
        assert r.json()["error"]["code"] in DOCUMENTED
    if field in ("capacity", "batch_depth", "max_count", "max_bytes", "reorder_window", "seq") and (
        isinstance(value, (bool, float)) or (isinstance(value, int) and value < 0)
    ):
        assert r.status_code == 400, f"{field}={value!r} accepted"
    if field in ("client_publish", "anonymous") and not isinstance(value, bool):
        assert r.status_code == 400, f"{field}={value!r} accepted"

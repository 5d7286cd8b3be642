"""Tenants on a real gateway (`[fairness]`, gateway/tenancy.py): where a connection's tenant comes from, what
/metrics says of each, and that delivery goes on as before. The shares themselves are the engine's
(tests/core/test_fairness.py) and the load tool's to measure."""

from __future__ import annotations

import re
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from websockets.exceptions import ConnectionClosed

from gateway.auth.tokens import Principal
from gateway.config import ConfigError, load_config
from gateway.errors import BadToken
from gateway.tenancy import Tenancy
from gateway.testing import make_token, run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, recv_entries, send, ws_connect
from tests.security.test_jwks import KeySetServer

pytestmark = pytest.mark.timeout(60)

RULES = {"rules": [{"pattern": "*", "kind": "ring", "anonymous": True}]}
FAIRNESS = {
    "enabled": True,
    "default_tenant": "public",
    "tenants": [{"name": "acme", "weight": 3}, {"name": "globex", "key_ids": ["globex-2026"]}],
}


def tenant_samples(gw, name: str) -> dict[str, float]:
    text = web.get(f"{gw.http_url}/metrics", timeout=10, trust_env=False).text
    return {m[1]: float(m[2]) for m in re.finditer(rf'^{name}{{tenant="([^"]+)"}} (\S+)$', text, re.M)}


def test_a_connections_tenant_is_its_tokens_claim_or_the_default_and_each_tenant_is_counted():
    with run_gateway(topics=RULES, fairness=FAIRNESS) as gw:
        acme = make_token("ann", tenant="acme")
        other = make_token("bob", tenant="initech")  # not configured: weight 1, counted as `other`
        with (
            ws_connect(gw, query=f"?token={acme}") as a1,
            ws_connect(gw, query=f"?token={acme}") as a2,
            ws_connect(gw, query=f"?token={other}") as b,
            ws_connect(gw) as anonymous,
        ):
            for i, ws in enumerate((a1, a2, b, anonymous)):
                send(ws, op="subscribe", topic="feed.t", id=i)
                assert recv_entries(ws)[0]["type"] == "subscribed"
            published = web.post(
                f"{gw.http_url}/api/topics/feed.t/publish", headers=auth(gw), json={"data": {"n": 1}}, trust_env=False
            )
            assert published.status_code == 200, published.text
            for ws in (a1, a2, b, anonymous):
                assert [e["data"] for e in recv_entries(ws) if e["type"] == "msg"] == [{"n": 1}]
            assert tenant_samples(gw, "fanout_tenant_connections") == {"acme": 2, "globex": 0, "other": 1, "public": 1}
            assert tenant_samples(gw, "fanout_tenant_users") == {"acme": 1, "globex": 0, "other": 1, "public": 1}
            assert tenant_samples(gw, "fanout_tenant_weight")["acme"] == 3
            frames = tenant_samples(gw, "fanout_tenant_frames_total")
            assert frames["acme"] >= 4 and frames["other"] >= 2 and frames["public"] >= 2  # subscribed + msg each
            cost, sent = tenant_samples(gw, "fanout_tenant_cost_total"), tenant_samples(gw, "fanout_tenant_bytes_total")
            assert cost["acme"] == sent["acme"] + 8192 * frames["acme"]  # bytes + frame_cost_bytes a frame
            # an anonymous connection's first token decides its tenant; a later one may not change it
            send(anonymous, op="auth", token=make_token("cy", tenant="acme"), id=9)
            assert recv_entries(anonymous)[0]["type"] == "reply"
            assert tenant_samples(gw, "fanout_tenant_connections") == {"acme": 3, "globex": 0, "other": 1, "public": 0}
            send(anonymous, op="auth", token=make_token("cy", tenant="globex"), id=10)
            refused = recv_entries(anonymous)[0]
            assert (refused["type"], refused["code"]) == ("error", "bad_token") and "tenant mismatch" in refused["message"]
        deadline = time.monotonic() + 5
        while tenant_samples(gw, "fanout_tenant_connections") != {"acme": 0, "globex": 0, "other": 0, "public": 0}:
            assert time.monotonic() < deadline, tenant_samples(gw, "fanout_tenant_connections")
            time.sleep(0.02)


def test_without_fairness_no_tenant_figures_and_the_flat_cycle():
    with run_gateway(topics=RULES) as gw, ws_connect(gw) as ws:
        assert gw.call(lambda: gw.hub.scheduler.engine.fair) is None
        send(ws, op="subscribe", topic="feed.u", id=1)
        assert recv_entries(ws)[0]["type"] == "subscribed"
        assert tenant_samples(gw, "fanout_tenant_connections") == {}


def tenancy(**fairness) -> Tenancy:
    return Tenancy(load_config(overrides={"fairness": {**FAIRNESS, **fairness}}, environ={}).fairness)


@pytest.mark.unit
def test_the_key_decides_before_the_claim_and_a_claim_that_disagrees_is_refused():
    tenants = tenancy()
    signed = Principal("u", 0.0, key_id="globex-2026")
    assert tenants.tenant_of(signed) == "globex"
    assert tenants.tenant_of(Principal("u", 0.0, key_id="globex-2026", tenant="globex")) == "globex"
    with pytest.raises(BadToken, match="tenant mismatch"):
        tenants.tenant_of(Principal("u", 0.0, key_id="globex-2026", tenant="acme"))
    assert tenants.tenant_of(Principal("u", 0.0, tenant="acme")) == "acme"
    assert tenants.tenant_of(Principal("u", 0.0, key_id="unknown-kid")) == "public"
    assert tenants.tenant_of(None) == "public"


@pytest.mark.unit
@pytest.mark.parametrize(
    "tenants, words",
    [
        ([{"name": "a", "weight": 0}], "weight"),
        ([{"name": "a"}, {"name": "a"}], "twice"),
        ([{"name": "a", "key_ids": ["k"]}, {"name": "b", "key_ids": ["k"]}], "two tenants"),
        ([{"name": ""}], "characters"),
        ([{"name": "a", "share": 2}], "unknown field"),
    ],
)
def test_a_wrong_tenant_table_is_refused_at_start(tenants, words):
    with pytest.raises(ConfigError, match=words):
        tenancy(tenants=tenants)


def test_a_tenants_own_signing_key_decides_and_its_claim_may_not_name_another():
    acme_key, globex_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    keyset = KeySetServer()
    keyset.thread.start()
    keyset.publish(("acme-2026", acme_key), ("globex-2026", globex_key))
    fairness = {
        **FAIRNESS,
        "tenants": [{"name": "acme", "key_ids": ["acme-2026"]}, {"name": "globex", "key_ids": ["globex-2026"]}],
    }

    def token(key, kid: str, sub: str, **claims: str) -> str:
        return jwt.encode({"sub": sub, "exp": int(time.time()) + 600, **claims}, key, algorithm="ES256", headers={"kid": kid})

    try:
        auth = {"jwt_secret": "", "jwks_url": keyset.url, "rate_per_ip": 0.0, "rate_per_connection": 0.0}
        with run_gateway(topics=RULES, fairness=fairness, auth=auth) as gw:
            with ws_connect(gw, query=f"?token={token(globex_key, 'globex-2026', 'gus')}") as ws:
                send(ws, op="subscribe", topic="feed.k", id=1)
                assert recv_entries(ws)[0]["type"] == "subscribed"
                assert tenant_samples(gw, "fanout_tenant_connections")["globex"] == 1  # by its key, no claim
            # globex's key signing a token that claims acme: refused (4001, as every refused token)
            with ws_connect(gw, query=f"?token={token(globex_key, 'globex-2026', 'gus', tenant='acme')}") as ws:
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=5)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 4001
                assert "tenant mismatch" in closed.value.rcvd.reason
            with ws_connect(gw, query=f"?token={token(acme_key, 'acme-2026', 'ann', tenant='acme')}") as ws:
                send(ws, op="rpc", method="whoami", id=2)
                assert recv_entries(ws)[0]["result"]["user"] == "ann"
                assert tenant_samples(gw, "fanout_tenant_connections")["acme"] == 1
    finally:
        keyset.httpd.shutdown()
        keyset.httpd.server_close()


def test_the_admin_api_lists_each_tenants_share_against_its_weights():
    with run_gateway(topics=RULES, fairness=FAIRNESS) as gw:
        with ws_connect(gw, query=f"?token={make_token('ann', tenant='acme')}") as ws, ws_connect(gw) as anonymous:
            for i, client in enumerate((ws, anonymous)):
                send(client, op="subscribe", topic="feed.api", id=i)
                assert recv_entries(client)[0]["type"] == "subscribed"
            listed = web.get(f"{gw.http_url}/api/tenants", headers=auth(gw), trust_env=False).json()
            clients = web.get(f"{gw.http_url}/api/clients", headers=auth(gw), trust_env=False).json()["clients"]
            assert sorted((c["user"] or "", c["tenant"]) for c in clients) == [("", "public"), ("ann", "acme")]
            assert listed["enabled"] and listed["total"] == 3 and not listed["truncated"]
            rows = {row["name"]: row for row in listed["tenants"]}
            assert (rows["acme"]["connections"], rows["acme"]["users"], rows["acme"]["weight"]) == (1, 1, 3.0)
            assert rows["acme"]["weight_share"] == 0.75 and rows["public"]["weight_share"] == 0.25
            assert rows["globex"]["weight_share"] == 0.0 and rows["globex"]["cost"] == 0
            assert sum(row["share"] for row in rows.values()) == pytest.approx(1.0)
            assert rows["acme"]["cost"] == rows["acme"]["bytes"] + 8192 * rows["acme"]["frames"]
        assert web.get(f"{gw.http_url}/api/tenants", trust_env=False).status_code == 401
    with run_gateway(topics=RULES) as gw:
        off = web.get(f"{gw.http_url}/api/tenants", headers=auth(gw), trust_env=False).json()
        assert off == {"enabled": False, "tenants": []}

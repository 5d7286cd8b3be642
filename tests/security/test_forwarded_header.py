"""A client cannot choose the address its limits are counted against by sending X-Forwarded-For."""

from gateway.testing import run_gateway
from tests import web


def test_x_forwarded_for_does_not_escape_the_per_address_session_limit():
    with run_gateway(longpoll={"max_sessions_per_ip": 2}) as gw:
        answers = [web.post(f"{gw.http_url}/lp", headers={"X-Forwarded-For": f"203.0.113.{i}"}).status_code for i in range(3)]
        assert answers == [201, 201, 429]
        (session,) = [c for c in gw.hub.clients.conns.values()][:1]
        assert session.identity.ip == "127.0.0.1"

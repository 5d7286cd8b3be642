"""The HTTP edge (issue 24), on a real gateway over real loopback sockets: request heads bounded in bytes and
header lines (431, closed), WebSocket handshakes websockets refuses for size answered and closed (414/431),
the `Host` allow-list (421 `bad_host` on every path: DNS rebinding), and the security headers of pages."""

from __future__ import annotations

import base64
import json
import os
import socket

import pytest

from gateway.config import ConfigError
from gateway.testing import TEST_TOKEN, run_gateway
from tests import web
from tests.gateway.gw_helpers import wait_for
from tests.security.bytes_helpers import open_connections, read_until_closed, refused, tcp

pytestmark = pytest.mark.timeout(60)


def send_in_pieces(sock: socket.socket, data: bytes, piece: int) -> None:
    for i in range(0, len(data), piece):
        try:
            sock.sendall(data[i : i + piece])
        except (BrokenPipeError, ConnectionResetError):
            return


def json_error(data: bytes, status: bytes) -> str:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0].startswith(b"http/1.1 " + status), data[:300]
    assert b"content-type: application/json" in lines and b"connection: close" in lines
    return json.loads(body)["error"]["code"]


def upgrade(path: str = "/ws", host: str = "127.0.0.1", extra: bytes = b"") -> bytes:
    key = base64.b64encode(os.urandom(16))
    return (
        b"GET " + path.encode() + b" HTTP/1.1\r\nHost: " + host.encode() + b"\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n" + extra + b"\r\n"
    )


# -- 1. request heads: bytes and header lines ---------------------------------------------------------------


@pytest.fixture(scope="module")
def shared():
    """One default gateway for the tests that need nothing else (they count refusals from where they start)."""
    with run_gateway() as gw:
        yield gw


def test_a_head_over_max_header_bytes_is_answered_431_and_closed_whatever_its_pieces(shared):
    gw = shared  # the default bound: 16 KiB
    before = refused(gw)["header_too_large"]
    for piece in (100_000, 1000, 256):  # one read; many reads of one header value (the quadratic case)
        sock = tcp(gw)
        send_in_pieces(sock, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20000, piece)
        assert json_error(read_until_closed(sock), b"431") == "headers_too_large"
        sock.close()
    # a URL alone, too
    sock = tcp(gw)
    sock.sendall(b"GET /healthz?" + b"q" * 17000)
    assert json_error(read_until_closed(sock), b"431") == "headers_too_large"
    sock.close()
    wait_for(lambda: open_connections(gw) == 0, "every connection closed", timeout=5)
    assert refused(gw)["header_too_large"] == before + 4
    metrics = web.get(f"{gw.http_url}/metrics").text
    assert f'fanout_connections_refused_total{{reason="header_too_large"}} {float(before + 4)}' in metrics


def test_more_header_lines_than_max_headers_is_answered_431():
    with run_gateway(server={"max_headers": 20}) as gw:
        sock = tcp(gw)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-A: b\r\n" * 20 + b"\r\n")
        assert json_error(read_until_closed(sock), b"431") == "headers_too_large"
        sock.close()
        sock = tcp(gw)  # with Host: 20
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-A: b\r\n" * 18 + b"Connection: close\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 200")
        sock.close()


def test_heads_within_the_bounds_and_bodies_beyond_them_are_served():
    with run_gateway(server={"max_header_bytes": 4096}) as gw:
        assert web.get(f"{gw.http_url}/healthz", headers={"x-pad": "p" * 3500}).status_code == 200
        # a body sent with its head in one write (one read here) does not count as head
        body = json.dumps({"data": "d" * 60000}).encode()
        sock = tcp(gw)
        sock.sendall(
            b"POST /api/topics/chat.edge/publish HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + TEST_TOKEN.encode() + b"\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        # keep-alive: the next head on the same connection is bounded again
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n")
        assert b"HTTP/1.1 431" in read_until_closed(sock)
        sock.close()


def test_a_bad_header_bound_is_refused_at_start():
    with pytest.raises(ConfigError, match="max_header_bytes"):
        with run_gateway(server={"max_header_bytes": 10}):
            pass


# -- 2. WebSocket handshakes websockets refuses for size ------------------------------------------------------


@pytest.mark.parametrize("case", ["long_url", "long_header_line", "too_many_headers"])
def test_a_handshake_websockets_refuses_for_size_is_answered_and_closed_and_frees_its_slot(case):
    # under our own bounds (the default 16 KiB; 200 header lines), over websockets' (8 KiB a line, 128 headers)
    bounds = {"max_headers": 200} if case == "too_many_headers" else {}
    with run_gateway(server={**bounds, "max_connections_per_ip": 4}) as gw:
        request, status = {
            "long_url": (upgrade("/ws?x=" + "a" * 9000), b"414"),
            "long_header_line": (upgrade(extra=b"X-Long: " + b"b" * 9000 + b"\r\n"), b"431"),
            "too_many_headers": (upgrade(extra=b"".join(b"X-H%d: v\r\n" % i for i in range(150))), b"431"),
        }[case]
        for _ in range(6):  # more than the per-address limit: each one's slot is freed
            sock = tcp(gw)
            sock.sendall(request)
            data = read_until_closed(sock)
            assert data.startswith(b"HTTP/1.1 " + status), data[:200]
            sock.close()
        wait_for(lambda: open_connections(gw) == 0, "every connection closed", timeout=5)
        assert refused(gw)["header_too_large"] == 6


# -- 3. Host allow-list ------------------------------------------------------------------------------------


def test_a_foreign_host_is_answered_421_on_every_path_and_transport(shared):
    gw = shared
    before = refused(gw)["bad_host"]
    wait_for(lambda: gw.call(lambda: len(gw.hub.clients.conns)) == 0, "no client of a test before")
    # a live SSE session, whose POST a rebinding page would aim at
    with web.Client(timeout=10) as client, client.stream("GET", f"{gw.http_url}/sse") as stream:
        lines = stream.iter_lines()
        assert next(lines) == "event: session"
        session = json.loads(next(lines)[len("data: ") :])["session"]
        requests = [
            b"GET /healthz HTTP/1.1\r\nHost: rebind.attacker.example\r\n\r\n",
            b"GET /sse?topics=chat.x HTTP/1.1\r\nHost: rebind.attacker.example:%d\r\n\r\n" % gw.http_port,
            b"POST /sse/" + session.encode() + b" HTTP/1.1\r\nHost: rebind.attacker.example\r\n"
            b'Content-Type: application/json\r\nContent-Length: 13\r\n\r\n{"op":"ping"}',
            b"POST /lp HTTP/1.1\r\nHost: rebind.attacker.example\r\nContent-Length: 0\r\n\r\n",
            b"GET /admin/ HTTP/1.1\r\nHost: rebind.attacker.example\r\n\r\n",
            b"GET /api/stats HTTP/1.1\r\nHost: rebind.attacker.example\r\nAuthorization: Bearer "
            + TEST_TOKEN.encode()
            + b"\r\n\r\n",
            upgrade(host="rebind.attacker.example"),
            # a second Host header cannot smuggle the name past the check
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: rebind.attacker.example\r\n\r\n",
        ]
        for request in requests:
            sock = tcp(gw)
            sock.sendall(request)
            assert json_error(read_until_closed(sock), b"421") == "bad_host", request[:60]
            sock.close()
    assert refused(gw)["bad_host"] == before + len(requests)
    assert gw.call(lambda: len(gw.hub.clients.conns)) == 0  # no WebSocket, SSE or long-poll client was made


def test_the_default_allows_the_bind_address_localhost_and_ip_literals(shared):
    gw = shared
    for host in (
        "127.0.0.1",
        f"127.0.0.1:{gw.http_port}",
        "localhost",
        f"LOCALHOST:{gw.http_port}",
        "localhost.",
        "10.1.2.3:80",
        "[::1]:8080",
    ):
        assert web.get(f"{gw.http_url}/healthz", headers={"Host": host}).status_code == 200, host
    sock = tcp(gw)  # HTTP/1.0 without Host: not a browser
    sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    assert read_until_closed(sock).startswith(b"HTTP/1.1 200")
    for host in ("localhost.attacker.example", "attacker.example", "127.0.0.1.nip.io"):
        assert web.get(f"{gw.http_url}/healthz", headers={"Host": host}).status_code == 421, host


def test_allowed_hosts_names_and_wildcards():
    with run_gateway(server={"allowed_hosts": ["gw.example.com", "*.apps.example"]}) as gw:
        for host, status in (
            ("gw.example.com", 200),
            ("GW.example.com:443", 200),
            ("a.apps.example", 200),
            ("b.c.apps.example", 200),
            ("apps.example", 421),
            ("localhost", 421),
            ("evil-gw.example.com", 421),
            ("127.0.0.1", 200),
        ):
            assert web.get(f"{gw.http_url}/healthz", headers={"Host": host}).status_code == status, host
    with run_gateway(server={"allowed_hosts": ["*"]}) as gw:
        assert web.get(f"{gw.http_url}/healthz", headers={"Host": "any.example"}).status_code == 200
    for bad in (["*.*.example"], [""], "gw.example.com"):
        with pytest.raises(ConfigError, match="allowed_hosts"):
            with run_gateway(server={"allowed_hosts": bad}):
                pass


# -- 4. security headers -----------------------------------------------------------------------------------


def test_pages_and_answers_carry_the_security_headers(shared):
    gw = shared
    for path in ("/admin/", "/", "/healthz", "/fanout.js", "/api/stats", "/no-such-page"):
        reply = web.get(f"{gw.http_url}{path}", headers={"Authorization": f"Bearer {TEST_TOKEN}"})
        assert reply.headers.get("x-content-type-options") == "nosniff", path
        assert reply.headers.get("content-security-policy") == "frame-ancestors 'none'", path
        assert reply.headers.get("x-frame-options") == "DENY", path
        assert reply.headers.get_list("x-content-type-options") == ["nosniff"], path  # once
    # composes with what a route sets itself (the client library's own headers are kept)
    library = web.get(f"{gw.http_url}/fanout.js")
    assert library.status_code == 200 and library.headers.get("etag")

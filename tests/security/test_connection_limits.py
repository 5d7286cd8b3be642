"""Connection-level defences against one anonymous attacker, on a real gateway over real loopback sockets:
connection limits (503 too_many_connections), the request-header deadline (slowloris), TLS, the ready file,
and invalid UTF-8 in WebSocket text frames (close 1007, counted, no traceback per frame)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trustme
import websockets.asyncio.client
from websockets.sync.client import connect

from gateway.config import ConfigError
from gateway.testing import run_gateway
from tests import web
from tests.security.bytes_helpers import open_connections, read_until_closed, refused, tcp

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)

HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


# -- helpers: raw sockets, bounded waits -------------------------------------------------------------------


def closed_after(sock: socket.socket, timeout: float = 5.0) -> float:
    """Seconds until the gateway closes the connection (nothing may arrive before)."""
    start = time.monotonic()
    assert read_until_closed(sock, timeout) == b""
    return time.monotonic() - start


def trickle_until_closed(sock: socket.socket, data: bytes, period: float = 0.1, timeout: float = 3.0) -> float:
    """Send `data` one byte every `period` seconds (cycling) until the gateway closes; seconds it took."""
    start = time.monotonic()
    sock.settimeout(period)
    for i in range(int(timeout / period)):
        try:
            sock.sendall(data[i % len(data) :][:1])
            if sock.recv(1) == b"":
                return time.monotonic() - start
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - start
    raise AssertionError(f"still open after {timeout} s of trickling")


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP response with a Content-Length: (head, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return head, body


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def assert_refusal(data: bytes) -> None:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0] == b"http/1.1 503 service unavailable"
    assert b"content-type: application/json" in lines and b"connection: close" in lines
    assert json.loads(body)["error"]["code"] == "too_many_connections"


def ws_handshake(sock: socket.socket, path: str = "/ws") -> None:
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    assert data.startswith(b"HTTP/1.1 101"), data


def masked_frame(opcode: int, payload: bytes) -> bytes:
    mask = os.urandom(4)
    assert len(payload) < 126
    return bytes((0x80 | opcode, 0x80 | len(payload))) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def ws_subscribed(ws, topic: str = "chat.room") -> None:
    ws.send(json.dumps({"op": "subscribe", "topic": topic, "id": 1}))
    assert json.loads(ws.recv(timeout=5))[0]["type"] == "subscribed"


# -- connection limits -----------------------------------------------------------------------------------


def test_per_ip_limit_answers_503_and_a_closed_connection_or_websocket_frees_its_slot():
    with run_gateway(server={"max_connections_per_ip": 5, "header_timeout_s": 10.0}) as gw:
        held = [tcp(gw) for _ in range(5)]
        wait_for(lambda: open_connections(gw) == 5)
        sixth = tcp(gw)
        assert_refusal(read_until_closed(sixth))
        held.pop().close()
        wait_for(lambda: open_connections(gw) == 4)
        again = tcp(gw)
        again.sendall(HEALTHZ)
        head, body = read_response(again)
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"status": "ok"}
        for sock in [again, *held]:
            sock.close()
        wait_for(lambda: open_connections(gw) == 0)

        # an upgraded WebSocket keeps the slot of its HTTP connection until it closes
        with contextlib.ExitStack() as stack:
            clients = [stack.enter_context(connect(gw.ws_url, open_timeout=5)) for _ in range(5)]
            # (a raw socket: the websockets client may see the answer and the close before it sends its
            # request, and then reports a closed connection instead of the 503)
            assert_refusal(read_until_closed(tcp(gw)))
            clients[0].close()
            wait_for(lambda: open_connections(gw) == 4)
            with connect(gw.ws_url, open_timeout=5) as ws:
                ws_subscribed(ws)
        wait_for(lambda: open_connections(gw) == 0)
        assert refused(gw) == {"total": 0, "per_ip": 2, "header_timeout": 0, "header_too_large": 0, "bad_host": 0}
        assert gw.hub.bad_input.by_source["http"] == 2
        metrics = web.get(f"{gw.http_url}/metrics").text
        assert "fanout_http_connections 1.0" in metrics  # the scrape's own connection
        assert 'fanout_connections_refused_total{reason="per_ip"} 2.0' in metrics


def test_total_limit_refuses_beyond_it():
    with run_gateway(server={"max_connections": 3, "max_connections_per_ip": 0}) as gw:
        held = [tcp(gw) for _ in range(3)]
        wait_for(lambda: open_connections(gw) == 3)
        fourth = tcp(gw)
        assert_refusal(read_until_closed(fourth))
        for _ in range(20):  # an HTTP client sending its request at once reads the answer, never a reset
            answer = web.get(f"{gw.http_url}/healthz")
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "too_many_connections"
        assert refused(gw)["total"] == 21
        for sock in held:
            sock.close()
        wait_for(lambda: open_connections(gw) == 0)
        assert web.get(f"{gw.http_url}/healthz").json() == {"status": "ok"}


# -- request-header deadline (slowloris) ------------------------------------------------------------------


def test_header_deadline_closes_slow_and_idle_connections_but_not_clients():
    with run_gateway(server={"header_timeout_s": 0.5}) as gw:
        bare = tcp(gw)  # connects, sends nothing
        half = tcp(gw)
        half.sendall(b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n")  # a handshake, unfinished
        with connect(gw.ws_url, open_timeout=5) as ws, web.Client(base_url=gw.http_url) as client:
            assert client.get("/healthz").status_code == 200
            # a byte every 0.1 s: activity does not move the deadline
            assert 0.3 < trickle_until_closed(tcp(gw), HEALTHZ[:-4]) < 3
            assert closed_after(bare, 3) < 3
            assert closed_after(half, 3) < 3
            time.sleep(0.6)  # past the deadline: an open WebSocket and an idle keep-alive client are left alone
            ws_subscribed(ws)
            assert client.get("/healthz").status_code == 200
        wait_for(lambda: refused(gw)["header_timeout"] == 3)


def test_keep_alive_connection_that_stalls_in_its_next_request_is_closed():
    with run_gateway(server={"header_timeout_s": 0.5}) as gw:
        sock = tcp(gw)
        sock.sendall(HEALTHZ)
        assert read_response(sock)[0].startswith(b"HTTP/1.1 200")
        time.sleep(0.8)  # idle between requests is uvicorn's keep-alive timeout (5 s), not the header deadline
        sock.sendall(HEALTHZ)
        assert read_response(sock)[0].startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the next request stalls
        assert 0.3 < closed_after(sock, 3) < 3

        # bare CRLFs between requests are skipped by the parser: they must not hold the connection either
        crlf = tcp(gw)
        crlf.sendall(HEALTHZ)
        read_response(crlf)
        assert 0.3 < trickle_until_closed(crlf, b"\r\n") < 3
        wait_for(lambda: refused(gw)["header_timeout"] == 2)


# -- TLS ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    folder = tmp_path_factory.mktemp("tls")
    certfile, keyfile = folder / "server.pem", folder / "server.key"
    cert.cert_chain_pems[0].write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return certfile, keyfile, context


def test_tls_serves_wss_and_https(tls):
    certfile, keyfile, context = tls

    async def subscribe(url: str) -> dict:
        # the asyncio client: the sync one reads and writes one SSL socket from two threads, and now and then
        # stalls its own handshake request until the server gives up on it (seen under CPU load)
        async with websockets.asyncio.client.connect(url, ssl=context, open_timeout=5) as ws:
            await ws.send(json.dumps({"op": "subscribe", "topic": "chat.room", "id": 1}))
            ack = json.loads(await asyncio.wait_for(ws.recv(), 5))[0]
            assert open_connections(gw) == 1  # counted like any other connection
            return ack

    with run_gateway(server={"ssl_certfile": str(certfile), "ssl_keyfile": str(keyfile)}) as gw:
        port = gw.http_port
        assert asyncio.run(subscribe(f"wss://127.0.0.1:{port}/ws"))["type"] == "subscribed"
        assert web.get(f"https://127.0.0.1:{port}/healthz", verify=context).json() == {"status": "ok"}
        wait_for(lambda: open_connections(gw) == 0)
        assert refused(gw) == {"total": 0, "per_ip": 0, "header_timeout": 0, "header_too_large": 0, "bad_host": 0}


def test_tls_config_mistakes_are_config_errors(tls, tmp_path):
    certfile, keyfile, _ = tls
    with pytest.raises(ConfigError, match="ssl_certfile and server.ssl_keyfile go together"):
        with run_gateway(server={"ssl_certfile": str(certfile)}):
            pass
    missing = tmp_path / "nope.key"
    with pytest.raises(ConfigError, match=str(missing)):
        with run_gateway(server={"ssl_certfile": str(certfile), "ssl_keyfile": str(missing)}):
            pass
    with pytest.raises(ConfigError, match="ssl_keyfile"):  # the key does not belong to the certificate
        with run_gateway(server={"ssl_certfile": str(certfile), "ssl_keyfile": str(certfile)}):
            pass


# -- the ready file ----------------------------------------------------------------------------------------


def test_ready_file_is_private_and_holds_only_a_generated_token(tmp_path):
    # both gateways (a configured token, a generated one) started at once: one start's wait for the two
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    started = {}
    for configured in (True, False):
        folder = tmp_path / ("configured" if configured else "generated")
        folder.mkdir()
        config, ready = folder / "gateway.toml", folder / "ready.json"
        token_line = 'admin_token = "configured-secret"\n' if configured else ""
        config.write_text(f'[server]\nhost = "127.0.0.1"\nport = 0\n{token_line}[ingest]\nport = 0\n[rawtcp]\nenabled = false\n')
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--ready-file", str(ready)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started[configured] = (proc, ready)
    outputs = {}
    try:
        for configured, (proc, ready) in started.items():
            deadline = time.monotonic() + 30
            while not ready.exists():
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert ready.stat().st_mode & 0o777 == 0o600, configured
            info = json.loads(ready.read_text())
            assert info["http_port"] > 0
            assert ("admin_token" in info) is not configured
            assert web.get(f"http://127.0.0.1:{info['http_port']}/healthz").json() == {"status": "ok"}
    finally:
        for proc, _ready in started.values():
            proc.send_signal(signal.SIGTERM)
        for configured, (proc, _ready) in started.items():
            outputs[configured], _ = proc.communicate(timeout=20)
    for configured, out in outputs.items():
        assert "open-files limit (RLIMIT_NOFILE)" in out, configured
        assert "configured-secret" not in out, configured


# -- invalid UTF-8 in WebSocket text frames ----------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_invalid_utf8_text_frames_close_with_1007_counted_without_a_traceback(caplog):
    uvicorn_log = _Records()
    with run_gateway(limits={"bad_input_log_per_s": 1.0}) as gw:
        logging.getLogger("uvicorn").addHandler(uvicorn_log)
        try:
            for _ in range(6):
                sock = tcp(gw)
                ws_handshake(sock)
                # several bad frames in one write: the connection fails at the first, once
                sock.sendall(masked_frame(0x1, b"\xff\xfe") * 3)
                data = read_until_closed(sock)
                assert data[0] == 0x88, data  # a close frame, code 1007
                assert struct.unpack("!H", data[2:4])[0] == 1007
                sock.close()
        finally:
            logging.getLogger("uvicorn").removeHandler(uvicorn_log)
        wait_for(lambda: open_connections(gw) == 0)
        assert gw.hub.bad_input.by_source["ws"] == 6  # one per connection, not one per frame
    assert not [r for r in uvicorn_log.records if r.levelno >= logging.ERROR or r.exc_info]
    logged = [r for r in caplog.records if r.name == "gateway.input"]
    assert 1 <= len(logged) < 6 and not any(r.exc_info for r in logged)  # 18 bad frames, a line per second


@pytest.mark.parametrize(
    "frame, code",
    [
        (bytes((0x81, 0xFF)) + struct.pack("!Q", 200000) + os.urandom(4), 1009),  # over websocket.max_frame_bytes
        (bytes((0x81, 0x05)) + b"hello", 1002),  # unmasked: a protocol error
    ],
    ids=["too-large", "unmasked"],
)
def test_other_frame_errors_close_with_their_code_and_are_counted(frame_errors_gateway, frame, code):
    gw = frame_errors_gateway
    counted = gw.hub.bad_input.by_source["ws"]
    sock = tcp(gw)
    ws_handshake(sock)
    sock.sendall(frame)
    data = read_until_closed(sock)
    assert data[0] == 0x88 and struct.unpack("!H", data[2:4])[0] == code
    sock.close()
    wait_for(lambda: gw.hub.bad_input.by_source["ws"] == counted + 1)


@pytest.fixture(scope="module")
def frame_errors_gateway():
    """One default gateway for both cases of the test above."""
    with run_gateway() as gw:
        yield gw

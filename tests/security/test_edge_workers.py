"""`server.workers = 2` at the edge (issue 24), on real `gateway serve` processes and a real redis-server:
the internal links between workers are reachable by no other process, the start-up descriptor check counts
the sockets forwards hold, and per-address limits hold across the workers."""

from __future__ import annotations

import concurrent.futures
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from loadtest.floodprobe import recv_until
from loadtest.redisproc import REDIS_SERVER
from tests import web
from tests.cluster.cluster_helpers import ROOT, Node, NodeFactory, RedisServer

if not (os.path.exists(REDIS_SERVER) or shutil.which("redis-server")):
    pytest.skip("redis-server is missing: `make redis` (part of `make test`) installs it", allow_module_level=True)

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nodes(tmp_path, redis):
    factory = NodeFactory(tmp_path, redis)
    yield factory
    factory.stop_all()


SECRET = "edge-workers-jwt-secret-of-32-bytes!!"


@pytest.fixture(scope="module")
def shared(tmp_path_factory, redis):
    """One two-worker node for the tests whose settings do not meet: each takes its own bucket or sessions
    (anonymous long-poll sessions take no token check and create no topic; token checks create no topic)."""
    factory = NodeFactory(tmp_path_factory.mktemp("shared"), redis)
    node = factory.start(
        "w",
        server={"workers": 2},
        longpoll={"poll_timeout_s": 0.1},  # a poll with nothing to give returns after 0.1 s
        auth={"jwt_secret": SECRET, "rate_per_ip": 0.01, "burst_per_ip": 4},
        limits={"topic_create_burst": 3, "topic_create_rate": 0.0},
    )
    yield node
    factory.stop_all()


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening(pid: int) -> tuple[set[int], int]:
    """(TCP ports the process listens on, Unix sockets it listens on)."""
    inodes = _socket_inodes(pid)
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    unix = 0
    with open("/proc/net/unix") as f:
        for line in list(f)[1:]:
            fields = line.split()
            if fields[3] == "00010000" and fields[6] in inodes:  # __SO_ACCEPTCON: listening
                unix += 1
    return ports, unix


#: no connection kept: every request on a new one (which the kernel gives to either worker); one client, as a
#: new httpx client per request costs tens of ms of set-up
_FRESH = web.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0))


def fresh(method: str, url: str, **kwargs) -> httpx.Response:
    return _FRESH.request(method, url, **kwargs)


# -- 5. the internal links ---------------------------------------------------------------------------------


def test_workers_listen_on_the_public_ports_only_and_still_forward_sessions(shared):
    node = shared
    public = {node.info["http_port"], node.ingest_port}
    for pid in node.info["workers"]:
        ports, unix = listening(pid)
        assert ports <= public and unix == 0, (pid, ports, public, unix)  # nothing a local process could reach
    # forwards work: sessions of both workers, each polled over fresh connections (either worker)
    secrets = [fresh("POST", f"{node.http_url}/lp").json()["session"] for _ in range(10)]
    assert {s.split(".", 1)[0] for s in secrets} == {"w0", "w1"}
    # 30 polls of 0.1 s at once, each on a fresh connection
    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        replies = list(pool.map(lambda secret: fresh("GET", f"{node.http_url}/lp/{secret}"), secrets * 3))
    for reply in replies:
        assert reply.status_code == 200, reply.text
    for secret in secrets:  # ended: the node's stop has no session to wait for (its drain: up to 1 s)
        assert fresh("DELETE", f"{node.http_url}/lp/{secret}").status_code == 204


# -- 6. descriptors of forwards counted at start -----------------------------------------------------------


def test_the_descriptor_check_counts_the_sockets_of_forwards(redis, tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text(Node(tmp_path, redis.url, {"server": {"workers": 2, "max_connections": 100}}).config_text())
    ready = tmp_path / "ready.json"

    def low_limit() -> None:  # 300 descriptors: above max_connections + 64 (164), below 3 x 100 + 64 (364)
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))

    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    log = tmp_path / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--ready-file", str(ready)],
            cwd=ROOT,
            env=env,
            preexec_fn=low_limit,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        # the check is made before the workers start: its line, or the start without it, ends the wait
        while b"descriptors run out first" not in log.read_bytes() and not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(20)
    output = log.read_text(errors="replace")
    assert "3 x server.max_connections" in output and "(364)" in output, output[-3000:]


# -- 7. per-address limits across workers ------------------------------------------------------------------


def _served(port: int) -> socket.socket | None:
    """A kept-alive connection that got 200 for /healthz, or None when it was refused (503)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = recv_until(sock, b"\r\n\r\n", 4096)
    if data.startswith(b"HTTP/1.1 200"):
        return sock
    assert data.startswith(b"HTTP/1.1 503"), data[:200]
    sock.close()
    return None


def test_per_address_limits_hold_across_two_workers(nodes):
    node = nodes.start(
        "w",
        server={"workers": 2, "max_connections_per_ip": 4},
        longpoll={"max_sessions_per_ip": 3},
        sse={"max_sessions_per_ip": 2},
    )
    port = node.info["http_port"]
    # connections: one at a time, each served before the next (no two admissions at the same instant)
    held = [_served(port) for _ in range(12)]
    assert sum(s is not None for s in held) == 4, [s is not None for s in held]
    for sock in held:
        if sock is not None:
            sock.close()
    time.sleep(0.3)  # the closes reach both workers
    # long-poll sessions, each on a fresh connection (the kernel spreads them over both workers)
    created = [fresh("POST", f"{node.http_url}/lp") for _ in range(10)]
    answers = [reply.status_code for reply in created]
    assert answers.count(201) == 3 and answers.count(429) == 7, answers
    for reply in created:  # ended: the node's stop has no session to wait for (its drain: up to 1 s)
        if reply.status_code == 201:
            assert fresh("DELETE", f"{node.http_url}/lp/{reply.json()['session']}").status_code == 204
    # SSE streams, held open
    with web.Client(timeout=10) as a, web.Client(timeout=10) as b, web.Client(timeout=10) as c:
        streams = []
        statuses = []
        for client in (a, b, c, a, b, c):
            stream = client.stream("GET", f"{node.http_url}/sse")
            response = stream.__enter__()
            statuses.append(response.status_code)
            if response.status_code == 200:
                lines = response.iter_lines()
                next(lines)  # the session event: the stream is registered (the iterator kept: it holds it)
                streams.append((stream, lines))
            else:
                stream.__exit__(None, None, None)
        assert statuses.count(200) == 2, statuses
        for stream, _ in streams:
            stream.__exit__(None, None, None)


# -- 7b. token buckets keyed by address across workers ------------------------------------------------------


def test_token_checks_per_address_hold_across_two_workers(shared):
    """auth.rate_per_ip / burst_per_ip: one bucket per address whichever worker checks the token (before,
    each worker had its own: two workers allowed twice the burst)."""
    node = shared
    statuses = [
        fresh("POST", f"{node.http_url}/lp", headers={"Authorization": "Bearer not.a.token"}).status_code for _ in range(30)
    ]  # each on a new connection: the kernel spreads them over both workers
    assert statuses.count(429) == 26 and set(statuses) - {429} == {401}, statuses


def test_topic_creations_per_address_hold_across_two_workers(shared):
    """limits.topic_create_rate / topic_create_burst: one bucket per address across the workers."""
    from websockets.sync.client import connect

    node = shared
    answers = []
    for i in range(16):  # one creation per connection, each a new connection (either worker)
        with connect(node.ws_url, open_timeout=10) as ws:
            ws.send(json.dumps({"op": "publish", "topic": f"chat.n{i}", "data": i, "id": i}))
            while True:
                entries = [e for e in json.loads(ws.recv(timeout=10)) if e.get("id") == i]
                if entries:
                    answers.append("ok" if entries[0]["type"] == "reply" else entries[0]["code"])
                    break
    assert answers == ["ok"] * 3 + ["too_many_topics"] * 13, answers

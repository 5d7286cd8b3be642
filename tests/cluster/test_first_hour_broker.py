"""A new user's first hour with a broker (hardening round 4), on the real `gateway serve`:

- with `server.workers` > 1 a port in use ends every worker and the supervisor with status 2 and one line
  naming the port and its key (as with one process: tests/gateway/test_first_hour.py);
- a sentinel whose `SENTINEL MASTERS` answer is malformed is a sentinel that cannot be used: the start ends
  with the one "unreachable" line and status 2, as for sentinels that do not answer, never a traceback.
  The sentinel is a scripted peer on a real socket (a tiny RESP server here), not a redis-sentinel: no real
  one answers so. Its well-formed answer, naming the test's real redis-server, still connects.

Each case is a gateway process that ends on its own: the cases of a test run side by side (their start-ups
overlap), each checked on its own with its name in the message."""

from __future__ import annotations

import re
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cluster.cluster_helpers import Node

#: what a Redis 7 answers to HELLO 3 (redis-py sends it first)
HELLO = (
    b"%7\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$6\r\n7.0.15\r\n$5\r\nproto\r\n:3\r\n$2\r\nid\r\n"
    b":3\r\n$4\r\nmode\r\n$8\r\nsentinel\r\n$4\r\nrole\r\n$8\r\nsentinel\r\n$7\r\nmodules\r\n*0\r\n"
)


def bulk(text: str) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(text.encode()), text.encode())


def resp_map(*pairs: tuple[str, bytes]) -> bytes:
    return b"%%%d\r\n" % len(pairs) + b"".join(bulk(key) + value for key, value in pairs)


def master(**fields: bytes) -> bytes:
    return resp_map(*((key.replace("_", "-"), value) for key, value in fields.items()))


#: malformed `SENTINEL MASTERS` answers: each ended the start with a traceback (status 1) before
MALFORMED = {
    # the finding: `flags` a number (redis-py: AttributeError: 'int' object has no attribute 'split')
    "flags-a-number": b"*1\r\n" + master(name=bulk("mymaster"), flags=b":1\r\n"),
    "not-a-list": b"+OK\r\n",
    "a-list-of-numbers": b"*2\r\n:1\r\n:2\r\n",
    "no-flags": b"*1\r\n" + master(name=bulk("mymaster"), ip=bulk("127.0.0.1"), port=bulk("6379")),
    "no-address": b"*1\r\n" + master(name=bulk("mymaster"), flags=bulk("master"), num_other_sentinels=bulk("0")),
    # redis-py reads it to decide whether the sentinel sees the others
    "no-sentinel-count": b"*1\r\n" + master(name=bulk("mymaster"), ip=bulk("127.0.0.1"), port=bulk("6379"), flags=bulk("master")),
    "port-not-a-number": b"*1\r\n"
    + master(name=bulk("mymaster"), ip=bulk("127.0.0.1"), port=bulk("sixty"), flags=bulk("master")),
}


def read_command(reader) -> list[bytes] | None:
    """One RESP command (an array of bulk strings), None at the end of the stream."""
    line = reader.readline()
    if not line:
        return None
    assert line.startswith(b"*"), line
    parts = []
    for _ in range(int(line[1:])):
        size = int(reader.readline()[1:])
        parts.append(reader.read(size + 2)[:-2])
    return parts


class FakeSentinel(socketserver.ThreadingTCPServer):
    """Answers HELLO as Redis does, `SENTINEL MASTERS` with `masters`, anything else +OK."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, masters: bytes) -> None:
        self.masters = masters
        self.asked = 0

        class Handler(socketserver.StreamRequestHandler):
            def handle(handler) -> None:
                while (command := read_command(handler.rfile)) is not None:
                    name = [part.upper() for part in command[:2]]
                    if name[0] == b"HELLO":
                        handler.wfile.write(HELLO)
                    elif name == [b"SENTINEL", b"MASTERS"]:
                        self.asked += 1
                        handler.wfile.write(self.masters)
                    else:
                        handler.wfile.write(b"+OK\r\n")

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def fake_sentinel() -> Iterator[Callable[[bytes], FakeSentinel]]:
    servers: list[FakeSentinel] = []

    def start(masters: bytes) -> FakeSentinel:
        server = FakeSentinel(masters)
        # polled every 50 ms, not 0.5 s: the shutdown of each after the test waits for its next poll
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def sentinel_node(workdir: Path, sentinel: str) -> Node:
    return Node(
        workdir,
        "",
        {"broker": {"url": "", "sentinel_addresses": [sentinel], "sentinel_master": "mymaster", "connect_timeout_s": 1.0}},
    )


@pytest.mark.timeout(90)
def test_a_malformed_sentinel_masters_answer_is_the_unreachable_line_and_status_2(tmp_path, fake_sentinel) -> None:
    started = []
    for answer in sorted(MALFORMED):  # every case's gateway at once, each on a sentinel of its own
        sentinel = fake_sentinel(MALFORMED[answer])
        node = sentinel_node(tmp_path / answer, sentinel.address)
        node.start(wait=False)
        started.append((answer, sentinel, node))
    for answer, sentinel, node in started:
        assert node.proc is not None
        assert node.proc.wait(60) == 2, (answer, node.log())
        log = node.log()
        assert sentinel.asked > 0 and "Traceback" not in log, (answer, log)
        said = [line for line in log.splitlines() if line.startswith("gateway: broker ")]
        assert len(said) == 1, (answer, log)
        assert re.match(rf"gateway: broker sentinel 'mymaster' at {sentinel.address}: unreachable after 1 s", said[0]), (
            answer,
            said,
        )
        assert f"{sentinel.address} gave a malformed SENTINEL MASTERS answer" in said[0], (answer, said)


@pytest.mark.timeout(60)
def test_a_well_formed_answer_still_names_the_primary(tmp_path, fake_sentinel, redis_server) -> None:
    sentinel = fake_sentinel(
        b"*1\r\n"
        + master(
            name=bulk("mymaster"),
            ip=bulk("127.0.0.1"),
            port=bulk(str(redis_server.port)),
            flags=bulk("master"),
            num_other_sentinels=bulk("0"),
        )
    )
    node = sentinel_node(tmp_path / "gw", sentinel.address).start()
    try:
        published = node.publish("first.hour", {"n": 1})
        assert published.status_code == 200 and published.json()["seqs"] == [0], published.text
    finally:
        assert node.stop() == 0


@pytest.fixture
def taken_ports() -> Iterator[Callable[[], int]]:
    holders: list[socket.socket] = []

    def take() -> int:
        holder = socket.socket()  # no SO_REUSEPORT: the workers' SO_REUSEPORT sockets cannot share it
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        holders.append(holder)
        return holder.getsockname()[1]

    yield take
    for holder in holders:
        holder.close()


@pytest.mark.timeout(120)
def test_two_workers_and_a_port_in_use_end_with_one_line_and_status_2(tmp_path, redis_server, taken_ports) -> None:
    started = []
    for section, key in [("server", "port"), ("ingest", "port"), ("rawtcp", "sender_port")]:  # all at once
        taken_port = taken_ports()
        sections: dict[str, dict[str, object]] = {"server": {"workers": 2}}
        if section == "rawtcp":  # worker 0 alone binds it
            sections["rawtcp"] = {"enabled": True, "sender_port": 0, "receiver_port": 0}
        sections.setdefault(section, {})[key] = taken_port
        node = Node(tmp_path / f"{section}-{key}", redis_server.url, sections)
        node.start(wait=False)
        started.append((section, key, taken_port, node))
    for section, key, taken_port, node in started:
        case = f"{section}.{key}"
        assert node.proc is not None
        assert node.proc.wait(90) == 2, (case, node.log())
        log = node.log()
        assert "Traceback" not in log, (case, log)
        said = [line for line in log.splitlines() if f"port {taken_port} " in line]
        assert said and all(re.match(rf"gateway worker [01]: port {taken_port} \(", line) for line in said), (case, log)
        assert f"{section}.{key}, GATEWAY_{section.upper()}_{key.upper()}" in said[0] and "in use" in said[0], said
        assert re.search(r"^gateway: worker [01] \(pid \d+\) ended during start-up with status 2", log, re.M), (case, log)

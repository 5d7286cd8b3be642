"""The load tool's count of a server's TCP data segments, over real loopback sockets and `ss`."""

from __future__ import annotations

import socket
import time

from loadtest import segments


def test_counts_the_data_segments_each_socket_sent_since_the_first_read() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        accepted = [server.accept()[0] for _ in clients]
        opened = clients + accepted
        try:
            for conn in accepted:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            accepted[0].sendall(b"before")
            before = segments.read(port)
            assert before is not None and sum(before.values()) == 1
            for i, conn in enumerate(accepted):
                clients[i].sendall(b"the other direction is not counted")
                for _ in range(i + 1):
                    conn.sendall(b"x" * 10)
                    time.sleep(0.01)  # one segment each, whatever the kernel would merge
            # a socket that opens after the first read counts in full
            opened.append(socket.create_connection(("127.0.0.1", port)))
            late_peer = server.accept()[0]
            opened.append(late_peer)
            late_peer.sendall(b"late")
            time.sleep(0.05)
            after = segments.read(port)
            assert segments.sent_between(before, after) == 1 + 2 + 3 + 1
        finally:
            for sock in opened:
                sock.close()


def test_unknown_when_either_read_failed() -> None:
    assert segments.sent_between(None, {"a": 1}) is None and segments.sent_between({}, None) is None
    table = (
        "0 0 127.0.0.1:80 127.0.0.1:5000\n\t cubic segs_out:9 data_segs_out:7 lastsnd:1\n"
        "0 0 127.0.0.1:80 127.0.0.1:5001\n\t cubic segs_out:1 lastsnd:1\n"
    )
    assert segments.parse(table) == {"127.0.0.1:5000": 7}

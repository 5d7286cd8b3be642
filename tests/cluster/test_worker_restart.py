"""Workers survive each other (`server.workers` = 2, docs/cluster.md §5): a worker that dies (here: kill -9)
is forked again with the same index while its sibling keeps serving its clients; the new one serves within
2 s on the same ports (worker 0 with the raw TCP ports), the ready file is not rewritten, SIGTERM still
drains every worker with exit 0 (and cancels a restart still waiting), and a worker that keeps dying is
restarted after growing delays until the fifth death in a row ends the gateway with status 1."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.sync.client import connect

from tests.cluster.cluster_helpers import Node, messages, subscribe

RAW = {"enabled": True, "sender_port": 0, "receiver_port": 0}


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _node_pid(client: dict[str, Any]) -> int:
    return int(str(client["node"]).rsplit("-", 1)[1])  # a node id is INSTANCE-PID (gateway/broker/redis_broker.py)


def _clients_on_each_worker(node: Node, stack: contextlib.ExitStack, least: int = 2) -> dict[int, list[Any]]:
    """WebSocket clients subscribed to `news`, at least `least` on each worker: {worker pid: [ws, ...]}. Which
    worker holds a client: `GET /api/clients` (every node's, each with its node id) and a probe topic each."""
    probes: dict[str, Any] = {}
    on: dict[int, list[Any]] = {}
    for _ in range(6):
        for _ in range(6):
            ws = stack.enter_context(node.ws())
            probe = f"probe.{len(probes)}"
            subscribe(ws, "news")
            subscribe(ws, probe)
            probes[probe] = ws
        deadline = time.monotonic() + 5
        while True:
            listed = node.api("/clients")["clients"]
            where = {sub: _node_pid(c) for c in listed for sub in c["subscriptions"] if sub.startswith("probe.")}
            if len(where) == len(probes) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        on = {}
        for probe, ws in probes.items():
            on.setdefault(where[probe], []).append(ws)
        if len(on) == 2 and all(len(v) >= least for v in on.values()):
            return on
    raise AssertionError(f"the clients did not spread over both workers: { ({k: len(v) for k, v in on.items()}) }")


def _wait_serving(node: Node, index: int, old_pid: int, since: float, timeout: float = 10.0) -> tuple[int, float]:
    """(pid, seconds since `since`) once worker `index` answers /readyz 200 from a pid other than `old_pid`.
    Each try is a new connection, which the kernel gives to either worker."""
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            reply = httpx.get(f"{node.http_url}/readyz", timeout=1)
            body = reply.json()
            if reply.status_code == 200 and body["worker"] == index and body["pid"] != old_pid:
                return int(body["pid"]), time.monotonic() - since
        assert node.proc is not None
        assert node.proc.poll() is None, f"the gateway ended with {node.proc.returncode}: {node.log()[-3000:]}"
        assert time.monotonic() - since < timeout, f"worker {index} did not serve again: {node.log()[-3000:]}"
        time.sleep(0.02)


def _got(data: dict[str, Any]):
    return lambda entries: any(e["type"] == "msg" and e.get("data") == data for e in entries)


def _cut(ws: Any) -> None:
    with pytest.raises(ConnectionClosed):
        for _ in range(100):
            ws.recv(timeout=5)


def _raw_carries(info: dict[str, Any], rx: socket.socket | None = None) -> None:
    """Bytes written to the raw TCP sender port reach a receiver (`rx`, or a new one)."""
    own = rx is None
    if rx is None:
        rx = socket.create_connection(("127.0.0.1", info["raw_receiver_port"]), timeout=5)
    try:
        with socket.create_connection(("127.0.0.1", info["raw_sender_port"]), timeout=5) as tx:
            rx.settimeout(0.1)
            deadline = time.monotonic() + 5
            while True:  # until the receiver is registered (its accept may come after the sender's)
                tx.sendall(b"x" * 64)
                with contextlib.suppress(TimeoutError):
                    if rx.recv(4096):
                        return
                assert time.monotonic() < deadline, "the raw TCP receiver got nothing"
    finally:
        if own:
            rx.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_worker_is_forked_again_and_its_siblings_clients_are_not_cut(nodes, victim: int) -> None:
    node = nodes.start("w", server={"workers": 2}, rawtcp=RAW)
    assert node.proc is not None
    ready = node.workdir / "ready.json"
    ready_text, ready_mtime = ready.read_text(), ready.stat().st_mtime_ns
    pids = node.info["workers"]
    old, survivor = pids[victim], pids[1 - victim]
    with contextlib.ExitStack() as stack:
        on = _clients_on_each_worker(node, stack)
        rx = stack.enter_context(socket.create_connection(("127.0.0.1", node.info["raw_receiver_port"]), 5))
        _raw_carries(node.info, rx)
        os.kill(old, signal.SIGKILL)
        killed_at = time.monotonic()
        new, took = _wait_serving(node, victim, old, killed_at)
        print(f"\nworker {victim} killed (-9): serving again as pid {new} after {took:.2f} s")
        assert took < 2.0, took
        # the sibling's clients were not cut: a publish made after the kill reaches every one of them
        assert node.publish("news", {"after": "kill"}).status_code == 200
        for ws in on[survivor]:
            messages(ws, "news", _got({"after": "kill"}))
        for ws in on[old]:  # the dead worker's own clients were cut (they reconnect and recover with since)
            _cut(ws)
        # new clients land on the new worker too, and it delivers
        fresh: list[Any] = []
        deadline = time.monotonic() + 10
        while not any(_node_pid(c) == new for c in node.api("/clients")["clients"]):
            assert time.monotonic() < deadline, "no new client landed on the restarted worker"
            ws = stack.enter_context(node.ws())
            subscribe(ws, "news")
            fresh.append(ws)
        assert node.publish("news", {"after": "restart"}).status_code == 200
        for ws in fresh + on[survivor]:
            messages(ws, "news", _got({"after": "restart"}))
        # the raw TCP broadcaster is worker 0's: restarted with it on the same ports, else never cut
        if victim == 0:
            with pytest.raises(OSError):
                rx.settimeout(5)
                if not rx.recv(4096):
                    raise ConnectionResetError("closed")
            _raw_carries(node.info)
        else:
            _raw_carries(node.info, rx)
    assert node.proc.poll() is None
    assert (ready.read_text(), ready.stat().st_mtime_ns) == (ready_text, ready_mtime)  # written once
    deadline = time.monotonic() + 5  # the supervisor tells it when it next looks (every 50 ms; later when busy)
    while not re.search(rf"^gateway: worker {victim} serving again \(pid {new}\)", log := node.log(), re.M):
        assert time.monotonic() < deadline, log
        time.sleep(0.05)
    assert re.search(rf"^gateway: worker {victim} \(pid {old}\) killed by SIGKILL.*: restarting it now$", log, re.M), log
    assert node.stop() == 0


@pytest.mark.timeout(90)
def test_sigterm_after_a_restart_drains_every_worker_and_exits_0(nodes) -> None:
    node = nodes.start("w", server={"workers": 2, "log_level": "info", "drain_timeout_s": 5.0, "drain_spread_s": 2.0})
    assert node.proc is not None
    old = node.info["workers"][1]
    os.kill(old, signal.SIGKILL)
    new, _took = _wait_serving(node, 1, old, time.monotonic())
    with contextlib.ExitStack() as stack:
        on = _clients_on_each_worker(node, stack)
        assert set(on) == {node.info["workers"][0], new}
        node.proc.send_signal(signal.SIGTERM)
        for ws in [ws for clients in on.values() for ws in clients]:
            with contextlib.suppress(ConnectionClosed):
                while True:
                    ws.recv(timeout=10)
            assert ws.close_code == 1012, (ws.close_code, ws.close_reason)
        assert node.proc.wait(15) == 0, node.log()[-3000:]
    log = node.log()
    assert log.count("drained in") == 2, log[-3000:]  # worker 0, and worker 1's second process
    assert len(re.findall(r"^gateway: worker \d \(pid \d+\)", log, re.M)) == 1, log  # the one kill, no other


@pytest.mark.timeout(90)
def test_sigterm_while_a_restart_waits_cancels_it_and_drains_the_rest_with_0(nodes) -> None:
    node = nodes.start("w", server={"workers": 2})
    assert node.proc is not None
    keep, old = node.info["workers"]
    os.kill(old, signal.SIGKILL)
    new, _took = _wait_serving(node, 1, old, time.monotonic())
    os.kill(new, signal.SIGKILL)  # a second death within 30 s of its start: the next fork waits 0.5 s
    time.sleep(0.1)
    node.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while node.proc.poll() is None:
        assert not set(_children(node.proc.pid)) - {keep, old, new}, "a worker was forked during the stop"
        assert time.monotonic() < deadline, node.log()[-3000:]
        time.sleep(0.02)
    assert node.proc.returncode == 0, node.log()[-3000:]
    log = node.log()
    assert re.search(rf"^gateway: worker 1 \(pid {new}\) killed by SIGKILL.*: restarting it in 0\.5 s$", log, re.M), log
    assert log.count("gateway: worker 1 serving again") == 1, log


@pytest.mark.timeout(90)
def test_a_worker_that_keeps_dying_is_restarted_after_growing_delays_then_the_gateway_ends_with_1(nodes) -> None:
    """Worker 1 killed, then each new process killed before it listens: forks after 0, 0.5, 1, 2 and 4 s,
    and the fifth restart in a row that dies before it listened ends the gateway (worker 0 drains): 1."""
    node = nodes.start("w", server={"workers": 2})
    assert node.proc is not None
    supervisor = node.proc.pid
    keep, victim = node.info["workers"]
    seen = {keep, victim}
    gaps = []
    with node.ws() as ws:
        subscribe(ws, "news")
        cpu_before = _cpu_s(supervisor)
        for death in range(6):
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            if death == 5:
                cpu = _cpu_s(supervisor) - cpu_before
                break
            while not (new := set(_children(supervisor)) - seen):
                assert time.monotonic() - killed_at < 10, node.log()[-3000:]
                time.sleep(0.005)
            gaps.append(time.monotonic() - killed_at)
            [victim] = new
            seen.add(victim)
        assert node.proc.wait(15) == 1, node.log()[-3000:]
        with contextlib.suppress(ConnectionClosed):
            while True:
                ws.recv(timeout=5)
        # on worker 0 the client was drained (1012) as the gateway stopped; on worker 1 the kill cut it
        assert ws.close_code in (1012, 1006), ws.close_code
    print(f"\nrestart delays after deaths 1-5: {[round(g, 2) for g in gaps]} s; supervisor CPU over them {cpu:.3f} s")
    for gap, delay in zip(gaps, (0.0, 0.5, 1.0, 2.0, 4.0), strict=True):
        assert delay - 0.05 <= gap < delay + 0.7, gaps
    assert cpu < 0.5, cpu  # waiting, not spinning
    log = node.log()
    deaths = re.findall(r"^gateway: worker 1 \(pid \d+\) killed by SIGKILL.*$", log, re.M)
    assert len(deaths) == 6, log
    assert [d.rsplit(": ", 1)[1] for d in deaths] == [
        "restarting it now",
        "restarting it in 0.5 s",
        "restarting it in 1 s",
        "restarting it in 2 s",
        "restarting it in 4 s",
        "stopping the gateway",
    ], deaths
    assert "before it listened" not in deaths[0], deaths
    in_a_row = [re.search(r"\((\d) of 5 in a row\)", d) for d in deaths[1:]]
    assert [m.group(1) if m else None for m in in_a_row] == ["1", "2", "3", "4", "5"], deaths


def _fresh(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """One request on a new connection, which the kernel gives to either worker."""
    return httpx.request(method, url, timeout=15, **kwargs)


def _session_of(node: Node, owner: int) -> str:
    """A new long-poll session made by worker `owner` (its secret starts `w{owner}.`)."""
    for _ in range(40):
        secret = str(_fresh("POST", f"{node.http_url}/lp").json()["session"])
        if secret.startswith(f"w{owner}."):
            return secret
        assert _fresh("DELETE", f"{node.http_url}/lp/{secret}").status_code == 204
    raise AssertionError(f"no session made by worker {owner}")


@pytest.mark.timeout(90)
def test_the_restarted_worker_is_reached_through_its_inbox_and_a_dead_one_fails_at_once(nodes) -> None:
    """The sibling forwards to the new process over the inbox it held before (the supervisor kept the other
    end); while worker 1 is dead (here the 0.5 s before its second restart), a forward to it fails at once."""
    node = nodes.start("w", server={"workers": 2}, longpoll={"poll_timeout_s": 2.0})
    old = node.info["workers"][1]
    gone = _session_of(node, 1)
    os.kill(old, signal.SIGKILL)
    first, _took = _wait_serving(node, 1, old, time.monotonic())
    os.kill(first, signal.SIGKILL)  # the next fork waits 0.5 s: every connection goes to worker 0 meanwhile
    time.sleep(0.05)
    started = time.monotonic()
    failed = []
    while time.monotonic() - started < 0.3:
        asked = time.monotonic()
        reply = _fresh("GET", f"{node.http_url}/lp/{gone}")
        failed.append((reply.status_code, reply.json()["error"]["code"], time.monotonic() - asked))
    assert all(status == 500 and code == "internal_error" and took < 0.5 for status, code, took in failed), failed
    second, _took = _wait_serving(node, 1, first, time.monotonic())
    secret = _session_of(node, 1)
    url = f"{node.http_url}/lp/{secret}"
    # 12 requests on fresh connections: those the kernel gives worker 0 are forwarded to the new worker 1
    for i in range(12):
        reply = _fresh("POST", url, json=[{"op": "ping", "id": f"p{i}"}])
        assert reply.status_code == 202, (i, reply.status_code, reply.text)
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while not {f"p{i}" for i in range(12)} <= {e.get("id") for e in got}:
        assert time.monotonic() < deadline, got
        body = _fresh("GET", url).json()
        got += body["entries"]
        if body["batch"] is not None:
            got += _fresh("GET", url, params={"ack": body["batch"]}).json()["entries"]
    for _ in range(4):  # the dead process's session is gone, whichever worker is asked
        reply = _fresh("GET", f"{node.http_url}/lp/{gone}")
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "unknown_session", reply.text
    assert second != first and node.proc is not None and node.proc.poll() is None


def _ws_from(node: Node, source: str) -> Any:
    """A WebSocket client whose address is `source` (another loopback address: its own per-address count)."""
    sock = socket.create_connection(("127.0.0.1", node.info["http_port"]), timeout=5, source_address=(source, 0))
    return connect(node.ws_url, sock=sock, open_timeout=5, max_size=None, compression=None)


def _refused(node: Node, source: str) -> bool:
    """A WebSocket from `source` is refused (503 before the handshake, or closed), not served (a ping answered)."""
    try:
        with _ws_from(node, source) as ws:
            ws.send('{"op": "ping", "id": 1}')
            ws.recv(timeout=5)
    except (WebSocketException, ConnectionError):
        return True
    # websockets' sync client fails its own `assert self.close_deadline is None` when the server closes the
    # socket under its handshake (EBADF in its reader): closed, so refused
    except AssertionError:
        return True
    return False


@pytest.mark.timeout(90)
def test_a_dead_workers_per_address_counts_go_with_it(nodes) -> None:
    """`server.max_connections_per_ip` counts across the workers (gateway/edge/addrcount.py): the connections
    of a dead worker no longer count once it died, so its clients can come back up to the limit, not beyond."""
    limit, source = 3, "127.0.0.2"
    node = nodes.start("w", server={"workers": 2, "max_connections_per_ip": limit})
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(_ws_from(node, source)) for _ in range(limit)]
        for i, ws in enumerate(clients):
            subscribe(ws, f"probe.{i}")
        assert _refused(node, source)  # the limit holds across the workers
        listed = node.api("/clients")["clients"]
        on: dict[int, int] = {}
        for client in listed:
            on[_node_pid(client)] = on.get(_node_pid(client), 0) + 1
        assert sum(on.values()) == limit, listed
        victim_pid = max(on, key=lambda pid: on[pid])
        victim = node.info["workers"].index(victim_pid)
        os.kill(victim_pid, signal.SIGKILL)
        _wait_serving(node, victim, victim_pid, time.monotonic())
        for _ in range(on[victim_pid]):  # as many as the dead worker held come back
            ws = stack.enter_context(_ws_from(node, source))
            ws.send('{"op": "ping", "id": 1}')
            ws.recv(timeout=5)
        assert _refused(node, source)  # and no more

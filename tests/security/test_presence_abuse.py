"""Join/leave under attack (issue 34, items 1 and 3): one anonymous client toggling its subscription of a
`join_leave` room costs the room's members nothing, and members dropped for overflowing their direct queue
while joins are announced leave every count and table exact. Real gateway, real WebSocket clients."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
from websockets.exceptions import ConnectionClosed

from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, collect, send, wait_for, ws_connect

RULES = {
    "rules": [
        {"pattern": "room.*", "anonymous": True, "presence": True, "join_leave": True},
        {"pattern": "*", "anonymous": True},
    ]
}


def subscribed(ws, topic: str) -> None:
    send(ws, op="subscribe", topic=topic, id=f"s-{topic}")
    collect(ws, lambda g: any(e["type"] == "subscribed" and e["topic"] == topic for e in g))


@pytest.mark.parametrize("rate_limited", [False, True], ids=["coalescing", "with_the_rate_limit"])
def test_a_client_toggling_its_subscription_costs_the_members_nothing(rate_limited):
    # without the rate limit, coalescing alone: each frame leaves the attacker as it was (not a member), so
    # its changes cancel out within the cycle; with it (the defaults), a refused unsubscribe may leave it a
    # member for a while: at most a change per token of the bucket
    limits = {} if rate_limited else {"subscribe_rate": 1e6, "subscribe_burst": 10**6}
    with run_gateway(topics=RULES, limits=limits) as gw, web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http:
        with contextlib.ExitStack() as stack:
            members = [stack.enter_context(ws_connect(gw)) for _ in range(6)]
            for ws in members:
                subscribed(ws, "room.busy")
            toggles = json.dumps([{"op": op, "topic": "room.busy"} for _ in range(50) for op in ("subscribe", "unsubscribe")])
            seen = {i: [] for i in range(len(members))}
            closed = {}
            stop = threading.Event()

            def read(i, ws):  # a member reading 20 frames a second
                try:
                    while not stop.is_set():
                        try:
                            seen[i] += json.loads(ws.recv(timeout=0.2))
                        except TimeoutError:
                            pass
                        time.sleep(0.05)
                except ConnectionClosed as exc:
                    closed[i] = exc.rcvd.code if exc.rcvd else None

            readers = [threading.Thread(target=read, args=(i, ws)) for i, ws in enumerate(members)]
            for thread in readers:
                thread.start()
            with ws_connect(gw) as attacker:
                send(attacker, op="rpc", method="whoami", id="who")
                got = collect(attacker, lambda g: any(e.get("id") == "who" for e in g))
                attacker_id = next(e for e in got if e.get("id") == "who")["result"]["client_id"]
                started = time.monotonic()
                deadline = started + 1.5  # hundreds of frames of 100 changes each: far past the bucket
                frames = 0
                while time.monotonic() < deadline:
                    attacker.send(toggles)
                    frames += 1
                    while True:  # its own answers (acks, rate-limit errors): it reads them, so it stays
                        try:
                            attacker.recv(timeout=0.01)
                        except TimeoutError:
                            break
                # data published after the storm reaches every member promptly
                published = time.monotonic()
                assert http.post("/api/topics/room.busy/publish", json={"data": "after"}).status_code == 200
                wait_for(
                    lambda: all(any(e.get("data") == "after" for e in got) for got in seen.values()) or closed,
                    "the message after the storm",
                    timeout=10,
                )
                latency = time.monotonic() - published
            stop.set()
            for thread in readers:
                thread.join(5)
            assert closed == {}
            churn = [sum(e["type"] in ("join", "leave") and e["client"] == attacker_id for e in got) for got in seen.values()]
            config = gw.hub.config.limits
            bound = config.subscribe_burst + config.subscribe_rate * (time.monotonic() - started) if rate_limited else 0
            assert max(churn) <= bound, (churn, frames)
            assert latency < 2.0, latency


def test_members_dropped_while_joins_are_announced_leave_every_table_exact():
    # members that stopped reading (their sockets full of bulk data) overflow their direct queues of 20
    # while 30 clients join: each is dropped (4009), and their own leaves are announced in turn
    with (
        run_gateway(topics=RULES, scheduler={"direct_queue_max": 20}, websocket={"socket_send_buffer": 4096}) as gw,
        web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http,
    ):
        with contextlib.ExitStack() as stack:
            stalled = [stack.enter_context(ws_connect(gw, rcvbuf=4096, max_queue=1)) for _ in range(12)]
            joiners = []
            for ws in stalled:
                subscribed(ws, "room.r")
                subscribed(ws, "bulk.b")
            bulk = "x" * 20_000
            for _ in range(20):
                assert http.post("/api/topics/bulk.b/publish", json={"data": bulk}).status_code == 200
            wait_for(lambda: gw.call(lambda: len(gw.hub.scheduler.blocked)) == len(stalled), "stalled members")
            for _ in range(30):  # one a flush (join/leave entries go out every 100 ms, changes together)
                ws = stack.enter_context(ws_connect(gw))
                joiners.append(ws)
                subscribed(ws, "room.r")
                time.sleep(0.12)
            wait_for(
                lambda: gw.call(lambda: gw.hub.clients.disconnects[("ws", "direct_queue_full")]) == len(stalled),
                "every stalled member dropped",
            )
            for ws in stalled:  # dropped by the gateway, their reader blocked: no close handshake to wait 1 s each for
                ws.close_timeout = 0.05
            for ws in joiners:  # every joiner is still served
                send(ws, op="ping", id="p")
                collect(ws, lambda g: any(e.get("id") == "p" for e in g))

            def tables():
                hub = gw.hub
                return (
                    len(hub.clients.conns),
                    len(hub.scheduler.engine.clients()),
                    hub.clients.by_transport["ws"],
                    sum(hub.clients.clients_by_ip.values()),
                )

            assert gw.call(tables) == (30, 30, 30, 30)
            assert gw.call(lambda: gw.hub.gc.open) == 30  # every arrival's departure was counted
            presence = http.get("/api/topics/room.r/presence").json()
            assert presence["clients"] == 30

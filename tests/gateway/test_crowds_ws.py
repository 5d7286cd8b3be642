"""Caught-up `/ws` clients on plain TCP go in the crowds the engine gathers (docs/architecture.md, "The fan-out
writer"): one frame per crowd written to every socket, no per-client Python. Counted by `/metrics`
`fanout_gathered_writes`; the unit-level twin is tests/core/test_crowds.py."""

from __future__ import annotations

import contextlib
import time

from websockets.sync.client import connect

from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import auth, collect, metric, send, ws_connect

CLIENTS = 12
MESSAGES = 10


def test_caught_up_ws_clients_plain_and_compressed_go_in_the_engines_crowds() -> None:
    with run_gateway() as gw, contextlib.ExitStack() as stack:
        # half offer permessage-deflate: their frames (over compression_min_bytes) are another crowd's
        clients = [stack.enter_context(ws_connect(gw)) for _ in range(CLIENTS // 2)]
        clients += [
            stack.enter_context(connect(gw.ws_url, open_timeout=5, max_size=None, compression="deflate"))
            for _ in range(CLIENTS // 2)
        ]
        for ws in clients:
            send(ws, op="subscribe", topic="crowd", id=1)
            collect(ws, lambda got: any(e["type"] == "subscribed" for e in got))
        before = metric(gw, "fanout_gathered_writes_total")
        for n in range(MESSAGES):  # one at a time: each client's batch is that one message
            reply = web.post(
                f"{gw.http_url}/api/topics/crowd/publish", json={"data": f"{n}:" + "x" * 2000}, headers=auth(gw), trust_env=False
            )
            assert reply.status_code == 200, reply.text
            time.sleep(0.01)
        for ws in clients:
            got = collect(ws, lambda got: sum(e["type"] == "msg" for e in got) >= MESSAGES)
            assert [e["data"] for e in got if e["type"] == "msg"] == [f"{n}:" + "x" * 2000 for n in range(MESSAGES)]
        # most deliveries went in crowds (a publication caught mid-cycle may give a client two: handed out)
        assert metric(gw, "fanout_gathered_writes_total") - before >= CLIENTS * MESSAGES // 2

"""The /ws handshake the protocol answers itself keeps nothing of the request once the connection is open."""

import contextlib
import gc
import types

from gateway.testing import run_gateway
from tests.gateway.gw_helpers import collect, send, ws_connect


def test_an_open_connection_holds_no_handshake_request():
    with run_gateway() as gw, contextlib.ExitStack() as stack:
        clients = [stack.enter_context(ws_connect(gw)) for _ in range(5)]
        for ws in clients:
            send(ws, op="ping", id=1)
            assert any(e.get("result") == "pong" for e in collect(ws, lambda got: got))

        # websockets' request parser keeps the request (~2 KiB with its headers) as a local for as long as
        # it runs: the connection drops it with the handshake's protocol after the 101 (a cycle, garbage for
        # the young collection). The clients of this process hold their own requests: count the server's.
        def held() -> int:
            gc.collect()
            return sum(
                isinstance(o, types.GeneratorType) and o.gi_code.co_qualname == "ServerProtocol.parse" for o in gc.get_objects()
            )

        assert gw.call(held) == 0
        assert len(gw.hub.clients.conns) == 5

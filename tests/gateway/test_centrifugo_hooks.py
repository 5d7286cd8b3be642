"""Centrifugo's client protocol with the backend's hooks (docs/integration.md, docs/centrifugo.md): the connect
hook awaited with the commands sent behind `connect` run after it, in order; its server-side topic in the
connect result's `subs` (its recovery: test_centrifugo_server_subs.py); a refusal as close 3507 (no
reconnect); rpc through the rpc hook, its refusal as the reply's error."""

from __future__ import annotations

import json

from centrifuge.exceptions import ReplyError  # type: ignore[import-untyped]

from gateway.testing import run_gateway
from tests.gateway.hook_backend import Backend
from tests.gateway.test_centrifugo_client import PATH, Events, client, closed_with, raw, run, until
from tests.gateway.test_proxy_hooks import proxy_config

RULES = {"rules": [{"pattern": "*", "kind": "ring", "anonymous": True, "client_publish": True}]}


def test_the_connect_hook_then_the_commands_behind_it_in_order(app: Backend):
    app.answers["connect"] = {"user": "alice", "topics": ["granted.a"]}
    app.delays["connect"] = 0.2
    with run_gateway(proxy=proxy_config(app), topics=RULES) as gw, raw(gw) as ws:
        ws.send(
            json.dumps({"id": 1, "connect": {}})
            + "\n"
            + json.dumps({"id": 2, "subscribe": {"channel": "t"}})
            + "\n"
            + json.dumps({"id": 3, "rpc": {"method": "whoami"}})
        )
        got: list[dict] = []
        while len(got) < 3:
            got += [json.loads(line) for line in ws.recv(timeout=5).split("\n")]
        assert got[0]["id"] == 1 and "connect" in got[0]  # first, with the server-side subscription
        assert got[0]["connect"]["subs"] == {
            "granted.a": {
                "recoverable": True,
                "positioned": True,
                "epoch": got[0]["connect"]["subs"]["granted.a"]["epoch"],
                "offset": 0,
            }
        }
        assert not any("push" in reply for reply in got)  # not pushed again
        answers = {reply["id"]: reply for reply in got if "id" in reply}
        assert "subscribe" in answers[2]
        assert answers[3]["rpc"]["data"]["user"] == "alice"  # ran after the hook made the connection alice's


def test_a_refusal_of_the_connect_hook_is_final(app: Backend):
    app.answers["connect"] = {"error": {"code": 1, "message": "who are you?"}}
    with run_gateway(proxy=proxy_config(app), topics=RULES) as gw:
        with raw(gw) as ws:
            ws.send(json.dumps({"id": 1, "connect": {}}))
            assert closed_with(ws) == 3507

        async def main() -> None:
            events = Events()
            c = client(f"ws://127.0.0.1:{gw.http_port}{PATH}", events)
            await c.connect()
            await until(lambda: events.disconnected, "disconnected")
            assert [d.code for d in events.disconnected] == [3507] and len(events.connecting) == 1

        run(main())


def test_rpc_through_the_hook(app: Backend):
    app.answers["rpc"] = lambda body: (
        {"result": {"got": body["params"]}} if body["method"] == "add" else {"error": {"code": 404, "message": "no such thing"}}
    )
    with run_gateway(proxy=proxy_config(app, connect_url=""), topics=RULES) as gw:

        async def main() -> None:
            c = client(f"ws://127.0.0.1:{gw.http_port}{PATH}")
            await c.connect()
            assert (await c.rpc("add", {"a": 1})).data == {"got": {"a": 1}}
            try:
                await c.rpc("other", None)
            except ReplyError as exc:
                assert (exc.code, exc.message) == (404, "no such thing")
            else:
                raise AssertionError("refused")
            await c.disconnect()

        run(main())

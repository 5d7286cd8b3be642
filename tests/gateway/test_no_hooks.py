"""The backend hooks as one interface (gateway/hooks/base.py): `NoHooks`, the null object a hub holds without any
hook URL, satisfies `Hooks` and allows everything at once; with a hook URL the hub holds the HTTP hooks."""

from __future__ import annotations

import asyncio

import pytest

from gateway.auth.identity import ClientIdentity
from gateway.config import load_config
from gateway.hooks.backend import HttpHooks
from gateway.hooks.base import Allowed, Hooks, NoHooks, PublishAnswer
from gateway.hub import Hub
from gateway.testing import DEFAULTS

pytestmark = pytest.mark.unit


def test_no_hooks_is_a_hooks_that_asks_nothing() -> None:
    hooks: Hooks = NoHooks()  # mypy checks the protocol here
    identity = ClientIdentity("c1", "ws", ip="127.0.0.1")
    assert not hooks.wants_connect(identity)
    assert not (hooks.asks_subscribe or hooks.asks_publish or hooks.answers_rpc or hooks.refreshes)
    hooks.disconnected(identity, "closed")
    hooks.unsubscribed(identity, "news")
    assert hooks.pending("disconnect") == 0
    assert list(hooks.collect()) == []
    assert hooks.body(identity, topic="news") == {"client": "c1", "user": None, "transport": "ws", "topic": "news"}

    async def asked() -> None:
        assert await hooks.connect(identity, lambda name: []) == ()  # no server-side subscription granted
        assert identity.principal is None  # admitted as it came
        assert await hooks.call("subscribe", {}, Allowed) == Allowed()
        assert await hooks.call("publish", {}, PublishAnswer) == PublishAnswer()  # the data kept
        await hooks.aclose()

    asyncio.run(asked())


def _hub(**proxy: str) -> Hub:
    return Hub(load_config(overrides={**DEFAULTS, "proxy": proxy}, environ={}))


def test_a_hub_without_hook_urls_holds_no_hooks_and_one_with_them_the_http_hooks() -> None:
    assert isinstance(_hub().hooks, NoHooks)
    assert isinstance(_hub().clients.hooks, NoHooks)
    hooks = _hub(rpc_url="http://127.0.0.1:9/rpc").hooks
    assert isinstance(hooks, HttpHooks)
    assert hooks.answers_rpc and not (hooks.asks_subscribe or hooks.asks_publish or hooks.refreshes)

"""A real gateway for tests and tools: `with run_gateway(**overrides) as gw: ...`.

It runs in a thread with its own event loop, on ephemeral loopback ports, and is stopped on exit.
Overrides are config sections, e.g. `run_gateway(longpoll={"poll_timeout_s": 1})`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .config import load_config
from .hub import Hub
from .server import RunningGateway, start_gateway

TEST_TOKEN = "test-token"
#: HS256 secret of the test gateways' subscriber tokens (`make_token`)
TEST_JWT_SECRET = "test-jwt-secret-of-at-least-32-bytes!"
DEFAULTS = {
    "server": {"host": "127.0.0.1", "port": 0, "admin_token": TEST_TOKEN, "log_level": "warning"},
    "auth": {"jwt_secret": TEST_JWT_SECRET},
    "ingest": {"port": 0},
    "rawtcp": {"enabled": False, "sender_port": 0, "receiver_port": 0},
}


def make_token(sub: str, *, ttl: float = 3600.0, secret: str = TEST_JWT_SECRET, **claims: Any) -> str:
    """An HS256 subscriber token for `sub`, expiring in `ttl` seconds (at least: `exp` is whole seconds,
    rounded up), with extra claims. The default hour outlasts the suite, for tokens made at collection."""
    import math
    import time

    import jwt

    return jwt.encode({"sub": sub, "exp": math.ceil(time.time() + ttl), **claims}, secret, algorithm="HS256")


@dataclass
class GatewayHandle:
    running: RunningGateway
    loop: asyncio.AbstractEventLoop

    @property
    def http_port(self) -> int:
        return self.running.http_port

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.running.http_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.running.http_port}/ws"

    @property
    def ingest_port(self) -> int:
        return self.running.ingest_port

    @property
    def raw_sender_port(self) -> int:
        return self.running.raw_sender_port

    @property
    def raw_receiver_port(self) -> int:
        return self.running.raw_receiver_port

    @property
    def admin_token(self) -> str:
        return self.running.admin_token

    @property
    def hub(self) -> Hub:
        return self.running.hub

    def client_of(self, user: str) -> str:
        """The client id of the (one) connection authenticated as `user`."""
        client: str = self.call(lambda: next(c for c, conn in self.hub.clients.conns.items() if conn.identity.user == user))
        return client

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the gateway's loop (the hub is not thread-safe) and return its result."""

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@contextlib.contextmanager
def run_gateway(**overrides: Any) -> Iterator[GatewayHandle]:
    config = load_config(overrides=_merge(DEFAULTS, overrides), environ={})
    started: concurrent.futures.Future[GatewayHandle] = concurrent.futures.Future()
    stop_event: list[asyncio.Event] = []

    async def main() -> None:
        try:
            running = await start_gateway(config)
        except BaseException as exc:
            started.set_exception(exc)
            return
        event = asyncio.Event()
        stop_event.append(event)
        started.set_result(GatewayHandle(running, asyncio.get_running_loop()))
        await event.wait()
        await running.stop()

    def thread_main() -> None:
        try:
            import uvloop

            uvloop.run(main())
        except ImportError:
            asyncio.run(main())

    thread = threading.Thread(target=thread_main, name="gateway", daemon=True)
    thread.start()
    handle = started.result(timeout=30)
    try:
        yield handle
    finally:
        handle.loop.call_soon_threadsafe(stop_event[0].set)
        thread.join(timeout=15)

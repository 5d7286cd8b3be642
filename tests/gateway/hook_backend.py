"""A real backend for the hook tests (test_proxy_hooks.py, test_command_order.py, test_hook_bounds_commands.py,
test_tracing.py, the security and cluster hook tests): a Starlette app served by uvicorn on loopback,
recording what it receives, with switchable answers and delays."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.gateway.gw_helpers import wait_for

HOOKS = ("connect", "subscribe", "publish", "rpc", "refresh", "disconnect", "unsubscribe")


class Backend:
    """POST /HOOK records the body and answers `answers[HOOK]` (a dict, or a function of the body), after
    `delays[HOOK]` seconds."""

    def __init__(self) -> None:
        self.received: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.answers: dict[str, Any] = {}
        self.delays: dict[str, float] = {}
        self.port = 0
        app = Starlette(routes=[Route("/{hook}", self.handle, methods=["POST"])])
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", backlog=4096)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def handle(self, request: Request) -> JSONResponse:
        hook = request.path_params["hook"]
        body = orjson.loads(await request.body())
        self.received[hook].append(body)
        delay = self.delays.get(hook, 0)
        if delay:
            await asyncio.sleep(delay)
        answer = self.answers.get(hook, {})
        return JSONResponse(answer(body) if callable(answer) else answer)

    def url(self, hook: str) -> str:
        return f"http://127.0.0.1:{self.port}/{hook}"

    def reset(self) -> None:
        self.received.clear()
        self.answers.clear()
        self.delays.clear()

    def proxy(self, *hooks: str, **more: Any) -> dict[str, Any]:
        """A `[proxy]` section with these hooks (all when none is named) pointing here."""
        return {**{f"{hook}_url": self.url(hook) for hook in hooks or HOOKS}, **more}

    def start(self) -> None:
        self.thread.start()
        wait_for(lambda: self.server.started, "the backend to start")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def running_backend() -> Iterator[Backend]:
    """The body of a fixture: a started backend, stopped after."""
    server = Backend()
    server.start()
    yield server
    server.stop()

"""What a `Client` writes (fanout_client/client.py): the commands of one loop turn go in one frame (at most
MAX_COMMANDS a frame), the acks of a turn one per topic; and the background tasks that write them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

log = logging.getLogger("fanout_client")

#: commands per frame (docs/protocol.md: at most 100)
MAX_COMMANDS = 100


class Outgoing:
    """The commands waiting for the current connection's next frame, and the tasks writing them."""

    __slots__ = ("_connection", "wire", "_flushing", "lock", "tasks")

    def __init__(self, connection: Callable[[], ClientConnection | None]) -> None:
        #: the current connection (None between two)
        self._connection = connection
        self.wire: list[dict[str, Any]] = []
        self._flushing = False
        #: one writer at a time (made by `start`, on the client's loop)
        self.lock: asyncio.Lock | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self.lock = asyncio.Lock()

    def ack_soon(self, topic: str, seq: int) -> None:
        """Acknowledge a private topic up to ``seq``: the acks of one loop turn go in one frame, one per topic."""
        for command in self.wire:
            if command.get("op") == "ack" and command.get("topic") == topic:
                command["seq"] = max(command["seq"], seq)
                return
        self.send_soon({"op": "ack", "topic": topic, "seq": seq})

    def send_soon(self, command: dict[str, Any]) -> None:
        """Queue a command for the current connection: the commands of one loop turn share one frame."""
        self.wire.append(command)
        if not self._flushing:
            self._flushing = True
            self.spawn(self._flush())

    async def _flush(self) -> None:
        assert self.lock is not None
        async with self.lock:
            self._flushing = False
            commands, self.wire = self.wire, []
            ws = self._connection()
            if ws is not None and commands:
                await self.write(ws, commands)

    async def write(self, ws: ClientConnection, commands: list[dict[str, Any]]) -> None:
        for i in range(0, len(commands), MAX_COMMANDS):
            chunk = commands[i : i + MAX_COMMANDS]
            try:
                await ws.send(orjson.dumps(chunk[0] if len(chunk) == 1 else chunk), text=True)
            except ConnectionClosed:
                return  # the reader sees the close; the requests sent fail with `disconnected`

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("fanout_client: a background task failed", exc_info=task.exception())

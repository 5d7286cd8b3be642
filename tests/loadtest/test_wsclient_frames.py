"""The load tool's WebSocket client against a real socket whose server cuts frames anywhere.

The server is websockets' own sans-I/O ``ServerProtocol`` behind a plain asyncio server on 127.0.0.1,
writing its bytes in small pieces, so every frame header and payload is split over several reads of the
client: the client's own frame cutter (``WsClient._split``) must give exactly the messages websockets sent,
answer a ping, and report the server's close.
"""

from __future__ import annotations

import asyncio

from websockets.frames import Frame, Opcode
from websockets.server import ServerProtocol

from loadtest.wsclient import WsClient, connect

MESSAGES = [b"a", b"x" * 125, b"y" * 126, b"z" * 65_535, b"w" * 70_000, "\u00e9t\u00e9".encode()]
PIECE = 7


class Collect:
    def __init__(self) -> None:
        self.messages: list[bytes] = []
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def ws_open(self) -> None:
        pass

    def ws_messages(self, messages: list[bytes], now_ns: int) -> None:
        self.messages += messages

    def ws_closed(self, reason: str) -> None:
        if not self.closed.done():
            self.closed.set_result(reason)


class Server(asyncio.Protocol):
    """Accepts one client, then sends MESSAGES (one fragmented), a ping, and a close, in 7-byte writes."""

    def __init__(self, pongs: asyncio.Queue[bytes]) -> None:
        self.protocol = ServerProtocol()
        self.pongs = pongs
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.protocol.receive_data(data)
        for event in self.protocol.events_received():
            if isinstance(event, Frame):
                if event.opcode is Opcode.PONG:
                    self.pongs.put_nowait(event.data)  # type: ignore[arg-type]
            else:  # the handshake request
                self.protocol.send_response(self.protocol.accept(event))  # type: ignore[arg-type]  # only a server's first event is a Request
                self.transport.write(b"".join(self.protocol.data_to_send()))  # type: ignore[union-attr]
                asyncio.get_running_loop().create_task(self.send_all())

    async def send_all(self) -> None:
        p = self.protocol
        for message in MESSAGES[:-1]:
            p.send_binary(message)
        p.send_text(MESSAGES[-1][:2], fin=False)
        p.send_ping(b"are you there")
        p.send_continuation(MESSAGES[-1][2:], fin=True)
        stream = b"".join(p.data_to_send())
        for start in range(0, len(stream), PIECE):
            self.transport.write(stream[start : start + PIECE])  # type: ignore[union-attr]
            if start % (PIECE * 50) == 0:
                await asyncio.sleep(0)  # let the client read a piece at a time
        await asyncio.sleep(0.05)
        p.send_close(1001, "going away")
        self.transport.write(b"".join(p.data_to_send()))  # type: ignore[union-attr]


async def run() -> tuple[list[bytes], str, bytes, bool]:
    pongs: asyncio.Queue[bytes] = asyncio.Queue()
    server = await asyncio.get_running_loop().create_server(lambda: Server(pongs), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    collect = Collect()
    client: WsClient = await connect("127.0.0.1", port, "/ws", collect)
    reason = await asyncio.wait_for(collect.closed, 10)
    pong = await asyncio.wait_for(pongs.get(), 10)
    direct = client._direct
    client.close()
    server.close()
    await server.wait_closed()
    return collect.messages, reason, pong, direct


def test_frames_cut_anywhere_give_the_messages_sent() -> None:
    messages, reason, pong, direct = asyncio.run(run())
    assert messages == MESSAGES
    assert pong == b"are you there"
    assert reason == "close 1001 going away"
    assert direct  # the data frames went through the client's own cutter, not websockets'

"""A stand-in gateway for testing the load generator itself, not a reference implementation.

It speaks just enough of docs/protocol.md (WebSocket /ws, long-poll /lp, TCP ingest with sync, admin
publish) and of the CLI contract (``serve --config FILE --ready-file PATH``) for a load run to go end to
end. Each client has one bounded queue; a message that does not fit is dropped and announced with a
``loss`` entry (reason ``lagged``) before the client's next message on that topic.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import sys
import tomllib

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

QUEUE_LIMIT = 500
BATCH_LIMIT = 200
POLL_TIMEOUT = 2.0


class Client:
    def __init__(self) -> None:
        self.pending: list[bytes] = []
        self.lost: dict[str, list[int]] = {}  # topic -> [from, to)
        self.wake = asyncio.Event()
        self.batch = 0

    def push(self, topic: str, seq: int, entry: bytes) -> None:
        if len(self.pending) >= QUEUE_LIMIT:
            span = self.lost.setdefault(topic, [seq, seq])
            span[1] = seq + 1
            return
        if topic in self.lost:
            start, end = self.lost.pop(topic)
            self.pending.append(orjson.dumps({"type": "loss", "topic": topic, "from": start, "to": end,
                                              "reason": "lagged"}))
        self.pending.append(entry)
        self.wake.set()

    def direct(self, entry: dict) -> None:
        self.pending.append(orjson.dumps(entry))
        self.wake.set()

    def take(self) -> list[bytes]:
        out, self.pending = self.pending[:BATCH_LIMIT], self.pending[BATCH_LIMIT:]
        if not self.pending:
            self.wake.clear()
        return out


class Hub:
    def __init__(self) -> None:
        self.seq: dict[str, int] = {}
        self.subscribers: dict[str, set[Client]] = {}
        self.sessions: dict[str, Client] = {}
        self.ids = itertools.count(1)

    def publish(self, topic: str, data: object) -> int:
        seq = self.seq.get(topic, 0)
        self.seq[topic] = seq + 1
        entry = orjson.dumps({"type": "msg", "topic": topic, "seq": seq, "data": data})
        for client in self.subscribers.get(topic, ()):
            client.push(topic, seq, entry)
        return seq

    def command(self, client: Client, cmd: object) -> None:
        for c in cmd if isinstance(cmd, list) else [cmd]:
            if isinstance(c, dict) and c.get("op") == "subscribe":
                topic = c["topic"]
                self.subscribers.setdefault(topic, set()).add(client)
                client.direct({"type": "subscribed", "topic": topic, "kind": "ring", "epoch": "fake-1",
                               "seq": self.seq.get(topic, 0), "id": c.get("id")})
            else:
                client.direct({"type": "error", "code": "bad_command", "message": "fake"})

    def drop(self, client: Client) -> None:
        for subs in self.subscribers.values():
            subs.discard(client)


def make_app(hub: Hub, token: str) -> Starlette:
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        client = Client()

        async def reader() -> None:
            while True:
                hub.command(client, orjson.loads(await websocket.receive_text()))

        task = asyncio.create_task(reader())
        try:
            while not task.done():
                await client.wake.wait()
                batch = client.take()
                if batch:
                    await websocket.send_text((b"[" + b",".join(batch) + b"]").decode())
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            task.cancel()
            hub.drop(client)

    async def lp_open(request: Request) -> Response:
        sid = f"s{next(hub.ids)}"
        hub.sessions[sid] = Client()
        return JSONResponse({"session": sid})

    async def lp_session(request: Request) -> Response:
        client = hub.sessions.get(request.path_params["sid"])
        if client is None:
            return JSONResponse({"error": "gone"}, status_code=404)
        if request.method == "POST":
            hub.command(client, orjson.loads(await request.body()))
            return JSONResponse({"ok": True})
        try:
            await asyncio.wait_for(client.wake.wait(), POLL_TIMEOUT)
        except asyncio.TimeoutError:
            pass
        client.batch += 1
        entries = client.take()
        return Response(b'{"batch":%d,"entries":[%s]}' % (client.batch, b",".join(entries)),
                        media_type="application/json")

    async def admin_publish(request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {token}":
            return JSONResponse({"error": "forbidden"}, status_code=403)
        body = orjson.loads(await request.body())
        messages = body["messages"] if "messages" in body else [body["data"]]
        seqs = [hub.publish(request.path_params["name"], m) for m in messages]
        return JSONResponse({"seq": seqs[-1]})

    return Starlette(routes=[
        WebSocketRoute("/ws", ws),
        Route("/lp", lp_open, methods=["POST"]),
        Route("/lp/{sid}", lp_session, methods=["GET", "POST"]),
        Route("/api/topics/{name}/publish", admin_publish, methods=["POST"]),
    ])


async def ingest(hub: Hub, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    accepted = 0
    while line := await reader.readline():
        record = orjson.loads(line)
        if "sync" in record:
            writer.write(orjson.dumps({"type": "synced", "id": record["sync"], "accepted": accepted,
                                       "refused": 0}) + b"\n")
            accepted = 0
            await writer.drain()
        else:
            hub.publish(record["topic"], record["data"])
            accepted += 1
    writer.close()


async def serve(config_path: str, ready_path: str) -> None:
    with open(config_path, "rb") as f:
        config = tomllib.load(f)
    token = config["server"]["admin_token"]
    hub = Hub()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # accepted sockets inherit it: without it uvicorn's separate head and body writes meet the
    # client's delayed ACK and every long-poll answer takes 40 ms more
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.listen(2048)
    ingest_server = await asyncio.start_server(lambda r, w: ingest(hub, r, w), "127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(make_app(hub, token), log_level="warning", ws="websockets-sansio"))
    ready = {"http_port": sock.getsockname()[1], "ingest_port": ingest_server.sockets[0].getsockname()[1],
             "raw_sender_port": 0, "raw_receiver_port": 0, "admin_token": token}
    with open(ready_path, "w") as f:
        json.dump(ready, f)
    await server.serve(sockets=[sock])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--config", required=True)
    parser.add_argument("--ready-file", required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.config, args.ready_file))


if __name__ == "__main__":
    sys.exit(main())

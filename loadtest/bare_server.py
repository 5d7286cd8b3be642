"""The bare reference server: the fastest fan-out plain Python can do, to measure the gateway against.

    python -m loadtest.bare_server --port 0 --ingest-port 0 --ready-file PATH [--batch N]

A uvloop ``asyncio.Protocol`` server that speaks the subset of the gateway's protocol the load tool uses
(docs/loadtest.md, "The bare reference server"), and nothing more:

* WebSocket on ``/ws`` (websockets' sans-I/O ``ServerProtocol`` answers the handshake and parses client
  frames, pings and closes); text frames of commands ``{"op":"subscribe","topic":T}`` (one or an array)
  are answered ``[{"type":"subscribed","topic":T,"kind":"ring","epoch":E,"seq":S,"id":ID}]``, ``S`` being
  the topic's next seq; ``unsubscribe`` is answered ``unsubscribed``; any other command is an ``error`` entry.
* TCP ingest, NDJSON: ``{"topic":T,"data":D}`` publishes (seqs from 0 per topic), ``{"sync":ID}`` is
  answered ``{"type":"synced","id":ID,"accepted":A,"refused":R}`` (counts since the previous sync), an
  ``{"auth":...}`` first line ``{"type":"authed"}`` (any token), anything else an ``error`` line.

Fan-out: the records of one ingest read are the pending messages. Each message's entry is encoded once
(orjson); each topic's pending entries go out in frames of up to ``--batch`` entries (a JSON array, as the
gateway sends), each frame built once (header + payload) and written to every subscriber of the topic in
one tight loop, one ``transport.write`` per subscriber per frame.

This is a reference, not a product: there is no scheduler, no fairness between topics or clients, no
history, no loss notice, no bound. A client that does not read grows its transport buffer without limit
(the transport's flow control is ignored), and a busy topic delays every other one.

:class:`BareServer` runs it as a subprocess for the load tool (``--target bare``, ``python -m loadtest
baseline``), like ``loadtest.gatewayproc.GatewayProcess``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import orjson
from websockets.frames import Frame, Opcode
from websockets.http11 import Request
from websockets.server import ServerProtocol

from gateway.wsframes import text_frame_header
from loadtest.serverproc import ServerProcess

HOST = "127.0.0.1"
WS_PATH = "/ws"
#: largest client frame accepted (commands are small)
MAX_CLIENT_MESSAGE = 1 << 20
STARTUP_TIMEOUT = 15.0
STOP_TIMEOUT = 2.0


def text_frame(payload: bytes) -> bytes:
    return text_frame_header(len(payload)) + payload


class Topic:
    __slots__ = ("name", "prefix", "next_seq", "subscribers")

    def __init__(self, name: str) -> None:
        self.name = name
        #: the constant start of every msg entry of this topic
        self.prefix = b'{"type":"msg","topic":%s,"seq":' % orjson.dumps(name)
        self.next_seq = 0
        #: insertion-ordered set of subscribed connections
        self.subscribers: dict[WsConnection, None] = {}


class BareServer(ServerProcess):
    """The server's state (topics) and the fan-out; also what starts and stops the subprocess for the load
    tool: ``with BareServer(workdir, batch) as target:`` (output in ``workdir/bare.log``)."""

    stop_timeout = STOP_TIMEOUT  # then SIGKILL (ServerProcess.stop_signals)

    def __init__(self, workdir: Path | None = None, batch: int = 1) -> None:
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self.workdir = Path(workdir) if workdir is not None else None
        self.batch = batch
        self.topics: dict[str, Topic] = {}
        self.epoch = f"bare-{os.getpid()}-{int(time.time())}"
        self.proc: subprocess.Popen[bytes] | None = None

    # -- the server (in the subprocess) -------------------------------------------------------------------

    def topic(self, name: str) -> Topic:
        topic = self.topics.get(name)
        if topic is None:
            topic = self.topics[name] = Topic(name)
        return topic

    def publish(self, pending: dict[Topic, list[bytes]]) -> None:
        """Write the pending entries of each topic to its subscribers, ``batch`` entries per frame."""
        step = self.batch
        for topic, entries in pending.items():
            subscribers = topic.subscribers
            if not subscribers:
                continue
            for i in range(0, len(entries), step):
                payload = b"[" + b",".join(entries[i : i + step]) + b"]"
                frame = text_frame_header(len(payload)) + payload
                for conn in subscribers:
                    conn.transport.write(frame)

    # -- the subprocess (in the load tool) ----------------------------------------------------------------

    def start(self) -> Any:  # -> loadtest.target.Target
        from loadtest.procstat import raise_nofile_limit
        from loadtest.target import Target

        if self.workdir is None:
            raise ValueError("BareServer needs a workdir to run as a subprocess")
        self.workdir.mkdir(parents=True, exist_ok=True)
        ready = self.workdir / "bare.ready.json"
        ready.unlink(missing_ok=True)
        log = open(self.workdir / "bare.log", "ab")
        raise_nofile_limit()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loadtest.bare_server",
                "--port",
                "0",
                "--ingest-port",
                "0",
                "--ready-file",
                str(ready),
                "--batch",
                str(self.batch),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=raise_nofile_limit,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.workdir / "bare.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"bare server exited with {self.proc.returncode} before it was ready:\n{tail}")
            if ready.exists():
                info = json.loads(ready.read_text())  # written whole: renamed into place
                return Target("bare", HOST, int(info["http_port"]), int(info["ingest_port"]), None, self.proc.pid)
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"bare server not ready after {STARTUP_TIMEOUT} s (see {self.workdir}/bare.log)")


class WsConnection(asyncio.Protocol):
    """One WebSocket client: the handshake and its commands through websockets' sans-I/O protocol; the
    fan-out writes frames to ``transport`` directly."""

    transport: asyncio.Transport

    def __init__(self, server: BareServer) -> None:
        self.server = server
        self.protocol = ServerProtocol(max_size=MAX_CLIENT_MESSAGE)
        self.topics: list[Topic] = []
        self.open = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        protocol = self.protocol
        protocol.receive_data(data)
        for event in protocol.events_received():
            if type(event) is Frame:
                if event.opcode is Opcode.TEXT and self.open:
                    self.commands(event.data)
            elif isinstance(event, Request):
                if event.path.partition("?")[0] == WS_PATH:
                    response = protocol.accept(event)
                else:
                    response = protocol.reject(404, f"the bare server serves only {WS_PATH}\n")
                protocol.send_response(response)
                self.open = response.status_code == 101
        self.flush()

    def flush(self) -> None:
        """Write what the sans-I/O protocol has to send (handshake, pongs, close); b"" means close TCP."""
        for chunk in self.protocol.data_to_send():
            if chunk:
                self.transport.write(chunk)
            else:
                self.leave()  # no fan-out write between this close and connection_lost
                self.transport.close()

    def eof_received(self) -> bool | None:
        self.protocol.receive_eof()
        self.flush()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.leave()

    def leave(self) -> None:
        for topic in self.topics:
            topic.subscribers.pop(self, None)
        self.topics = []
        self.open = False

    def commands(self, payload: bytes | bytearray | memoryview) -> None:
        try:
            commands = orjson.loads(payload)
        except orjson.JSONDecodeError:
            commands = None
        if type(commands) is not list:
            commands = [commands]
        server = self.server
        answers: list[dict[str, Any]] = []
        for command in commands:
            op = command.get("op") if type(command) is dict else None
            name = command.get("topic") if type(command) is dict else None
            ident = command.get("id") if type(command) is dict else None
            if op in ("subscribe", "unsubscribe") and type(name) is str and name:
                topic = server.topic(name)
                if op == "subscribe":
                    if self not in topic.subscribers:
                        topic.subscribers[self] = None
                        self.topics.append(topic)
                    answers.append(
                        {
                            "type": "subscribed",
                            "topic": name,
                            "kind": "ring",
                            "epoch": server.epoch,
                            "seq": topic.next_seq,
                            "id": ident,
                        }
                    )
                else:
                    if topic.subscribers.pop(self, 0) is None:
                        self.topics.remove(topic)
                    answers.append({"type": "unsubscribed", "topic": name, "id": ident})
            else:
                answers.append(
                    {
                        "type": "error",
                        "code": "bad_command",
                        "id": ident,
                        "message": "the bare server knows only subscribe and unsubscribe {op, topic}",
                    }
                )
        self.transport.write(text_frame(orjson.dumps(answers)))


class BareIngestProtocol(asyncio.Protocol):
    """One publisher on the TCP ingest: NDJSON records in, answers (authed, synced, error lines) out."""

    transport: asyncio.Transport

    def __init__(self, server: BareServer) -> None:
        self.server = server
        self.buffer = b""
        self.line = 0
        self.accepted = 0
        self.refused = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        server = self.server
        pending: dict[Topic, list[bytes]] = {}
        answers: list[bytes] = []
        loads, dumps = orjson.loads, orjson.dumps
        for line in lines:
            self.line += 1
            try:
                record = loads(line)
            except orjson.JSONDecodeError:
                record = None
            if type(record) is dict:
                name = record.get("topic")
                if type(name) is str and name and "data" in record and len(record) == 2:
                    topic = server.topic(name)
                    seq = topic.next_seq
                    topic.next_seq = seq + 1
                    pending.setdefault(topic, []).append(b'%s%d,"data":%s}' % (topic.prefix, seq, dumps(record["data"])))
                    self.accepted += 1
                    continue
                if "sync" in record and len(record) == 1:
                    server.publish(pending)  # everything before the sync is out before its answer
                    pending = {}
                    answers.append(
                        dumps({"type": "synced", "id": record["sync"], "accepted": self.accepted, "refused": self.refused})
                        + b"\n"
                    )
                    self.accepted = self.refused = 0
                    continue
                if "auth" in record and len(record) == 1 and self.line == 1:
                    answers.append(b'{"type":"authed"}\n')
                    continue
            self.refused += 1
            answers.append(
                dumps(
                    {
                        "type": "error",
                        "line": self.line,
                        "code": "bad_record",
                        "message": "the bare server takes {topic, data}, {sync} and a first {auth}",
                    }
                )
                + b"\n"
            )
        server.publish(pending)
        if answers:
            self.transport.write(b"".join(answers))


async def serve(host: str, port: int, ingest_port: int, ready_file: Path | None, batch: int) -> None:
    loop = asyncio.get_running_loop()
    server = BareServer(batch=batch)
    ws = await loop.create_server(lambda: WsConnection(server), host, port, backlog=4096)
    ingest = await loop.create_server(lambda: BareIngestProtocol(server), host, ingest_port, backlog=128)
    info = {
        "http_port": ws.sockets[0].getsockname()[1],
        "ingest_port": ingest.sockets[0].getsockname()[1],
        "pid": os.getpid(),
        "batch": batch,
    }
    if ready_file is not None:
        partial = ready_file.with_name(ready_file.name + ".tmp")
        partial.write_text(json.dumps(info))
        partial.replace(ready_file)
    print(f"bare server: ws {host}:{info['http_port']}{WS_PATH}, ingest {host}:{info['ingest_port']}, batch {batch}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    ws.close()
    ingest.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bare_server", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default=HOST)
    parser.add_argument("--port", type=int, default=0, help="WebSocket port (0: ephemeral)")
    parser.add_argument("--ingest-port", type=int, default=0, help="TCP ingest port (0: ephemeral)")
    parser.add_argument(
        "--ready-file", type=Path, help='written as JSON {"http_port", "ingest_port", "pid", "batch"} once listening'
    )
    parser.add_argument("--batch", type=int, default=1, help="most messages of a topic per frame (default 1)")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error("--batch must be >= 1")
    from loadtest.aio import run_loop
    from loadtest.procstat import raise_nofile_limit

    raise_nofile_limit()
    run_loop(serve(args.host, args.port, args.ingest_port, args.ready_file, args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())

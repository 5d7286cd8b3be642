"""IngestProtocolDouble: a TEST DOUBLE of the gateway's TCP ingest line protocol (docs/protocol.md).

It is not the gateway: no topics config, no reorder window, no fan-out. It implements only what a producer
can observe on an ingest connection, so the pipeline's sink can be tested before (and independently of) the
real gateway:

* one JSON record per line; ``seq`` given: refused with ``duplicate_seq`` when that (topic, seq) already
  landed; ``seq`` absent: the next seq after the topic's highest is assigned;
* ``{"sync": ID}`` answered ``{"type":"synced","id":ID,"accepted":A,"refused":R}`` (counts since the previous
  sync); errors answered ``{"type":"error","line":N,"code":C,"message":M}`` with N the 1-based line number on
  the connection (sync lines count);
* faults on demand: ``refuse(topic, seq) -> code | None`` refuses records with another code, ``answer_syncs``
  False never answers a sync, ``close_after_lines`` closes the connection after that many lines,
  ``close_first_after_lines`` only the first connection (a gateway restart, as its producer sees it).

Every accepted record is kept in arrival order with the connection it came on, for assertions.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Landed:
    connection: int
    topic: str
    seq: int
    data: object


@dataclass
class IngestProtocolDouble:
    refuse: Callable[[str, int | None], str | None] | None = None
    answer_syncs: bool = True
    close_after_lines: int | None = None
    close_first_after_lines: int | None = None

    landed: list[Landed] = field(default_factory=list)
    refused: list[tuple[str, int | None, str]] = field(default_factory=list)
    connections: int = 0
    syncs: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._seqs: dict[str, set[int]] = {}
        self._server: socketserver.ThreadingTCPServer | None = None

    # -- lifecycle --------------------------------------------------------------------------------------
    def __enter__(self) -> IngestProtocolDouble:
        double = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    double._serve(self.connection, self.rfile)
                except (ConnectionResetError, BrokenPipeError):
                    pass  # the producer hung up (a failing test task): nothing to answer

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        # shutdown() waits for the loop's next poll: 0.05 s, not the default 0.5 s, at every test's end
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.server_address[1]

    # -- views for assertions ---------------------------------------------------------------------------
    def seqs_by_topic(self) -> dict[str, list[int]]:
        """Accepted seqs of each topic in arrival order."""
        out: dict[str, list[int]] = {}
        for rec in self.landed:
            out.setdefault(rec.topic, []).append(rec.seq)
        return out

    def max_displacement(self) -> int:
        """Largest ``highest seq already landed - seq`` over arrivals: how far behind a higher seq a record
        came in, i.e. the reorder window a gateway needs to put this arrival order back in order."""
        highest: dict[str, int] = {}
        worst = 0
        for rec in self.landed:
            top = highest.get(rec.topic, -1)
            worst = max(worst, top - rec.seq)
            highest[rec.topic] = max(top, rec.seq)
        return worst

    # -- the protocol -----------------------------------------------------------------------------------
    def _serve(self, sock: socket.socket, rfile) -> None:
        with self._lock:
            self.connections += 1
            connection = self.connections
        line_no = accepted = refused = 0
        for raw in rfile:
            line_no += 1
            answer = self._line(connection, line_no, raw)
            if answer is None:
                accepted += 1
            elif answer.get("type") == "sync":
                if self.answer_syncs:
                    synced = {"type": "synced", "id": answer["id"], "accepted": accepted, "refused": refused}
                    with self._lock:
                        self.syncs.append(synced)
                    sock.sendall(json.dumps(synced).encode() + b"\n")
                accepted = refused = 0
            else:
                refused += 1
                sock.sendall(json.dumps(answer).encode() + b"\n")
            if self.close_after_lines is not None and line_no >= self.close_after_lines:
                return
            if connection == 1 and self.close_first_after_lines is not None and line_no >= self.close_first_after_lines:
                return

    def _line(self, connection: int, line_no: int, raw: bytes) -> dict | None:
        """None when a record was accepted; a sync marker; or the error answer."""

        def error(code: str, message: str) -> dict:
            return {"type": "error", "line": line_no, "code": code, "message": message}

        try:
            obj = json.loads(raw)
        except ValueError as exc:
            return error("bad_json", str(exc))
        if not isinstance(obj, dict):
            return error("bad_command", "not an object")
        if "sync" in obj:
            return {"type": "sync", "id": obj["sync"]}
        topic, seq = obj.get("topic"), obj.get("seq")
        if not isinstance(topic, str) or "data" not in obj:
            return error("bad_command", "a record needs topic and data")
        if self.refuse is not None and (code := self.refuse(topic, seq)) is not None:
            with self._lock:
                self.refused.append((topic, seq, code))
            return error(code, f"refused by the test double: {topic}")
        with self._lock:
            seen = self._seqs.setdefault(topic, set())
            if seq is None:
                seq = max(seen, default=-1) + 1
            elif seq in seen:
                self.refused.append((topic, seq, "duplicate_seq"))
                return error("duplicate_seq", f"{topic} seq {seq} is already present")
            seen.add(seq)
            self.landed.append(Landed(connection, topic, seq, obj["data"]))
        return None

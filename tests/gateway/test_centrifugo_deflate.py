"""permessage-deflate at /connection/websocket (docs/protocol.md, "WebSocket"; gateway/transports/ws_centrifugo.py)
with a real gateway: negotiated as on `/ws` for either codec (and declined when `websocket.compression` is off),
publications of a large payload reaching several centrifuge-python clients of both codecs intact, compressed
once per codec whatever the number of clients; on a bare socket, RSV1 set on large frames (text for JSON,
binary for Protobuf) and clear on small ones, compressed commands inflated; a deflate bomb refused with 1009
while another client reads on; and centrifuge-js under Node (whose `ws` offers deflate) reading a large
publication."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.sync.client import connect
from websockets.typing import Subprotocol

from gateway.testing import run_gateway
from tests.gateway.test_centrifugo_client import PATH, SubEvents, client, fresh, publish, run, subscribed, until
from tests.gateway.test_centrifugo_client_units import replies_of
from tests.gateway.test_centrifugo_js import JS
from tests.gateway.test_ws_deflate import RawClient, compressed, inflate, metric

pytestmark = pytest.mark.timeout(60)

RULES = {"rules": [{"pattern": "*", "kind": "ring", "capacity": 64, "anonymous": True}]}
#: a publication far above `websocket.compression_min_bytes` that compresses well
BOOK = {"bids": [[10000 - i, 100 + i] for i in range(40)], "asks": [[10001 + i, 200 + i] for i in range(40)]}
JSON, PROTOBUF = Subprotocol("centrifuge-json"), Subprotocol("centrifuge-protobuf")


class CentrifugoRaw(RawClient):
    """A bare-socket client of /connection/websocket (test_ws_deflate.py's reader of frames as sent)."""

    def __init__(self, gw: Any, subprotocol: str, extensions: str | None) -> None:
        super().__init__(gw, extensions, path=PATH, subprotocol=subprotocol)

    def message(self) -> tuple[int, bytes]:
        """(first byte, payload inflated when RSV1 is set) of the next frame."""
        first, payload = self.frame()
        return first, inflate(payload) if first & 0x40 else payload


def json_pushes(raw: CentrifugoRaw, until_id: int) -> list[dict[str, Any]]:
    """The JSON replies and pushes read up to the reply of command `until_id`."""
    seen: list[dict[str, Any]] = []
    while not any(reply.get("id") == until_id for reply in seen):
        first, payload = raw.message()
        assert first & 0x0F == 0x1, first
        seen += [json.loads(line) for line in payload.split(b"\n")]
    return seen


def pb_command(command_id: int, field: int, body: bytes) -> bytes:
    """One varint-delimited Protobuf `Command` (id, then the method's field), all parts under 128 bytes."""
    command = b"\x08" + bytes((command_id,)) + bytes(((field << 3) | 2, len(body))) + body
    return bytes((len(command),)) + command


@pytest.fixture(scope="module")
def gw() -> Iterator[Any]:
    """One gateway of RULES for the module: each test on channels of its own (metrics compared as differences)."""
    with run_gateway(topics=RULES) as handle:
        yield handle


def test_negotiated_for_either_codec_as_on_ws_and_off_declines_it(gw) -> None:
    for subprotocol in (JSON, PROTOBUF):
        with connect(
            f"ws://127.0.0.1:{gw.http_port}{PATH}", subprotocols=[subprotocol], compression="deflate", open_timeout=5
        ) as ws:
            assert ws.response is not None
            answer = ws.response.headers["Sec-WebSocket-Extensions"]
            assert answer.startswith("permessage-deflate") and "server_no_context_takeover" in answer
            assert "client_no_context_takeover" in answer
            assert [type(e).__name__ for e in ws.protocol.extensions] == ["PerMessageDeflate"]
            assert ws.subprotocol == subprotocol
    with connect(f"ws://127.0.0.1:{gw.http_port}{PATH}", subprotocols=[JSON], compression=None, open_timeout=5) as ws:
        assert ws.response is not None and "Sec-WebSocket-Extensions" not in ws.response.headers
    with run_gateway(topics=RULES, websocket={"compression": "off"}) as off:
        with connect(f"ws://127.0.0.1:{off.http_port}{PATH}", subprotocols=[JSON], compression="deflate", open_timeout=5) as ws:
            assert ws.response is not None and "Sec-WebSocket-Extensions" not in ws.response.headers
            assert not ws.protocol.extensions
            ws.send(json.dumps({"id": 1, "connect": {}}))
            assert "connect" in json.loads(ws.recv(timeout=5))


def test_sdk_clients_of_both_codecs_get_large_publications_compressed_once_per_codec(gw) -> None:
    channel = fresh("books")
    books = [{**BOOK, "n": n} for n in range(3)]

    async def main() -> None:
        url = f"ws://127.0.0.1:{gw.http_port}{PATH}"
        clients = [client(url) for _ in range(3)] + [client(url, use_protobuf=True) for _ in range(2)]
        events = [SubEvents() for _ in clients]
        for c, seen in zip(clients, events, strict=True):
            sub = c.new_subscription(channel, seen)
            await c.connect()
            await sub.subscribe()
        await until(lambda: all(seen.subscribed for seen in events), "subscribed")
        # the counters are the process's: compared as differences (no other gateway runs meanwhile)
        before = [await asyncio.to_thread(metric, gw, name) for name in COUNTERS]
        for book in books:
            await asyncio.to_thread(publish, gw, channel, book)
        await until(lambda: all(len(seen.publications) == 3 for seen in events), "the books")
        for seen in events[:3]:
            assert seen.publications == [(n + 1, book) for n, book in enumerate(books)]
        for seen in events[3:]:  # Protobuf: data is the JSON text
            assert [(offset, json.loads(data)) for offset, data in seen.publications] == list(enumerate(books, 1))
        after = [await asyncio.to_thread(metric, gw, name) for name in COUNTERS]
        deflated, payload, wire = (now - was for now, was in zip(after, before, strict=True))
        assert deflated == 2 * len(books)  # once per book and codec, for the 3 JSON and the 2 Protobuf clients
        assert wire < payload / 2
        # a large answer to one client (not kept for others) is compressed too, and reads back
        echo = {"pad": "abc" * 500}
        assert (await clients[0].rpc("echo", echo)).data == echo
        assert json.loads((await clients[3].rpc("echo", json.dumps(echo).encode())).data) == echo
        for c in clients:
            await c.disconnect()

    run(main())


COUNTERS = ("fanout_ws_deflated_frames_total", "fanout_ws_payload_bytes_total", "fanout_ws_wire_bytes_total")


def test_large_frames_go_with_rsv1_small_ones_plain_and_compressed_commands_are_inflated(gw) -> None:
    channel = fresh("raw")
    text = CentrifugoRaw(gw, JSON, "permessage-deflate")
    assert "server_no_context_takeover" in text.answer["sec-websocket-extensions"]
    text.send(
        json.dumps({"id": 1, "connect": {}}).encode() + b"\n" + json.dumps({"id": 2, "subscribe": {"channel": channel}}).encode()
    )
    json_pushes(text, 2)
    binary = CentrifugoRaw(gw, PROTOBUF, "permessage-deflate")
    name = channel.encode()
    binary.send(pb_command(1, 4, b"") + pb_command(2, 5, b"\x0a" + bytes((len(name),)) + name), opcode=0x2)
    while not any(reply.id == 2 for reply in replies_of(binary.message()[1])):
        pass
    publish(gw, channel, BOOK)
    first, payload = text.frame()
    assert first == 0xC1  # FIN, RSV1, text
    assert json.loads(inflate(payload))["push"]["pub"]["data"] == BOOK
    first, payload = binary.frame()
    assert first == 0xC2  # FIN, RSV1, binary
    (reply,) = replies_of(inflate(payload))
    assert json.loads(reply.push.pub.data) == BOOK and reply.push.pub.offset == 1
    publish(gw, channel, {"p": 1})  # below compression_min_bytes: as it is, RSV1 clear
    first, payload = text.frame()
    assert first == 0x81 and json.loads(payload)["push"]["pub"]["data"] == {"p": 1}
    first, payload = binary.frame()
    assert first == 0x82 and replies_of(payload)[0].push.pub.offset == 2
    # a compressed command, answered compressed (its reply is large)
    command = {"id": 3, "rpc": {"method": "echo", "data": {"pad": "xyz" * 2000}}}
    text.send(compressed(json.dumps(command).encode()), compressed=True)
    first, payload = text.frame()
    assert first == 0xC1 and json.loads(inflate(payload)) == {"id": 3, "rpc": {"data": {"pad": "xyz" * 2000}}}
    text.close()
    binary.close()


def test_each_window_gets_its_own_compression(gw) -> None:
    """Two clients of one codec, one asking for a 1 KiB window: the same frame compressed once for each."""
    channel = fresh("window")
    narrow = CentrifugoRaw(gw, JSON, "permessage-deflate; server_max_window_bits=10")
    assert "server_max_window_bits=10" in narrow.answer["sec-websocket-extensions"]
    wide = CentrifugoRaw(gw, JSON, "permessage-deflate")
    for raw in (narrow, wide):
        raw.send(
            json.dumps({"id": 1, "connect": {}}).encode()
            + b"\n"
            + json.dumps({"id": 2, "subscribe": {"channel": channel}}).encode()
        )
        json_pushes(raw, 2)
    before = metric(gw, "fanout_ws_deflated_frames_total")
    block = os.urandom(1500).hex()  # repeated 3 KB apart: a 15-bit window's match a 10-bit one cannot read
    publish(gw, channel, {"a": block, "b": block})
    for raw, window in ((narrow, 10), (wide, 15)):
        first, payload = raw.frame()
        assert first == 0xC1
        assert json.loads(inflate(payload, window))["push"]["pub"]["data"] == {"a": block, "b": block}
    assert metric(gw, "fanout_ws_deflated_frames_total") == before + 2
    narrow.close()
    wide.close()


def test_a_deflate_bomb_gets_1009_and_another_client_reads_on(gw) -> None:
    channel = fresh("calm")

    async def main() -> None:
        c, events = await subscribed(gw, channel)

        def bomb() -> None:
            bomber = CentrifugoRaw(gw, JSON, "permessage-deflate")
            bomber.send(json.dumps({"id": 1, "connect": {}}).encode())
            json_pushes(bomber, 1)
            bomb = compressed(b'{"id":2,"rpc":{"method":"echo","data":"' + b"x" * (16 << 20) + b'"}}')
            assert len(bomb) < 60_000  # under websocket.max_frame_bytes on the wire, far over it inflated
            bomber.send(bomb, compressed=True)
            first, payload = bomber.frame()
            assert first == 0x88 and struct.unpack("!H", payload[:2])[0] == 1009
            bomber.close()

        await asyncio.to_thread(bomb)
        await asyncio.to_thread(publish, gw, channel, BOOK)
        await until(lambda: events.publications, "the publication")
        assert events.publications == [(1, BOOK)]
        await c.disconnect()

    run(main())


@pytest.mark.skipif(
    shutil.which("node") is None or not (JS / "node_modules" / "centrifuge").is_dir(),
    reason="node and tests/centrifugo_js/node_modules (make test installs them)",
)
@pytest.mark.parametrize("mode", ["--json", "--protobuf"])
def test_centrifuge_js_negotiates_deflate_and_reads_a_large_publication(gw, mode: str) -> None:
    before = metric(gw, "fanout_ws_deflated_frames_total")
    done = subprocess.run(
        ["node", "deflate.js", gw.http_url, gw.admin_token, fresh("js"), mode],
        cwd=JS,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["extensions"] == "permessage-deflate"  # `ws` names what was negotiated
    assert seen["publications"] == [[1, BOOK], [2, {"p": 1}]]
    assert metric(gw, "fanout_ws_deflated_frames_total") > before

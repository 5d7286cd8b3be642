"""``--protocol centrifugo``: a load client speaking Centrifugo's client protocol v2 (JSON) at the gateway's
`/connection/websocket` (docs/centrifugo.md), recorded like a `/ws` client.

One frame at the start carries `connect` and a `subscribe` per topic (as centrifuge-js sends them); each
frame the gateway sends is newline-delimited replies and pushes, which become the recorder's entries: a
subscribe reply is `subscribed` at its `offset` (the next seq), a publication push `msg` with seq = offset - 1,
an `unsubscribe` push (code 2500: the client fell behind the ring) a `loss` from the next seq it needed, with
no end. A ping (`{}`) is answered with `{}`. With ``--compression deflate`` it offers permessage-deflate,
as the SDKs do.
"""

from __future__ import annotations

from typing import Any

import orjson

from loadtest.worker import WsSubscriber
from loadtest.wsclient import connect

#: the gateway's Centrifugo endpoint (`centrifugo.path` as shipped)
PATH = "/connection/websocket"
PONG = b"{}"


class CentrifugoSubscriber(WsSubscriber):
    """A `WsSubscriber` over Centrifugo's protocol: the same plan, recorder and counters."""

    #: subscribe command id -> topic name (the replies carry the id only)
    asked: dict[int, str]

    async def start(self) -> None:
        spec = self.worker.spec
        self.asked = {}
        self.next_seqs: dict[str, int] = {}
        self.ws = await connect(
            spec.target.host,
            spec.target.http_port,
            PATH,
            self,
            timeout=spec.connect_timeout,
            source=self.source,
            compression=spec.compression == "deflate",
        )

    def subscribe(self) -> None:
        if self.ws is None:
            return
        commands: list[dict[str, Any]] = [{"id": 1, "connect": {"name": "fanout-loadtest"}}]
        for k, t in enumerate(self.plan.topics, 2):
            topic = self.worker.spec.topics[t]
            self.asked[k] = topic
            # positioned: the reply says where the stream starts (its offset), as the recorder needs
            commands.append({"id": k, "subscribe": {"channel": topic, "recoverable": True, "positioned": True}})
        self.ws.send_text(b"\n".join(orjson.dumps(command) for command in commands))

    def ws_messages(self, messages: list[bytes], now_ns: int) -> None:
        for body in messages:
            self.batch += 1
            entries = []
            for line in body.split(b"\n"):
                try:
                    reply = orjson.loads(line)
                except orjson.JSONDecodeError:
                    self.recorder.errors["bad_json"] += 1
                    continue
                entry = self._entry(reply) if type(reply) is dict else None
                if entry is not None:
                    entries.append(entry)
            if entries:
                self._got(entries, self.batch, now_ns)

    def _entry(self, reply: dict[str, Any]) -> dict[str, Any] | None:
        """The recorder's entry for one reply or push; None for what it does not record."""
        push = reply.get("push")
        if type(push) is dict:
            channel = str(push.get("channel"))
            pub = push.get("pub")
            if type(pub) is dict:
                offset = int(pub.get("offset", 0))
                self.next_seqs[channel] = offset
                return {"type": "msg", "topic": channel, "seq": offset - 1, "data": pub.get("data")}
            if "unsubscribe" in push:
                return {"type": "loss", "topic": channel, "from": self.next_seqs.get(channel, 0), "to": None, "reason": "lagged"}
            return None
        if not reply:  # the server's ping
            if self.ws is not None:
                self.ws.send_text(PONG)
            return None
        if "error" in reply:
            self.recorder.errors[f"centrifugo_{reply['error'].get('code')}"] += 1
            return None
        result = reply.get("subscribe")
        command_id = reply.get("id")
        topic = self.asked.get(command_id) if type(command_id) is int else None
        if type(result) is dict and topic is not None:
            offset = int(result.get("offset", 0))
            self.next_seqs[topic] = offset
            return {"type": "subscribed", "topic": topic, "kind": "ring", "epoch": result.get("epoch", ""), "seq": offset}
        return None

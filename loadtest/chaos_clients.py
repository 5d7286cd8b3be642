"""The clients, publishers and the faulty network path of a chaos run (loadtest/chaos.py).

Every client records, per topic, what it received (the events of loadtest/chaos_check.py, each with ``t``
its receive time) and how each of its connections ended (close codes). The raw clients (WebSocket, SSE,
long-poll) record the gateway's entries as they came; the fanout_client one records the library's events.
Each reconnects on its own, with ``since`` (SSE: the last ``id:``), to the next node in its list.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import socket
import struct
import time
from collections import defaultdict
from collections.abc import Collection
from typing import Any

import httpx
import orjson
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from fanout_client.events import Stream

from .aio import within

#: a client that hears nothing for this long drops its connection (publishers never pause that long)
SILENCE_S = 8.0


class Recorder:
    """What one client saw: ``events[topic]`` (chaos_check events) and ``closes`` [(t, code, reason)]."""

    def __init__(self, name: str, transport: str, user: str | None = None) -> None:
        self.name = name
        self.transport = transport
        self.user = user
        self.events: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.closes: list[tuple[float, int, str]] = []
        self.connects = 0

    def entries(self, entries: list[dict[str, Any]], streams: dict[str, Stream] | None = None) -> None:
        now = time.time()
        for e in entries:
            kind, topic = e.get("type"), e.get("topic")
            if not isinstance(topic, str):
                continue
            if kind == "subscribed":
                self.events[topic].append({"ev": "sub", "epoch": e["epoch"], "seq": e["seq"], "kind": e["kind"], "t": now})
                if streams is not None and topic in streams:
                    streams[topic].on_subscribed(e["kind"], e["epoch"], e["seq"])
            elif kind == "msg":
                self.events[topic].append({"ev": "msg", "seq": e["seq"], "data": e["data"], "t": now})
                if streams is not None and topic in streams:
                    streams[topic].on_msg(e["seq"], None)
            elif kind == "loss":
                self.events[topic].append({"ev": "loss", "from": e["from"], "to": e["to"], "reason": e["reason"], "t": now})
                if streams is not None and topic in streams:
                    streams[topic].on_loss(e["from"], e["to"], e["reason"])
            elif kind == "closed":
                self.events[topic].append({"ev": "closed", "reason": e["reason"], "t": now})

    def closed(self, code: int, reason: str = "") -> None:
        self.closes.append((time.time(), code, reason))


def lost_queues(entries: list[dict[str, Any]], private: Collection[str]) -> list[str]:
    """The private topics whose queue Redis lost (`closed`, reason `lost`): docs/protocol.md says to
    subscribe again, for a new queue that holds what is published from then on."""
    return [e["topic"] for e in entries if e.get("type") == "closed" and e.get("reason") == "lost" and e.get("topic") in private]


class BaseClient:
    """Reconnects to ``urls`` in turn (a base URL each, ``http://host:port``) until `stop`."""

    transport = "?"

    def __init__(self, name: str, urls: list[str], topics: list[str], user: str | None = None) -> None:
        self.name = name
        self.urls = urls
        self.topics = topics
        self.rec = Recorder(name, self.transport, user)
        self.streams = {t: Stream(t) for t in topics}
        self.stop_event = asyncio.Event()
        self.stall_until = 0.0  # a slow reader: do not read until then
        self.kick = asyncio.Event()  # drop the connection now (a reconnect storm)
        self._turn = random.randrange(len(urls))

    def next_url(self) -> str:
        self._turn += 1
        return self.urls[self._turn % len(self.urls)]

    def since(self, topic: str) -> dict[str, Any] | None:
        pos = self.streams[topic].position
        return None if pos is None else {"epoch": pos.epoch, "seq": pos.seq}

    async def run(self) -> None:
        while not self.stop_event.is_set():
            self.kick.clear()
            try:
                await self.session(self.next_url())
            except (OSError, WebSocketException, httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
                # WebSocketException: ConnectionClosed, and a handshake the proxy cut (its node is down)
                self.rec.closed(1006, type(exc).__name__)
            if not self.stop_event.is_set():
                await asyncio.sleep(random.uniform(0.05, 0.3))

    async def session(self, url: str) -> None:
        raise NotImplementedError

    def wanted(self) -> list[str]:
        """The topics it subscribes (`subscribed` waits for each one's answer)."""
        return self.topics

    def subscribed(self) -> bool:
        """Whether every topic it subscribes was answered `subscribed` (a run's publishers wait for it)."""
        return all(any(e["ev"] == "sub" for e in self.rec.events.get(t, ())) for t in self.wanted())

    async def stalled(self) -> None:
        while time.monotonic() < self.stall_until and not self.stop_event.is_set():
            await asyncio.sleep(0.1)


class WsClient(BaseClient):
    """Raw WebSocket. ``private``: topics subscribed without ``since`` (a queue restarts at its first queued
    seq); ``holder``: for a private topic shared by two clients of a user, only the holder subscribes it."""

    transport = "ws"

    def __init__(
        self,
        name: str,
        urls: list[str],
        topics: list[str],
        token: str | None = None,
        user: str | None = None,
        private: tuple[str, ...] = (),
    ) -> None:
        super().__init__(name, urls, topics, user)
        self.token = token
        self.private = set(private)
        self.holds = set(private)
        self.take = asyncio.Event()
        self.ws: Any = None

    def command(self, topic: str) -> dict[str, Any]:
        cmd: dict[str, Any] = {"op": "subscribe", "topic": topic}
        since = None if topic in self.private else self.since(topic)
        if since is not None:
            cmd["since"] = since
        self.streams[topic].resubscribing()
        return cmd

    async def session(self, url: str) -> None:
        ws_url = url.replace("http://", "ws://") + "/ws" + (f"?token={self.token}" if self.token else "")
        async with ws_connect(ws_url, max_size=None, compression=None, open_timeout=5, ping_interval=None, close_timeout=1) as ws:
            self.ws = ws
            self.rec.connects += 1
            cmds = [self.command(t) for t in self.topics if t not in self.private or t in self.holds]
            if cmds:
                await ws.send(orjson.dumps(cmds).decode())
            try:
                while not self.stop_event.is_set() and not self.kick.is_set():
                    await self.stalled()
                    if self.take.is_set():  # take a private queue over
                        self.take.clear()
                        await ws.send(orjson.dumps([self.command(t) for t in self.private]).decode())
                    try:
                        frame = await within(ws.recv(), SILENCE_S)
                    except asyncio.TimeoutError:
                        self.rec.closed(0, "silence")
                        return
                    entries = orjson.loads(frame)
                    for e in entries:
                        if e.get("type") == "closed" and e.get("reason") == "taken_over":
                            self.holds.discard(e["topic"])
                    self.rec.entries(entries, self.streams)
                    if lost := lost_queues(entries, self.private):
                        await ws.send(orjson.dumps([self.command(t) for t in lost]).decode())
            except ConnectionClosed as exc:
                self.rec.closed(exc.rcvd.code if exc.rcvd else 1006, exc.rcvd.reason if exc.rcvd else "")
                return
            finally:
                self.ws = None
            if self.kick.is_set():
                self.rec.closed(0, "storm")

    def wanted(self) -> list[str]:
        return [t for t in self.topics if t not in self.private or t in self.holds]

    def take_over(self) -> None:
        self.holds = set(self.private)
        self.take.set()


class SseClient(BaseClient):
    """SSE, recovering by its last ``id:`` as ``since=``. ``private``: topics subscribed by a POST after the
    ``session`` event, with ``ack: true``; every batch's highest private seq is acknowledged by a POST once
    the batch is recorded (docs/protocol.md, "Acknowledged private subscriptions")."""

    transport = "sse"

    def __init__(
        self,
        name: str,
        urls: list[str],
        topics: list[str],
        token: str | None = None,
        user: str | None = None,
        private: tuple[str, ...] = (),
    ) -> None:
        super().__init__(name, urls, topics, user)
        self.token = token
        self.private = private
        self.last_id: str | None = None
        self.acks_sent = 0

    def wanted(self) -> list[str]:
        return [*self.topics, *self.private]

    async def _post(self, http: httpx.AsyncClient, url: str, cmds: list[dict[str, Any]]) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await http.post(url, content=orjson.dumps(cmds))

    async def session(self, url: str) -> None:
        params = {"topics": ",".join(self.topics)}
        if self.last_id:
            params["since"] = self.last_id
        if self.token:
            params["token"] = self.token
        for s in self.streams.values():
            s.resubscribing()
        timeout = httpx.Timeout(5.0, read=SILENCE_S)
        posts: list[asyncio.Task[None]] = []
        async with httpx.AsyncClient(timeout=timeout) as http, http.stream("GET", url + "/sse", params=params) as resp:
            if resp.status_code != 200:
                self.rec.closed(resp.status_code, "http")
                await asyncio.sleep(0.5)
                return
            self.rec.connects += 1
            event, data, ident = "message", "", None
            sid: str | None = None
            lines = resp.aiter_lines()
            try:
                while not self.stop_event.is_set() and not self.kick.is_set():
                    await self.stalled()
                    line = await anext(lines)
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data = line[5:].strip()
                    elif line.startswith("id:"):
                        ident = line[3:].strip()
                    elif line == "":
                        if event == "close":
                            info = orjson.loads(data)
                            self.rec.closed(int(info.get("code", 0)), str(info.get("reason", "")))
                            return
                        if event == "session" and data:
                            sid = orjson.loads(data)["session"]
                            if self.private:
                                cmds = [{"op": "subscribe", "topic": t, "ack": True} for t in self.private]
                                posts.append(asyncio.create_task(self._post(http, f"{url}/sse/{sid}", cmds)))
                        elif event == "message" and data:
                            entries = orjson.loads(data)
                            self.rec.entries(entries, self.streams)
                            if ident is not None:
                                self.last_id = ident
                            if (lost := lost_queues(entries, self.private)) and sid is not None:
                                cmds = [{"op": "subscribe", "topic": t, "ack": True} for t in lost]
                                posts.append(asyncio.create_task(self._post(http, f"{url}/sse/{sid}", cmds)))
                            acks: dict[str, int] = {}
                            for e in entries:
                                if e.get("type") == "msg" and e.get("topic") in self.private:
                                    acks[e["topic"]] = max(acks.get(e["topic"], -1), int(e["seq"]))
                            if acks and sid is not None:
                                self.acks_sent += 1
                                cmds = [{"op": "ack", "topic": t, "seq": n} for t, n in acks.items()]
                                posts.append(asyncio.create_task(self._post(http, f"{url}/sse/{sid}", cmds)))
                                posts = [p for p in posts if not p.done()]
                        event, data, ident = "message", "", None
            finally:
                for p in posts:
                    p.cancel()
            if self.kick.is_set():
                self.rec.closed(0, "storm")


class LpClient(BaseClient):
    """Long-poll. ``private``: topics subscribed without ``since`` (a new session takes the queue over from
    its head); each poll's ``?ack=`` commits the batch before (no ``ack`` command needed)."""

    transport = "lp"

    def __init__(
        self,
        name: str,
        urls: list[str],
        topics: list[str],
        token: str | None = None,
        user: str | None = None,
        private: tuple[str, ...] = (),
    ) -> None:
        super().__init__(name, urls, topics, user)
        self.token = token
        self.private = set(private)

    async def session(self, url: str) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=15.0)) as http:
            made = await http.post(url + "/lp", headers=headers)
            if made.status_code != 201:
                self.rec.closed(made.status_code, "http")
                await asyncio.sleep(0.5)
                return
            sid = made.json()["session"]
            self.rec.connects += 1
            cmds = []
            for t in self.topics:
                cmd: dict[str, Any] = {"op": "subscribe", "topic": t}
                since = None if t in self.private else self.since(t)
                if since is not None:
                    cmd["since"] = since
                self.streams[t].resubscribing()
                cmds.append(cmd)
            await http.post(f"{url}/lp/{sid}", content=orjson.dumps(cmds))
            ack: int | None = None
            try:
                while not self.stop_event.is_set() and not self.kick.is_set():
                    await self.stalled()
                    got = await http.get(f"{url}/lp/{sid}", params={} if ack is None else {"ack": ack})
                    if got.status_code != 200:
                        self.rec.closed(got.status_code, "http")
                        return
                    body = got.json()
                    if body["batch"] is None:
                        closes = [e for e in body["entries"] if e.get("code") == "closed"]
                        if closes:
                            self.rec.closed(int(closes[0].get("close_code", 0)), "closed")
                            return
                        continue
                    if body["batch"] != ack:
                        self.rec.entries(body["entries"], self.streams)
                        ack = body["batch"]
                        if lost := lost_queues(body["entries"], self.private):
                            await http.post(
                                f"{url}/lp/{sid}", content=orjson.dumps([{"op": "subscribe", "topic": t} for t in lost])
                            )
            finally:
                if self.kick.is_set() or self.stop_event.is_set():
                    with contextlib.suppress(httpx.HTTPError):
                        await http.delete(f"{url}/lp/{sid}")
            if self.kick.is_set():
                self.rec.closed(0, "storm")


class LibClient:
    """fanout_client (reconnects and recovers by itself): records its `Message` and `Loss` events."""

    transport = "fanout_client"

    def __init__(self, name: str, url: str, topics: list[str], token: str | None = None, user: str | None = None) -> None:
        self.name = name
        self.url = url
        self.topics = topics
        self.token = token
        self.rec = Recorder(name, self.transport, user)
        self.stop_event = asyncio.Event()
        self.client: Any = None
        #: the topics whose subscribe returned
        self.subs: set[str] = set()

    def subscribed(self) -> bool:
        return self.subs >= set(self.topics)

    async def run(self) -> None:
        import fanout_client
        from fanout_client import Loss, Message

        token = self.token

        def on_state(state: str, close: Any) -> None:
            if state == "disconnected" and close is not None:
                self.rec.closed(int(close.code), str(close.reason))
            elif state == "connected":
                self.rec.connects += 1

        async with fanout_client.connect(
            self.url, token=token, max_queued_events=4096, on_state=on_state, ping_interval=3.0, ping_timeout=3.0, backoff_max=2.0
        ) as client:
            self.client = client

            async def consume(topic: str) -> None:
                sub = await client.subscribe(topic)
                self.subs.add(topic)
                epoch: str | None = None
                events = self.rec.events[topic]
                try:
                    async for ev in sub:
                        now = time.time()
                        if isinstance(ev, Message):
                            if ev.epoch != epoch:
                                events.append({"ev": "sub", "epoch": ev.epoch, "seq": ev.seq, "kind": sub.kind, "t": now})
                                epoch = ev.epoch
                            events.append({"ev": "msg", "seq": ev.seq, "data": ev.data, "t": now})
                        elif isinstance(ev, Loss):
                            if ev.to_seq is not None and ev.epoch != epoch:
                                events.append({"ev": "sub", "epoch": ev.epoch, "seq": ev.from_seq, "kind": sub.kind, "t": now})
                                epoch = ev.epoch
                            events.append({"ev": "loss", "from": ev.from_seq, "to": ev.to_seq, "reason": ev.reason, "t": now})
                except fanout_client.FanoutError as exc:
                    events.append({"ev": "closed", "reason": exc.code, "t": time.time()})

            tasks = [asyncio.create_task(consume(t)) for t in self.topics]
            await self.stop_event.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


# -- publishers ------------------------------------------------------------------------------------------


class Accepted:
    """What publishers were told was accepted: ``ring[topic][publisher]`` payload numbers, and
    ``private[(user, topic)]`` (publisher, n, when)."""

    def __init__(self) -> None:
        self.ring: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        self.private: dict[tuple[str, str], list[tuple[str, int, float]]] = defaultdict(list)
        self.refused: dict[str, int] = defaultdict(int)
        self.uncertain: dict[str, int] = defaultdict(int)
        #: ``unknown[topic][publisher]``: payload numbers whose outcome the publisher never learned
        self.unknown: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))


class IngestPublisher:
    """Newline-delimited records on the TCP ingest, ``rate`` per second over ``topics``, a ``sync`` after each
    batch; an error line refuses its record (it may still have landed: not counted either way)."""

    def __init__(self, name: str, ports: list[int], topics: list[str], rate: float, acc: Accepted) -> None:
        self.name, self.ports, self.topics, self.rate, self.acc = name, ports, topics, rate, acc
        self.stop_event = asyncio.Event()
        self.n = itertools.count()
        self._turn = 0

    async def run(self) -> None:
        while not self.stop_event.is_set():
            self._turn += 1
            port = self.ports[self._turn % len(self.ports)]
            try:
                await self._session(port)
            except (OSError, asyncio.TimeoutError, ValueError):
                pass
            await asyncio.sleep(0.2)

    async def _session(self, port: int) -> None:
        reader, writer = await within(asyncio.open_connection("127.0.0.1", port), 3)
        line = 0
        try:
            while not self.stop_event.is_set():
                batch: dict[int, tuple[str, int]] = {}
                chunk = []
                for i in range(max(1, int(self.rate / 10))):
                    topic = self.topics[i % len(self.topics)]
                    n = next(self.n)
                    line += 1
                    batch[line] = (topic, n)
                    chunk.append(orjson.dumps({"topic": topic, "data": {"p": self.name, "n": n, "t": time.time()}}))
                line += 1
                chunk.append(orjson.dumps({"sync": line}))
                writer.write(b"\n".join(chunk) + b"\n")
                try:
                    await writer.drain()
                    refused: set[int] = set()
                    while True:
                        answer = orjson.loads(await within(reader.readline(), 15))
                        if answer.get("type") == "error":
                            refused.add(int(answer.get("line", 0)))
                        elif answer.get("type") == "synced":
                            break
                except (OSError, asyncio.TimeoutError, ValueError):
                    self.acc.uncertain[self.name] += len(batch)
                    for topic, n in batch.values():
                        self.acc.unknown[topic][self.name].add(n)
                    raise
                for ln, (topic, n) in batch.items():
                    if ln in refused:
                        self.acc.refused[self.name] += 1
                        self.acc.unknown[topic][self.name].add(n)
                    else:
                        self.acc.ring[topic][self.name].append(n)
                await asyncio.sleep(0.1)
        finally:
            writer.close()


class AdminPublisher:
    """The admin API: one message at a time to ring and snapshot topics, and to users' private queues."""

    def __init__(
        self,
        name: str,
        urls: list[str],
        token: str,
        ring: list[str],
        snapshot: list[str],
        private: list[tuple[str, str]],
        rate: float,
        acc: Accepted,
    ) -> None:
        self.name, self.urls, self.token, self.acc, self.rate = name, urls, token, acc, rate
        self.targets: list[tuple[str, str | None]] = [(t, None) for t in ring + snapshot] + [(t, u) for u, t in private]
        self.private_topics = {t for _, t in private}
        self.stop_event = asyncio.Event()
        self.counters: dict[str, itertools.count[int]] = defaultdict(itertools.count)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=10, headers={"Authorization": f"Bearer {self.token}"}) as http:
            turn = 0
            while not self.stop_event.is_set():
                for topic, user in self.targets:
                    turn += 1
                    key = f"{topic}/{user}"
                    n = next(self.counters[key])
                    body: dict[str, Any] = {"data": {"p": self.name, "n": n, "t": time.time()}}
                    if user is not None:
                        body["client"] = user
                    url = self.urls[turn % len(self.urls)]
                    why = self.name  # refused: counted per publisher, and per error code the gateway gave
                    try:
                        reply = await http.post(f"{url}/api/topics/{topic}/publish", content=orjson.dumps(body))
                        ok = reply.status_code == 200
                        if not ok:
                            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                                why = f"{self.name} {reply.status_code} {reply.json()['error']['code']}"
                    except httpx.HTTPError:
                        ok = False
                        self.acc.uncertain[self.name] += 1
                    if ok and user is not None:
                        self.acc.private[(user, topic)].append((self.name, n, time.time()))
                    elif ok:
                        self.acc.ring[topic][self.name].append(n)
                    else:
                        self.acc.refused[self.name] += 1
                        if user is None:  # a 503 may follow a publish that landed
                            self.acc.unknown[topic][self.name].add(n)
                        if why != self.name:
                            self.acc.refused[why] += 1
                await asyncio.sleep(1 / self.rate)


async def ws_burst(url: str, topic: str, count: int, acc: Accepted, name: str = "burst") -> dict[str, int]:
    """``count`` client publishes at once on one WebSocket, past ``limits.publish_rate``: the accepted ones
    (a seq in the reply) count as accepted, ``rate_limited`` ones not."""
    answers: dict[str, int] = defaultdict(int)
    async with ws_connect(url.replace("http://", "ws://") + "/ws", compression=None, open_timeout=5) as ws:
        for start in range(0, count, 100):
            cmds = [
                {"op": "publish", "topic": topic, "id": n, "data": {"p": name, "n": n, "t": time.time()}}
                for n in range(start, min(count, start + 100))
            ]
            await ws.send(orjson.dumps(cmds).decode())
        pending = count
        deadline = time.monotonic() + 15
        while pending and time.monotonic() < deadline:
            for e in orjson.loads(await within(ws.recv(), 15)):
                if e.get("type") == "reply" and isinstance(e.get("id"), int):
                    acc.ring[topic][name].append(e["id"])
                    answers["accepted"] += 1
                    pending -= 1
                elif e.get("type") == "error" and e.get("id") is not None:
                    answers[e.get("code", "error")] += 1
                    pending -= 1
    return dict(answers)


# -- the faulty path -------------------------------------------------------------------------------------


class FaultyProxy:
    """A TCP proxy between clients and one node: ``delay`` seconds added to every chunk each way, ``stall``
    (forward nothing, keep the connections), ``cut`` (close every connection, refuse new ones a while),
    ``reset_share`` (reset that share of the connections, chosen at random: a lossy path)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.delay = 0.0
        self.stalled = False
        self.refuse_until = 0.0
        self.conns: set[asyncio.StreamWriter] = set()
        #: client side -> node side of each connection (a reset aborts both)
        self.pairs: dict[asyncio.StreamWriter, asyncio.StreamWriter] = {}
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self, refuse_s: float) -> None:
        self.refuse_until = time.monotonic() + refuse_s
        for w in list(self.conns):
            w.transport.abort()

    def reset_share(self, share: float, rng: random.Random) -> int:
        """Reset (RST both ways) ``share`` of the current connections, chosen at random; returns how many."""
        pairs = list(self.pairs.items())
        chosen = [p for p in pairs if rng.random() < share]
        for client_side, node_side in chosen:
            for w in (client_side, node_side):
                sock = w.get_extra_info("socket")
                if sock is not None:  # SO_LINGER 0: close() sends RST, as a middlebox dropping the flow
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                w.transport.abort()
        return len(chosen)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self.refuse_until:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await within(asyncio.open_connection("127.0.0.1", self.upstream_port), 3)
        except (OSError, asyncio.TimeoutError):
            writer.transport.abort()
            return
        self.conns |= {writer, up_w}
        self.pairs[writer] = up_w
        tasks = [asyncio.create_task(self._pipe(reader, up_w)), asyncio.create_task(self._pipe(up_r, writer))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass
        for t in tasks:
            t.cancel()
        self.pairs.pop(writer, None)
        for w in (writer, up_w):
            self.conns.discard(w)
            w.transport.abort()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while True:
                data = await src.read(65536)
                if not data:
                    return
                while self.stalled:
                    await asyncio.sleep(0.05)
                if self.delay:
                    await asyncio.sleep(self.delay)
                dst.write(data)
                await dst.drain()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.cut(0)

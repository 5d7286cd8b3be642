"""Bounds of the backend hook client (gateway/hooks/backend.py, issue 34 items 6, 7 and 9), against real backends on
loopback: the events one client makes cannot crowd out another client's disconnect event; a hook's answer is
read streamed, never inflated, up to `proxy.max_answer_bytes`; a hook call logs nothing when it succeeds and
its failures go through the bounded bad-input log."""

from __future__ import annotations

import asyncio
import logging
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest

from gateway.testing import run_gateway
from tests import web
from tests.gateway.gw_helpers import collect, recv_entries, send, wait_for, ws_connect
from tests.gateway.test_proxy_hooks import free_port

MIB = 1 << 20
GIB = 1 << 30


def metric(gw: Any, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when absent)."""
    text = web.get(gw.http_url + "/metrics", timeout=5).text
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    found = re.search(rf"^{name}\{{{re.escape(wanted)}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


# -- item 6: one client's events cannot crowd out the others' disconnect events ----------------------------


def test_an_unsubscribe_flood_on_a_slow_hook_drops_no_other_clients_disconnect_event(app):
    app.delays["unsubscribe"] = 1.5  # slower than timeout_s: every unsubscribe event times out and is retried
    proxy = {
        "disconnect_url": app.url("disconnect"),
        "unsubscribe_url": app.url("unsubscribe"),
        "timeout_s": 0.5,
        "event_queue_max": 20,
        "event_queue_per_client": 5,
        "event_retries": 1,
        "event_backoff_s": 0.1,
    }
    # the per-connection subscribe rate raised: the flood is what the event queues must withstand
    with run_gateway(proxy=proxy, limits={"subscribe_rate": 1e6, "subscribe_burst": 1_000_000}) as gw:
        with ws_connect(gw) as other:
            send(other, op="ping", id=0)
            recv_entries(other)
            other_id = gw.call(lambda: next(iter(gw.hub.clients.conns)))
            with ws_connect(gw) as flood:
                # 40 topics toggled 50 times each: 2,000 unsubscribes, in frames of 50 commands
                commands = [
                    {"op": op, "topic": f"t.{n}"} for _ in range(50) for n in range(40) for op in ("subscribe", "unsubscribe")
                ]
                for start in range(0, len(commands), 50):
                    flood.send(orjson.dumps(commands[start : start + 50]))
                send(flood, op="ping", id="end")  # commands take effect in order: past it, the flood is in
                collect(flood, lambda got: any(e.get("id") == "end" for e in got), timeout=10)
                # one waiting unsubscribe per (client, topic), at most event_queue_per_client of one client
                assert gw.call(lambda: gw.hub.hooks.pending("unsubscribe")) <= 5
                coalesced = metric(gw, "fanout_proxy_requests_total", hook="unsubscribe", outcome="coalesced")
                dropped = metric(gw, "fanout_proxy_requests_total", hook="unsubscribe", outcome="dropped")
                assert coalesced > 0 and dropped > 0 and coalesced + dropped >= 1900  # all but a few
            other.close()
            wait_for(
                lambda: other_id in {e["client"] for e in app.received["disconnect"]},
                "the other client's disconnect event",
                timeout=5,
            )
        assert metric(gw, "fanout_proxy_requests_total", hook="disconnect", outcome="dropped") == 0


# -- item 7: an answer is read streamed, up to max_answer_bytes, never inflated -----------------------------


def gzip_bomb(inflated_mib: int) -> bytes:
    """A gzip stream of `inflated_mib` MiB of zeros, ~1 KiB per MiB: one MiB compressed after a full flush,
    repeated (each copy references nothing before it), and the trailer of the whole."""
    block = bytes(MIB)
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    first = packer.compress(block) + packer.flush(zlib.Z_FULL_FLUSH)
    again = packer.compress(block) + packer.flush(zlib.Z_FULL_FLUSH)
    end = packer.flush()[:-8]  # the last (empty) block; its trailer counted two blocks
    crc = 0
    for _ in range(inflated_mib):
        crc = zlib.crc32(block, crc)
    trailer = struct.pack("<II", crc, (inflated_mib * MIB) & 0xFFFFFFFF)
    return first + again * (inflated_mib - 1) + end + trailer


class HostileHook:
    """A raw HTTP/1.1 server on loopback (asyncio, in a thread) answering every request with `mode`:
    `huge_length` (Content-Length 1 GiB, then spaces as fast as the peer reads), `endless_chunks` (chunked,
    without end), `gzip_bomb` (1 MiB of gzip inflating to 1 GiB, Content-Encoding: gzip). It counts the
    bytes it could write and keeps the request heads."""

    def __init__(self) -> None:
        self.mode = "huge_length"
        self.bomb = gzip_bomb(1024)
        self.written = 0
        self.heads: list[bytes] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self.serve, "127.0.0.1", 0), self.loop).result(5)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/rpc"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
            await reader.readexactly(length)
            await self.answer(writer)
            await reader.read()  # until the gateway hangs up
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the gateway hung up: what it was meant to do
        finally:
            writer.close()

    async def write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.written += len(data)

    async def answer(self, writer: asyncio.StreamWriter) -> None:
        spaces = b" " * (64 * 1024)
        if self.mode == "gzip_bomb":
            await self.write(
                writer,
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
                b"Content-Length: %d\r\n\r\n" % len(self.bomb),
            )
            await self.write(writer, self.bomb)
        elif self.mode == "huge_length":
            await self.write(
                writer, b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{"result": 1}' % GIB
            )
            while self.written < GIB:
                await self.write(writer, spaces)
        else:
            await self.write(writer, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n%s\r\n" % (len(spaces), spaces)
            while self.written < GIB:
                await self.write(writer, chunk)

    def close(self) -> None:
        async def shut() -> None:
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileHook]:
    server = HostileHook()
    yield server
    server.close()


def test_the_gzip_bomb_is_what_it_says(hostile) -> None:
    assert zlib.decompress(gzip_bomb(3), 31) == bytes(3 * MIB)  # the same construction, small
    assert len(hostile.bomb) < 1.1 * MIB


def rss_kib(field: str) -> int:
    """VmRSS or VmHWM (the peak since the last reset) of this process, the gateway's thread included."""
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field + ":")).split()[1])


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def socket_buffers_max() -> int:
    """The most a TCP connection's two ends can hold in the kernel here (send and receive buffer maxima)."""
    total = 0
    for name in ("tcp_wmem", "tcp_rmem"):
        with open(f"/proc/sys/net/ipv4/{name}") as values:
            total += int(values.read().split()[2])
    return total


def healthz_seconds(gw: Any) -> float:
    started = time.perf_counter()
    assert web.get(gw.http_url + "/healthz", timeout=10).status_code == 200
    return time.perf_counter() - started


@pytest.mark.parametrize("mode", ["huge_length", "endless_chunks", "gzip_bomb"])
def test_a_huge_or_inflating_answer_is_refused_at_once_reading_a_bounded_amount(hostile, mode):
    hostile.mode, hostile.written = mode, 0
    with run_gateway(proxy={"rpc_url": hostile.url, "timeout_s": 5.0}) as gw, ws_connect(gw) as ws:
        assert gw.call(lambda: gw.hub.config.proxy.max_answer_bytes) == 64 * 1024
        before = rss_kib("VmRSS")
        reset_peak_rss()
        with ThreadPoolExecutor(1) as pool:
            started = time.perf_counter()
            send(ws, op="rpc", method="big", id=1)
            time.sleep(0.05)  # the call under way
            healthz = pool.submit(healthz_seconds, gw)
            (answer,) = recv_entries(ws, timeout=10)
            elapsed = time.perf_counter() - started
            assert healthz.result() < 1.0  # generous: the loop is not busy inflating
        grown_mib = (rss_kib("VmHWM") - before) / 1024
        assert answer["code"] == "backend_unavailable", answer
        assert elapsed < 2.5, f"answered after {elapsed:.1f} s: the timeout (5 s), not the bound, ended the call"
        assert grown_mib < 32, f"peak RSS grew {grown_mib:.0f} MiB"
        assert metric(gw, "fanout_proxy_requests_total", hook="rpc", outcome="bad_answer") == 1
        # what the server could write is at most the cap plus what the kernel's socket buffers hold, not the body
        assert hostile.written < len(hostile.bomb) + socket_buffers_max() + MIB
        assert re.search(rb"(?im)^accept-encoding: identity\r$", hostile.heads[-1])


def test_an_answer_within_the_cap_is_read_and_a_longer_one_refused(app):
    app.answers["rpc"] = lambda body: {"result": "x" * body["params"]}
    with run_gateway(proxy={"rpc_url": app.url("rpc"), "max_answer_bytes": 1000}) as gw, ws_connect(gw) as ws:
        send(ws, op="rpc", method="echo_back", params=900, id=1)
        assert recv_entries(ws) == [{"type": "reply", "id": 1, "result": "x" * 900}]
        send(ws, op="rpc", method="echo_back", params=1000, id=2)
        (refused,) = recv_entries(ws)
        assert refused["code"] == "backend_unavailable" and "max_answer_bytes" in refused["message"]


# -- item 9: successes log nothing, failures go through the bounded log ------------------------------------


def rpc_round(ws: Any, count: int) -> list[dict[str, Any]]:
    answers = []
    for n in range(count):
        send(ws, op="rpc", method="custom", id=n)
        answers += recv_entries(ws)
    return answers


def test_hook_calls_log_nothing_when_they_succeed_and_failures_at_a_bounded_rate(app, caplog):
    caplog.set_level(logging.INFO)
    with run_gateway(proxy={"rpc_url": app.url("rpc")}) as gw, ws_connect(gw) as ws:
        assert all(a["type"] == "reply" for a in rpc_round(ws, 20))
    assert len(app.received["rpc"]) == 20
    assert [r.getMessage() for r in caplog.records if r.name.startswith(("httpx", "httpcore"))] == []
    caplog.clear()
    dead = f"http://127.0.0.1:{free_port()}/rpc"
    with run_gateway(proxy={"rpc_url": dead}, limits={"bad_input_log_per_s": 5.0}) as gw, ws_connect(gw) as ws:
        started = time.monotonic()
        assert all(a["code"] == "backend_unavailable" for a in rpc_round(ws, 30))
        elapsed = time.monotonic() - started
        assert metric(gw, "fanout_bad_input_total", source="hook") == 30
    failures = [r.getMessage() for r in caplog.records if r.name == "gateway.input"]
    assert 1 <= len(failures) <= 5 + 5 * elapsed + 1 < 30, failures  # a burst of 5, then 5 per second
    assert "rpc hook could not be reached" in failures[0]
    assert [r.getMessage() for r in caplog.records if r.name.startswith(("httpx", "httpcore"))] == []

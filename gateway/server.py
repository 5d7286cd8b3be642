"""Start and stop the whole gateway on one event loop: hub, ingest, raw TCP, uvicorn serving the app."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
from dataclasses import dataclass

import uvicorn

from .app import build_app
from .config import ConfigError, GatewayConfig
from .hub import Hub
from .ingest import IngestServer
from .ws import protocol_class

log = logging.getLogger("gateway")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_admin_token(config: GatewayConfig) -> tuple[str, bool]:
    """(token, generated). Binding beyond loopback without a configured token is refused."""
    token = config.server.admin_token
    if token:
        return token, False
    if not _is_loopback(config.server.host):
        raise ConfigError(
            f"refusing to bind {config.server.host} without server.admin_token: set it (or GATEWAY_SERVER_ADMIN_TOKEN)"
        )
    return secrets.token_urlsafe(18), True


class GatewayServer(uvicorn.Server):
    """uvicorn's server, closing the gateway's clients first on shutdown so it never waits on them."""

    hub: Hub

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.hub.close_all_clients()
        await super().shutdown(sockets)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


@dataclass
class RunningGateway:
    config: GatewayConfig
    hub: Hub
    admin_token: str
    http_port: int
    ingest_port: int = 0
    raw_sender_port: int = 0
    raw_receiver_port: int = 0
    server: uvicorn.Server | None = None
    task: asyncio.Task | None = None
    ingest: IngestServer | None = None

    def ports(self) -> dict:
        return {
            "http_port": self.http_port,
            "ingest_port": self.ingest_port,
            "raw_sender_port": self.raw_sender_port,
            "raw_receiver_port": self.raw_receiver_port,
            "admin_token": self.admin_token,
        }

    async def wait(self) -> None:
        assert self.task is not None
        await self.task

    async def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        await self.hub.stop()
        if self.task is not None:
            try:
                await asyncio.wait_for(self.task, 10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        if self.ingest is not None:
            await self.ingest.stop()
        if self.hub.raw is not None:
            await self.hub.raw.stop()


async def start_gateway(config: GatewayConfig) -> RunningGateway:
    token, _generated = resolve_admin_token(config)
    hub = Hub(config)
    await hub.start()
    server_cfg = config.server
    running = RunningGateway(config, hub, token, http_port=0)
    if config.ingest.enabled:
        running.ingest = IngestServer(hub)
        await running.ingest.start(config.ingest.host, config.ingest.port)
        running.ingest_port = running.ingest.port
    if config.rawtcp.enabled:
        from core.byte_ring import ByteRingConfig

        from .rawtcp import RawBroadcastServer

        r = config.rawtcp
        raw = RawBroadcastServer(ByteRingConfig(
            capacity_bytes=r.capacity_bytes, soft_lag_bytes=r.soft_lag_bytes, hard_lag_bytes=r.hard_lag_bytes,
            kick_grace_ms=r.kick_grace_ms, pause_watermark_pct=r.pause_watermark_pct,
            resume_watermark_pct=r.resume_watermark_pct, recv_chunk_bytes=r.recv_chunk_bytes,
            max_receivers=r.max_receivers,
        ))
        await raw.start(r.host, r.sender_port, r.receiver_port)
        hub.raw = raw
        running.raw_sender_port, running.raw_receiver_port = raw.sender_port, raw.receiver_port
    sock = _listen(server_cfg.host, server_cfg.port)
    running.http_port = sock.getsockname()[1]
    ws = config.websocket
    uv_config = uvicorn.Config(
        build_app(hub, token),
        ws=protocol_class(ws.write_high_water, ws.socket_send_buffer),
        ws_per_message_deflate=False,  # a shared frame per batch: compression would cost an encode per client
        ws_max_size=ws.max_frame_bytes,
        ws_ping_interval=ws.ping_interval_s,
        ws_ping_timeout=ws.ping_timeout_s,
        lifespan="off",
        log_level=server_cfg.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    running.server = GatewayServer(uv_config)
    running.server.hub = hub
    running.task = asyncio.get_running_loop().create_task(running.server.serve(sockets=[sock]))
    while not running.server.started:
        if running.task.done():
            running.task.result()
            raise RuntimeError("uvicorn stopped during start-up")
        await asyncio.sleep(0.01)
    host = server_cfg.host
    log.info("gateway on http://%s:%d (WebSocket /ws, long-poll /lp, admin /api)", host, running.http_port)
    return running

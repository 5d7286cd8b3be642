"""Start and stop the whole gateway on one event loop: hub, ingest, raw TCP, uvicorn serving the app."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import re
import resource
import secrets
import signal
import socket
import ssl
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from .app import build_app
from .config import ConfigError, GatewayConfig
from .edge.hosts import HostPolicy
from .edge.netguard import ConnectionLimiter, http_protocol_class
from .edge.origin import OriginPolicy, parse_allowed_origins
from .hub import Hub
from .transports.ingest import IngestParts, IngestServer, ingest_counters
from .transports.ws import WebSocketProtocol, protocol_class, ws_counters
from .transports.ws_centrifugo import centrifugo_endpoint
from .workers.forward import MAX_FORWARDS_UNLIMITED, WorkerLinks, serve_inbox

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


def check_listener_tokens(config: GatewayConfig) -> None:
    """As for the admin token, and before anything is started: beyond loopback, anyone could publish or send."""
    for section, what in (("ingest", "the ingest"), ("rawtcp", "the raw TCP broadcaster")):
        cfg = getattr(config, section)
        if cfg.enabled and not cfg.token and not _is_loopback(cfg.host):
            raise ConfigError(
                f"refusing to bind {what} on {cfg.host} without {section}.token: set it (or GATEWAY_{section.upper()}_TOKEN)"
            )


class ListenError(ConfigError):
    """A listening port could not be bound (in use, a host not of this machine, a port below 1024...): the
    gateway cannot start, as with a config error (exit status 2), and the message names the port and its key."""


#: the listening ports: (section, key, what listens there)
LISTENERS = (
    ("server", "port", "HTTP"),
    ("ingest", "port", "TCP ingest"),
    ("rawtcp", "sender_port", "raw TCP senders"),
    ("rawtcp", "receiver_port", "raw TCP receivers"),
)


def listen_error(exc: OSError, section: str, key: str, host: str, port: int) -> ListenError:
    """One line for a bind that failed: which port, which key sets it (and its variable), and why."""
    what = next(what for s, k, what in LISTENERS if (s, k) == (section, key))
    where = f"{section}.{key}, GATEWAY_{section.upper()}_{key.upper()}"
    if (section, key) == ("server", "port"):
        where += " or serve --port"
    if exc.errno == errno.EADDRINUSE:
        return ListenError(
            f"port {port} ({what}: {where}) is in use on {host} by another process: stop it, or choose another port"
        )
    return ListenError(f"cannot listen on {host}:{port} ({what}: {section}.host, {where}): {exc.strerror or exc}")


def check_listener_ports(config: GatewayConfig, worker: int = 0) -> None:
    """Two of the gateway's own listeners on one port (0: a free one each) fail before anything starts, saying
    which keys collide (the bind would say only that the port is in use)."""
    seen: dict[tuple[str, int], str] = {}
    for section, key, _what in LISTENERS:
        cfg = getattr(config, section)
        if section != "server" and not cfg.enabled:
            continue
        if section == "rawtcp" and worker != 0:  # worker 0 alone runs the raw TCP broadcaster
            continue
        port = getattr(cfg, key)
        if port == 0:
            continue
        wildcard = cfg.host in ("", "0.0.0.0", "::")
        for (host, other_port), other in seen.items():
            if other_port == port and (host == cfg.host or wildcard or host in ("", "0.0.0.0", "::")):
                raise ConfigError(f"{other} and {section}.{key} are both port {port}: give each listener its own")
        seen[(cfg.host, port)] = f"{section}.{key}"


class GatewayServer(uvicorn.Server):
    """uvicorn's server, closing the gateway's clients first on shutdown so it never waits on them; on SIGTERM
    or SIGINT, a graceful drain first (`drain`, `server.drain_timeout_s`), and the process then ends with
    status 0 (uvicorn would raise the signal again once stopped)."""

    hub: Hub
    #: the TCP ingest, drained with the rest
    ingest: IngestServer | None = None
    #: a signal asked to stop: shut down with a drain (`RunningGateway.stop` alone closes at once, with 1001)
    drain_requested = False
    #: what the last drain measured (seconds, clients closed, connections left), for the log and tests
    drain_report: dict[str, float] | None = None
    #: with `server.workers` > 1: this worker's inbox and the HTTP protocol serving the connections the other
    #: workers pass through it (plain HTTP even under TLS: a socketpair between workers; no per-address
    #: limit: every peer is a worker; at most `server.max_connections` at once), docs/cluster.md §5
    internal: tuple[socket.socket, type[asyncio.Protocol]] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.internal is not None and self.started:
            inbox, protocol = self.internal
            config, state = self.config, self.server_state
            loop = asyncio.get_running_loop()
            opening: set[asyncio.Task[tuple[asyncio.Transport, asyncio.Protocol]]] = set()

            def create_protocol() -> asyncio.Protocol:
                return protocol(config=config, server_state=state, app_state=self.lifespan.state)  # type: ignore[call-arg]  # uvicorn's protocol signature

            def serve(sock: socket.socket) -> None:
                task = loop.create_task(loop.connect_accepted_socket(create_protocol, sock))
                opening.add(task)
                task.add_done_callback(opening.discard)

            serve_inbox(inbox, serve)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not recorded in `_captured_signals`: uvicorn would raise it again once stopped, ending the process by
        # the signal instead of with status 0 after the drain. A second SIGINT still forces the exit.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.hub.readiness.draining = True  # here, not on the next tick: the very next /readyz says so
            self.should_exit = True
            self.drain_requested = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # the drain first when a signal asked for it; the clients left are closed (1001) before uvicorn's
        # shutdown closes the connections and waits for them
        if self.drain_requested:
            await self._announce_drain(self.hub.config.server.drain_delay_s)
        if self.drain_requested and self.hub.config.server.drain_timeout_s > 0:
            await self.drain()
        self.hub.close_all_clients()
        await super().shutdown(sockets)

    async def drain(self) -> None:
        """Stop accepting (the HTTP and ingest ports close), close every client with 1012 and a reconnect hint,
        then wait up to `server.drain_timeout_s` for the long-poll sessions to fetch their last body and for
        the connections to be gone (docs/reliability.md, "Graceful drain")."""
        cfg = self.hub.config.server
        started = time.monotonic()
        deadline = started + cfg.drain_timeout_s
        for server in self.servers:
            server.close()  # new connections are refused from now on
        ingest = None
        if self.ingest is not None:
            ingest = asyncio.get_running_loop().create_task(self.ingest.drain(cfg.drain_timeout_s))
        clients = len(self.hub.clients.conns)
        pending = self.hub.drain(cfg.drain_spread_s)
        log.info(
            "draining: %d clients told to reconnect (1012) within %g s; waiting up to %g s",
            clients,
            cfg.drain_spread_s,
            cfg.drain_timeout_s,
            extra={"clients": clients},
        )
        closed = self.hub.sessions.closed
        while pending and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
            pending = [secret for secret in pending if secret in closed]
        # every long-poll session has its last body (or the time is up): idle keep-alive connections can go
        # (a request in progress finishes first); a WebSocket lingers on its close frame (KICK_GRACE_S)
        connections = self.server_state.connections
        for conn in list(connections):
            if not isinstance(conn, WebSocketProtocol):
                conn.shutdown()
        while connections and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
            for conn in list(connections):
                if not isinstance(conn, WebSocketProtocol):
                    conn.shutdown()  # a keep-alive connection that became idle since
        if ingest is not None:
            while not ingest.done() and not self.force_exit:  # a second SIGINT: no more waiting
                await asyncio.wait({ingest}, timeout=0.05)
            ingest.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ingest
        self.drain_report = {
            "seconds": time.monotonic() - started,
            "clients": clients,
            "connections_left": len(connections),
            "longpoll_unfetched": len(pending),
        }
        log.info(
            "drained in %.2f s: %d connections left (closed now), %d long-poll bodies not fetched",
            self.drain_report["seconds"],
            len(connections),
            len(pending),
            extra=self.drain_report,
        )

    async def _announce_drain(self, delay_s: float) -> None:
        """Keep serving `server.drain_delay_s` with /readyz answering 503 `draining`, so a load balancer or
        Kubernetes stops sending new clients before the port closes (docs/operations.md)."""
        if delay_s <= 0:
            return
        log.info(
            "draining: /readyz answers 503 draining; serving %g s more before the drain", delay_s, extra={"reason": "draining"}
        )
        deadline = time.monotonic() + delay_s
        while time.monotonic() < deadline and not self.force_exit:  # a second SIGINT: no more waiting
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def _listen(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # server.workers > 1: each worker listens on the port, the kernel spreads connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def tls_files(config: GatewayConfig) -> tuple[str, str] | None:
    """(certfile, keyfile) when TLS is configured, checked now so that a mistake is a clear config error."""
    cert, key = config.server.ssl_certfile, config.server.ssl_keyfile
    if not cert and not key:
        return None
    if not (cert and key):
        raise ConfigError("server.ssl_certfile and server.ssl_keyfile go together: set both for TLS, or neither")
    for name, path in (("ssl_certfile", cert), ("ssl_keyfile", key)):
        if not os.path.isfile(path):
            raise ConfigError(f"server.{name}: no such file {path!r}")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"server.ssl_certfile {cert!r} with server.ssl_keyfile {key!r}: {exc}") from None
    return cert, key


#: descriptors besides HTTP connections: listening sockets, ingest and raw TCP peers, files, the loop's own
FD_RESERVE = 64


def raise_open_files_limit(max_connections: int, workers: int = 1) -> None:
    """Every connection is a file descriptor: take the hard limit, and warn when the gateway would run out
    of descriptors (accept failing for everyone) before its own connection limit refuses anyone. With
    several workers a worker also holds one descriptor per session request it forwards and one per request
    forwarded to it, each bounded by `server.max_connections` (gateway/workers/forward.py): 3 x in all."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # e.g. an unlimited hard limit above the kernel's nr_open
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    log.info("open-files limit (RLIMIT_NOFILE): %s", "unlimited" if soft == resource.RLIM_INFINITY else soft)
    sockets = max_connections * (3 if workers > 1 else 1)
    if max_connections and soft != resource.RLIM_INFINITY and soft < sockets + FD_RESERVE:
        what = "server.max_connections" if workers == 1 else "3 x server.max_connections (forwards between workers)"
        log.warning(
            "open-files limit %d is below %s + %d (%d): descriptors run out first;"
            " raise the hard limit (ulimit -Hn, LimitNOFILE=) or lower server.max_connections",
            soft,
            what,
            FD_RESERVE,
            sockets + FD_RESERVE,
        )


@dataclass
class RunningGateway:
    config: GatewayConfig
    hub: Hub
    admin_token: str
    http_port: int
    ingest_port: int = 0
    raw_sender_port: int = 0
    raw_receiver_port: int = 0
    server: GatewayServer | None = None
    task: asyncio.Task[None] | None = None
    ingest: IngestServer | None = None

    def ports(self) -> dict[str, Any]:
        return {
            "http_port": self.http_port,
            "ingest_port": self.ingest_port,
            "raw_sender_port": self.raw_sender_port,
            "raw_receiver_port": self.raw_receiver_port,
        }

    async def wait(self) -> None:
        assert self.task is not None
        await self.task

    async def stop(self) -> None:
        self.hub.readiness.draining = True
        if self.server is not None:
            self.server.should_exit = True
        await self.hub.stop()
        if self.task is not None:
            try:
                async with asyncio.timeout(10):
                    await self.task
            except (TimeoutError, asyncio.CancelledError):
                pass
        if self.ingest is not None:
            await self.ingest.stop()
        if self.hub.raw is not None:
            await self.hub.raw.stop()


async def start_gateway(config: GatewayConfig, worker: int = 0, links: WorkerLinks | None = None) -> RunningGateway:
    """`worker`: this process's index among `server.workers` (docs/cluster.md §5): only worker 0 runs the
    raw TCP broadcaster; with several, the HTTP and ingest ports are shared (SO_REUSEPORT), and `links`
    (from the supervisor) let session requests that reach the wrong worker go to their owner."""
    token, _generated = resolve_admin_token(config)
    shared = config.server.workers > 1
    tls = tls_files(config)
    check_listener_tokens(config)
    check_listener_ports(config, worker)
    hosts = HostPolicy(config.server.allowed_hosts, config.server.host)
    hub = Hub(config)
    hub.readiness.worker = worker
    await hub.start()
    running = RunningGateway(config, hub, token, http_port=0)
    try:
        sock = await _bind_listeners(running, worker, shared)
    except ListenError:
        await running.stop()  # what did start (the hub, its broker, a listener bound before) stops again
        raise
    return await _serve_http(running, sock, worker, links, hosts, tls)


async def _bind_listeners(running: RunningGateway, worker: int, shared: bool) -> socket.socket:
    """Bind the ingest, the raw TCP ports (worker 0) and the HTTP port; the HTTP socket, not served yet.
    ListenError when one cannot be bound, naming its port and key (docs: README, exit status 2)."""
    config, hub = running.config, running.hub
    server_cfg = config.server
    if config.ingest.enabled:
        running.ingest = IngestServer(IngestParts(config, hub.catalog, hub.tracing, hub.bad_input))
        try:
            await running.ingest.start(config.ingest.host, config.ingest.port, reuse_port=shared)
        except OSError as exc:
            raise listen_error(exc, "ingest", "port", config.ingest.host, config.ingest.port) from None
        running.ingest_port = running.ingest.port
    if config.rawtcp.enabled and worker == 0:
        from core.byte_ring import ByteRingConfig

        from .transports.rawtcp import RawBroadcastServer

        r = config.rawtcp
        raw = RawBroadcastServer(
            ByteRingConfig(
                capacity_bytes=r.capacity_bytes,
                soft_lag_bytes=r.soft_lag_bytes,
                hard_lag_bytes=r.hard_lag_bytes,
                kick_grace_ms=r.kick_grace_ms,
                pause_watermark_pct=r.pause_watermark_pct,
                resume_watermark_pct=r.resume_watermark_pct,
                recv_chunk_bytes=r.recv_chunk_bytes,
                max_receivers=r.max_receivers,
            ),
            token=r.token,
            handshake_timeout=config.server.header_timeout_s,
            sender_idle_timeout=r.sender_idle_timeout_s,
            bad_input=hub.bad_input,
        )
        try:
            await raw.start(r.host, r.sender_port, r.receiver_port)
        except OSError as exc:
            # which of the two: the message of asyncio's bind names the address, ('HOST', PORT) or (... PORT, 0, 0)
            failed = r.receiver_port and re.search(rf", {r.receiver_port}[,)]", str(exc))
            key = "receiver_port" if failed else "sender_port"
            raise listen_error(exc, "rawtcp", key, r.host, getattr(r, key)) from None
        hub.attach_raw(raw)
        assert raw.sender_port is not None and raw.receiver_port is not None  # set by start()
        running.raw_sender_port, running.raw_receiver_port = raw.sender_port, raw.receiver_port
    raise_open_files_limit(server_cfg.max_connections, server_cfg.workers)
    try:
        sock = _listen(server_cfg.host, server_cfg.port, reuse_port=shared)
    except OSError as exc:
        raise listen_error(exc, "server", "port", server_cfg.host, server_cfg.port) from None
    running.http_port = sock.getsockname()[1]
    return sock


async def _serve_http(
    running: RunningGateway,
    sock: socket.socket,
    worker: int,
    links: WorkerLinks | None,
    hosts: HostPolicy,
    tls: tuple[str, str] | None,
) -> RunningGateway:
    """Serve the app on the bound HTTP socket (uvicorn); returns once it has started."""
    config, hub, token = running.config, running.hub, running.admin_token
    server_cfg = config.server
    limiter = ConnectionLimiter(server_cfg.max_connections, server_cfg.max_connections_per_ip, hub.bad_input)
    if links is not None and links.counts is not None:  # per-address limits count across the workers
        links.counts.bind(worker)
        limiter.per_ip = links.counts.counter("connections")
        hub.clients.clients_by_ip = links.counts.counter("clients")
        # the token buckets keyed by address too: one bucket per address across the workers
        limits = config.limits
        hub.creations.rates = links.counts.rate("topic_create", limits.topic_create_rate, limits.topic_create_burst)
        hub.clients.tokens.per_address.rates = links.counts.rate("token_check", config.auth.rate_per_ip, config.auth.burst_per_ip)
    hub.attach_limiter(limiter)
    hub.metrics.add(ws_counters.collect)
    hub.metrics.add(ingest_counters.collect)
    uv_config = uvicorn.Config(
        build_app(hub, token, links),
        http=http_protocol_class(
            limiter, server_cfg.header_timeout_s, server_cfg.max_header_bytes, server_cfg.max_headers, hosts
        ),
        # our WebSocket protocol (gateway/transports/ws.py) takes every upgrade request
        ws=protocol_class(
            hub.services,
            limiter,
            OriginPolicy(parse_allowed_origins(server_cfg.allowed_origins)),
            hub.bad_input,
            centrifugo_endpoint(hub.services),
        ),
        lifespan="off",
        # X-Forwarded-For is not believed (uvicorn would from loopback peers): every per-address limit
        # counts the peer's own address, on every transport alike (docs/security.md, In production)
        proxy_headers=False,
        log_level=server_cfg.log_level,
        # uvicorn's loggers propagate to the root handler (gateway/ops/logformat.py) instead of having their own:
        # their lines then have the time, the worker and the format (json) of every other line
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    running.server = GatewayServer(uv_config)
    running.server.hub = hub
    running.server.ingest = running.ingest
    if links is not None:
        internal_limiter = ConnectionLimiter(server_cfg.max_connections or MAX_FORWARDS_UNLIMITED, 0, hub.bad_input)
        running.server.internal = (
            links.inbox,
            http_protocol_class(
                internal_limiter,
                server_cfg.header_timeout_s,
                server_cfg.max_header_bytes,
                server_cfg.max_headers,
                hosts,
                internal=True,
            ),
        )
    running.task = asyncio.get_running_loop().create_task(running.server.serve(sockets=[sock]))
    while not running.server.started:
        if running.task.done():
            running.task.result()
            raise RuntimeError("uvicorn stopped during start-up")
        await asyncio.sleep(0.01)
    hub.readiness.started = True
    host = server_cfg.host
    log.info(
        "gateway on %s://%s:%d (WebSocket /ws, long-poll /lp, admin /api)", "https" if tls else "http", host, running.http_port
    )
    return running

"""Where a run sends its load: the gateway (ours or one already running), nginx + nchan, or the bare
reference server (loadtest/bare_server.py: the gateway's protocol subset, no scheduler)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote


@dataclass(frozen=True, slots=True)
class Target:
    #: "gateway", "nchan" or "bare" (speaks the gateway's WebSocket and ingest protocol, not its admin API)
    kind: str
    host: str
    http_port: int
    #: the gateway's TCP ingest port (None for nchan, or when publishing through the admin API only)
    ingest_port: int | None = None
    admin_token: str | None = None
    #: root of the server's process tree, for its CPU and RSS (None: unknown, not measured)
    pid: int | None = None
    #: the gateway's Redis broker (``server.workers`` > 1), measured beside the server (None: none)
    broker_pid: int | None = None

    def ws_path(self, topics: list[str]) -> str:
        """Request path of a WebSocket subscriber to ``topics``."""
        if self.kind == "nchan":
            # one connection, several channels: nchan_channel_id_split_delimiter ","
            return "/sub/" + ",".join(quote(t, safe="") for t in topics)
        return "/ws"

    def publish_path(self, topic: str) -> str:
        if self.kind == "nchan":
            return "/pub/" + quote(topic, safe="")
        return f"/api/topics/{quote(topic, safe='')}/publish"

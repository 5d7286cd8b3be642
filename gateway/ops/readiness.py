"""Readiness (`GET /readyz`): whether this process takes new clients now, for a load balancer or Kubernetes.

`/healthz` is liveness (the process answers HTTP: do not restart it); `/readyz` says whether to send it new
clients: 200 while it does, 503 with the reason otherwise (docs/operations.md):

* `starting`: `start_gateway` has not finished (the hub, the broker link and the listeners come up first);
* `draining`: a SIGTERM or SIGINT arrived (set in the signal handler itself, so the very next request sees it;
  the port stays open `server.drain_delay_s` for the balancer to notice, then the drain closes it);
* `broker_unavailable`: Redis ([broker] url or Sentinel's primary) is lost or does not answer its PING in time
  (broker/link.py).

Every worker (`server.workers` > 1) answers for itself: each has its own hub and its own `Readiness`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

STARTING = "starting"
DRAINING = "draining"
BROKER_UNAVAILABLE = "broker_unavailable"


class Readiness:
    def __init__(self, broker_healthy: Callable[[], bool], worker: int = 0) -> None:
        self.broker_healthy = broker_healthy
        #: this process's index among `server.workers` (0 with one), named in the answer
        self.worker = worker
        #: set once `start_gateway` returns
        self.started = False
        #: set by the signal handler (GatewayServer.handle_exit) or `RunningGateway.stop`; never cleared
        self.draining = False

    def reason(self) -> str | None:
        """Why new clients should go elsewhere, or None when they are welcome. A drain outranks the rest:
        it never ends, while a broker outage may."""
        if self.draining:
            return DRAINING
        if not self.started:
            return STARTING
        if not self.broker_healthy():
            return BROKER_UNAVAILABLE
        return None

    def collect(self) -> Iterator[Metric]:
        """`fanout_ready`: 1 while /readyz answers 200, else 0 with the reason as a label (alerting)."""
        reason = self.reason()
        gauge = GaugeMetricFamily(
            "fanout_ready", "1 while GET /readyz answers 200; 0 with the reason otherwise", labels=["reason"]
        )
        gauge.add_metric([reason or ""], 0 if reason else 1)
        yield gauge

    def answer(self) -> tuple[int, dict[str, object]]:
        reason = self.reason()
        body: dict[str, object] = {
            "status": "ready" if reason is None else "unavailable",
            "worker": self.worker,
            "pid": os.getpid(),
        }
        if reason is not None:
            body["reason"] = reason
        return (200 if reason is None else 503), body


async def readyz(request: Request) -> Response:
    readiness: Readiness = request.app.state.hub.readiness
    status, body = readiness.answer()
    # never cached: a proxy in front must ask every time
    return JSONResponse(body, status_code=status, headers={"Cache-Control": "no-store"})

"""fanout_client: everything that talks to a fanout-gateway from Python (docs/client.md).

* `connect` / `Client` / `Subscription`: the asyncio WebSocket client, the twin of static/fanout.js
  (subscribe with exact recovery, publish, rpc, reconnects, token refresh);
* `Message`, `Loss`, `Position`, `FanoutError`: its events and errors;
* `fanout_client.ingest`: the client of the TCP ingest (publishers; the pipeline and the load tool use it).

Nothing is imported eagerly: ``import fanout_client.ingest`` loads this file and the ingest client only, so
Spark executors get by with those two files (pipeline/spark.py ships them) and without the WebSocket
library. The names below are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import Client, ClientState, CloseInfo, Subscription, TokenSource, connect
    from .events import Event, FanoutError, Loss, Message, Position

__all__ = [
    "Client",
    "ClientState",
    "CloseInfo",
    "Event",
    "FanoutError",
    "Loss",
    "Message",
    "Position",
    "Subscription",
    "TokenSource",
    "connect",
]

_WHERE = {
    "Client": "client",
    "ClientState": "client",
    "CloseInfo": "client",
    "Subscription": "client",
    "TokenSource": "client",
    "connect": "client",
    "Event": "events",
    "FanoutError": "events",
    "Loss": "events",
    "Message": "events",
    "Position": "events",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

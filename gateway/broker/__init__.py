"""Where topics live: in this process (`InProcessBroker`, the default) or in Redis shared by several gateway
processes (`RedisBroker`, `[broker] url`). docs/cluster.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Broker, BrokerUnreachable
from .inprocess import InProcessBroker

if TYPE_CHECKING:
    from ..hub import Hub

__all__ = ["Broker", "BrokerUnreachable", "InProcessBroker", "make_broker"]


def make_broker(hub: "Hub") -> Broker:
    if not hub.config.broker.url:
        return InProcessBroker(hub)
    from .redis_broker import RedisBroker  # redis is imported only when a broker is configured

    return RedisBroker(hub)

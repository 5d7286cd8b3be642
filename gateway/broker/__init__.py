"""Where topics live: in this process (`InProcessBroker`, the default) or in Redis shared by several gateway
processes (`RedisBroker`, `[broker] url`). docs/cluster.md."""

from __future__ import annotations

from ..config import GatewayConfig
from ..topic_budget import CreationBudget
from .base import Broker, BrokerEvents, BrokerUnreachable
from .inprocess import InProcessBroker

__all__ = ["Broker", "BrokerEvents", "BrokerUnreachable", "InProcessBroker", "make_broker"]


def make_broker(config: GatewayConfig, events: BrokerEvents, creations: CreationBudget, instance_id: str) -> Broker:
    if not config.broker.url:
        return InProcessBroker(events, instance_id)
    from .redis_broker import RedisBroker  # redis is imported only when a broker is configured

    return RedisBroker(config.broker, events, creations, instance_id)

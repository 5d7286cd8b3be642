"""Where topics live: in this process (`InProcessBroker`, the default) or in Redis shared by several gateway
processes (`RedisBroker`, `[broker] url` or `sentinel_addresses`). docs/cluster.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import GatewayConfig
from ..topic_budget import CreationBudget
from .base import Broker, BrokerEvents, BrokerUnreachable
from .inprocess import InProcessBroker

__all__ = ["Broker", "BrokerEvents", "BrokerUnreachable", "InProcessBroker", "make_broker"]


def make_broker(
    config: GatewayConfig,
    events: BrokerEvents,
    creations: CreationBudget,
    instance_id: str,
    control: Callable[[dict[str, Any]], dict[str, Any]],
    node_summary: Callable[[bool], dict[str, Any] | None],
) -> Broker:
    """`control`: runs an operator's control command on this node (`Broker.control`); `node_summary`: this
    node's client summary for the other nodes' stats streams (`Broker.node_summary`)."""
    if not config.broker.configured:
        return InProcessBroker(events, instance_id, control, node_summary)
    from .redis_broker import RedisBroker  # redis is imported only when a broker is configured

    return RedisBroker(config.broker, events, creations, instance_id, control, node_summary)

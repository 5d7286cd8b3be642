"""What every method of the Centrifugo server API works with: the hub, and the API's own state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..hub import Hub
from .idempotency import IdempotentPublishes


@dataclass
class ApiContext:
    hub: Hub
    #: when the routes were made (the node's `uptime` in `info`)
    started: float = field(default_factory=time.monotonic)
    #: the results of publishes with an `idempotency_key`, for their retries
    idempotent: IdempotentPublishes = field(default_factory=IdempotentPublishes)

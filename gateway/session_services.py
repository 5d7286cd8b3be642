"""What a client connection reaches of the rest of the gateway, in one object built once by the hub: the
session (gateway/session.py), the commands of both client protocols (gateway/commands.py,
gateway/centrifugo/) and the client transports get this and no `Hub`, as centrifuge's `Client` gets its
`Node`. A fake of it drives a session with no gateway around it (tests/gateway/test_protocol_seam.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .catalog import TopicCatalog
    from .client_protocol import CommandRunner
    from .clients import ClientRegistry
    from .config import GatewayConfig
    from .edge.ratelog import BadInputLog
    from .hooks.base import Hooks
    from .ops.tracing import Tracing
    from .presence import Presence, PresenceStore
    from .scheduler import Scheduler
    from .session_store import SessionStore
    from .topic_view import TopicView


class SessionServices:
    """The one door from a connection to the gateway (module docstring). One per hub; read-only after."""

    __slots__ = (
        "config",
        "clients",
        "catalog",
        "hooks",
        "topics",
        "presence",
        "members",
        "scheduler",
        "sessions",
        "tracing",
        "bad_input",
        "commands",
    )

    def __init__(
        self,
        *,
        config: GatewayConfig,
        clients: ClientRegistry,
        catalog: TopicCatalog,
        hooks: Hooks,
        topics: TopicView,
        presence: PresenceStore,
        members: Presence,
        scheduler: Scheduler,
        sessions: SessionStore,
        tracing: Tracing,
        bad_input: BadInputLog,
        commands: CommandRunner,
    ) -> None:
        self.config = config
        #: the registry: registration, kicks, the direct queue, tokens, the per-address counts
        self.clients = clients
        #: every subscribe, unsubscribe and publish of a client (gateway/catalog.py)
        self.catalog = catalog
        #: the backend hooks (gateway/hooks/base.py)
        self.hooks = hooks
        #: the engine, read-only (gateway/topic_view.py)
        self.topics = topics
        #: the presence members, read for `presence` and `presence_stats` (this process's, or Redis's)
        self.presence = presence
        #: this process's presence tracker: where a subscription declines join/leave entries
        self.members = members
        #: the rounds' staging and the write state of the connections (gateway/scheduler.py)
        self.scheduler = scheduler
        #: long-poll sessions and SSE streams by their secret (gateway/session_store.py)
        self.sessions = sessions
        self.tracing = tracing
        #: the bounded log of refused client input, per transport
        self.bad_input = bad_input
        #: what runs the client's commands (gateway/commands.py): handed in, since commands read the session
        self.commands = commands

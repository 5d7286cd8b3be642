"""The backend hooks as one interface (docs/integration.md "Backend hooks"): what the gateway asks of, and
tells, the application. The hub always holds a `Hooks`: gateway/hooks/backend.py's `HttpHooks` (POSTs to the `[proxy]`
URLs) when one is set, else `NoHooks`, which allows everything at once. A call site asks its question
(`asks_subscribe`, `wants_connect`, ...) instead of checking for a missing proxy.

A hook's answer is one of: a grant / an allowance, `Refused` (the backend's `error`), or `BackendUnavailable`
(gateway/errors.py). The callers (gateway/transports/*, commands.py, clients.py, catalog.py) turn those into
the client's answer; the hooks know no connection and no hub.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Protocol, TypeVar

import msgspec
from prometheus_client.core import Metric

from ..auth.identity import ClientIdentity

T = TypeVar("T")


class Refused(Exception):
    """The backend answered `{"error": {"code": C, "message": M}}`."""

    def __init__(self, code: object, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Allowed(msgspec.Struct, frozen=True):
    """The subscribe hook's allowance, and an event's acknowledgement: `{}`."""


class PublishAnswer(msgspec.Struct, frozen=True):
    """The publish hook's answer: `{}` keeps the data, `{"data": NEW}` replaces it."""

    data: Any = msgspec.UNSET


class RpcAnswer(msgspec.Struct, frozen=True):
    result: Any = None


def client_body(identity: ClientIdentity, **more: Any) -> dict[str, Any]:
    """What every per-client call says of the client: its id, user (null: anonymous) and transport."""
    return {"client": identity.client_id, "user": identity.user, "transport": identity.transport, **more}


class Hooks(Protocol):
    """The verbs and questions of the backend hooks the gateway uses."""

    # -- which hooks are set ---------------------------------------------------------------------------

    @property
    def asks_subscribe(self) -> bool:
        """A `proxy_subscribe` topic's subscriptions wait for the subscribe hook."""

    @property
    def asks_publish(self) -> bool:
        """A `proxy_publish` topic's publications wait for the publish hook."""

    @property
    def answers_rpc(self) -> bool:
        """rpc methods the gateway does not know go to the rpc hook."""

    @property
    def refreshes(self) -> bool:
        """A connection the connect hook granted is extended by the refresh hook before it expires."""

    @property
    def retry_after(self) -> dict[str, str]:
        """`Retry-After` of the HTTP answers (POST /lp, GET /sse) to a client the hooks turned away for now."""

    def wants_connect(self, identity: ClientIdentity) -> bool:
        """Whether this new client must pass the connect hook (`connect`) before it is registered."""

    # -- asks ------------------------------------------------------------------------------------------

    async def connect(self, identity: ClientIdentity, header_values: Callable[[str], list[str]]) -> tuple[str, ...]:
        """Admit a new client, applying the grant to `identity`; returns the server-side subscriptions it
        grants (made as the client's session opens). Raises ConnectRefused, BackendUnavailable."""

    async def call(self, hook: str, body: dict[str, Any], answer: type[T]) -> T:
        """Ask `hook` with `body`; its answer as `answer`. Raises Refused, BackendUnavailable."""

    def body(self, identity: ClientIdentity, **more: Any) -> dict[str, Any]:
        """A per-client call's body (`client_body`)."""

    async def refresh(self, identity: ClientIdentity) -> float:
        """The new expiry of a granted connection. Raises Refused, BackendUnavailable."""

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        """Run a call for a connection or a command in the background (cancelled by `aclose`)."""

    # -- events ----------------------------------------------------------------------------------------

    def disconnected(self, identity: ClientIdentity, reason: str) -> None:
        """A registered (or admitted) client is gone; `reason`: the /metrics disconnect reason."""

    def unsubscribed(self, identity: ClientIdentity, topic: str) -> None:
        """An explicit `unsubscribe` (those a disconnect ends are covered by `disconnected`)."""

    def pending(self, hook: str) -> int:
        """Events of `hook` waiting to be sent."""

    # -- lifecycle, metrics ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """At shutdown, after the clients' disconnect events were queued."""

    def collect(self) -> Iterator[Metric]:
        """The /metrics families."""


class NoHooks:
    """No hook URL set: every client is admitted as it came, every command allowed at once, no event sent."""

    asks_subscribe = False
    asks_publish = False
    answers_rpc = False
    refreshes = False

    def __init__(self) -> None:
        #: never sent: without hooks no client is turned away for them; the session bounds' figure all the same
        self.retry_after = {"Retry-After": "5"}
        #: tasks `spawn` started (none, as nothing asks a hook), kept so they are not collected
        self._tasks: set[asyncio.Task[Any]] = set()

    def wants_connect(self, identity: ClientIdentity) -> bool:
        return False

    async def connect(self, identity: ClientIdentity, header_values: Callable[[str], list[str]]) -> tuple[str, ...]:
        return ()

    async def call(self, hook: str, body: dict[str, Any], answer: type[T]) -> T:
        """The allowance `{}`: a command goes through as the client sent it."""
        return msgspec.convert({}, answer)

    def body(self, identity: ClientIdentity, **more: Any) -> dict[str, Any]:
        return client_body(identity, **more)

    async def refresh(self, identity: ClientIdentity) -> float:
        return math.inf

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def disconnected(self, identity: ClientIdentity, reason: str) -> None:
        return None

    def unsubscribed(self, identity: ClientIdentity, topic: str) -> None:
        return None

    def pending(self, hook: str) -> int:
        return 0

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()

    def collect(self) -> Iterator[Metric]:
        return iter(())

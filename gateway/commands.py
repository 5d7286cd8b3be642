"""Client commands (WebSocket frames, long-poll POST bodies): parse, check, and call the hub.

Every command is converted to its schema (gateway/schema.py) before anything runs. Every answer (ack,
reply, error) goes through the client's direct queue, so it is ordered with the data and batched like it.
A bad command gets an `error` entry; the connection and every other client go on. What a client may do is
asked of its `ClientIdentity` (gateway/auth/identity.py), the one place permissions live.

A command that asks a backend hook (gateway/hooks/base.py) is answered later; a connection's commands still take
effect in the order sent per topic: one naming a topic on which a hooked command of the same connection is
pending waits behind it (`_wait_behind`, `_resume`). Hook calls in flight and commands waiting behind them
are bounded per connection (`proxy.max_calls_per_connection`, `_hold`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec
import orjson

from core import TopicConfig, TopicKind
from core.config import MAX_SEQ
from core.entries import encode_reply
from core.errors import DirectQueueFull, RequestError, UnknownTopic

from . import close_codes, schema
from .auth.identity import ClientIdentity
from .edge.ratelog import TokenBucket
from .errors import BadCommand, BadJson, Forbidden, RateLimited, RpcError, TooManyCalls, UnknownMethod
from .hooks.base import Allowed, PublishAnswer, Refused, RpcAnswer

if TYPE_CHECKING:
    from .hub import Hub

log = logging.getLogger("gateway.commands")

#: `rpc topics` lists at most this many topics (the first created the caller may subscribe to): its reply,
#: and the work of one call, stay bounded however many topics there are (the admin API lists them all)
RPC_TOPICS_MAX = 1000
#: the rpc methods the gateway answers itself; others go to the backend's rpc hook when one is set
BUILTIN_METHODS = frozenset(("echo", "time", "whoami", "topics"))
#: the commands that name a topic: one waits while a hooked command of its connection on that topic is pending
TOPIC_COMMANDS = (schema.Subscribe, schema.Unsubscribe, schema.Publish, schema.Ack, schema.Presence,
                  schema.PresenceStats)

T = TypeVar("T")


class CommandSession(Protocol):
    """What the commands need of a client's session (gateway/session.py `ClientSession`): who the client
    is, and the hub its commands act on."""

    @property
    def identity(self) -> ClientIdentity: ...

    @property
    def hub(self) -> Hub: ...


def parse_commands(payload: bytes | str) -> list[Any]:
    """The JSON values of one frame: one object, or an array of at most 100. Raises BadJson / BadCommand."""
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise BadJson(f"not JSON: {exc}") from None
    values = doc if isinstance(doc, list) else [doc]
    if len(values) > schema.MAX_COMMANDS_PER_FRAME:
        raise BadCommand(f"at most {schema.MAX_COMMANDS_PER_FRAME} commands per frame")
    return values


def _topic_config(hub: "Hub", name: str) -> TopicConfig:
    config = hub.topics.topic_config(name)
    if config is None:
        raise UnknownTopic(f"no topic {name!r} and no rule creates it")
    return config


def _rule_of(hub: "Hub", name: str, config: TopicConfig) -> str:
    """Where a refused topic's settings come from, for the refusal's message: its rule, or its own settings
    (a topic created through the admin API with settings of its own)."""
    for rule in hub.topics.config.rules:
        if rule.matches(name):
            if rule.config == config:
                return f"topic rule {rule.pattern!r}"
            break
    return f"topic {name!r} (created with its own settings)"


def _check_subscribe(hub: "Hub", identity: ClientIdentity, name: str, config: TopicConfig) -> None:
    """Forbidden, saying which rule and which patterns refused, when the client may not subscribe."""
    reason = identity.subscribe_refusal(name, config)
    if reason is not None:
        raise Forbidden(f"not allowed to subscribe to {name!r}: {_rule_of(hub, name, config)} {reason}")


def _check_publish(hub: "Hub", identity: ClientIdentity, name: str, config: TopicConfig) -> None:
    reason = identity.publish_refusal(name, config)
    if reason is not None:
        raise Forbidden(f"not allowed to publish to {name!r}: {_rule_of(hub, name, config)} {reason}")


def _subscribe(hub: "Hub", identity: ClientIdentity, command: schema.Subscribe) -> None:
    name = command.topic
    since = None
    if command.since is not None:
        if not 0 <= command.since.seq < MAX_SEQ:
            raise BadCommand("`since.seq` must be in [0, 2**53)")
        since = (command.since.epoch, command.since.seq)
    config = _topic_config(hub, name)
    _check_subscribe(hub, identity, name, config)
    ack = command.ack and config.kind is TopicKind.PRIVATE  # shared kinds have no queue to keep: ignored
    delta = None if command.delta is None else True  # granted where the topic allows (`subscribed` says)
    if config.proxy_subscribe and hub.hooks.asks_subscribe:
        asked = {"topic": name} if command.data is msgspec.UNSET else {"topic": name, "data": command.data}
        _ask_backend(hub, identity, "subscribe", asked, Allowed, command.id,
                     lambda _: _subscribe_now(hub, identity, name, since, command.id, ack, delta), topic=name)
        return
    _subscribe_now(hub, identity, name, since, command.id, ack, delta)


def _subscribe_now(hub: "Hub", identity: ClientIdentity, name: str, since: tuple[str, int] | None,
                   request_id: Any, ack: bool = False, delta: bool | None = None) -> None:
    hub.catalog.subscribe(identity.client_id, name, since=since, request_id=request_id, ack=ack, delta=delta)


def _ack(hub: "Hub", identity: ClientIdentity, command: schema.Ack) -> None:
    """Commit the entries of an acknowledged private subscription up to `seq` (docs/design/private-queues.md
    §9). No answer unless the command has an `id`: then a reply with the first seq still queued."""
    if not 0 <= command.seq < MAX_SEQ:
        raise BadCommand("`seq` must be in [0, 2**53)")
    head = hub.catalog.ack(identity.client_id, command.topic, command.seq)
    if command.id is not None:
        hub.clients.send_direct(identity.client_id, encode_reply(command.id, {"topic": command.topic, "head": head}))


def _publish(hub: "Hub", identity: ClientIdentity, command: schema.Publish) -> None:
    name = command.topic
    config = _topic_config(hub, name)
    _check_publish(hub, identity, name, config)
    bucket = identity.publish_bucket
    if bucket is None:
        limits = hub.config.limits
        bucket = identity.publish_bucket = TokenBucket(limits.publish_rate, limits.publish_burst)
    if not bucket.take():
        raise RateLimited(f"publish rate above {hub.config.limits.publish_rate:g}/s")
    if config.proxy_publish and hub.hooks.asks_publish:
        def publish(answer: PublishAnswer) -> None:
            data = command.data if answer.data is msgspec.UNSET else answer.data
            _publish_now(hub, identity, name, data, command.id)
        _ask_backend(hub, identity, "publish", {"topic": name, "data": command.data}, PublishAnswer, command.id,
                     publish, topic=name)
        return
    _publish_now(hub, identity, name, command.data, command.id)


def _publish_now(hub: "Hub", identity: ClientIdentity, name: str, data: Any, request_id: Any) -> None:
    hub.catalog.publish_reply(identity.client_id, name, data, request_id)  # the reply, now or from the broker


def _ask_backend(hub: "Hub", identity: ClientIdentity, hook: str, extra: dict[str, Any], answer: type[T],
                 request_id: Any, then: Callable[[T], None], *, topic: str | None = None) -> None:
    """A command that waits for a backend hook (gateway/hooks/base.py): `then(answer)` runs once the backend
    allowed it, if the client is still connected. A refusal is the command's `forbidden` error entry (rpc:
    `rpc_error`), no answer `backend_unavailable`. Answers of later commands may come first (match the ids),
    except those on the same `topic`: they wait behind this one (`_wait_behind`). Raises TooManyCalls when
    the connection is at `proxy.max_calls_per_connection`."""
    hooks = hub.hooks
    client_id = identity.client_id
    _hold(hub, identity)
    if topic is not None:
        if identity.waiting is None:
            identity.waiting = {}
        identity.waiting[topic] = deque()

    async def ask() -> None:
        try:
            tracing = hub.tracing
            if tracing is None:
                await answered()
            else:  # the command is a trace of its own, its hook call beneath (gateway/ops/tracing.py)
                with tracing.root_span(f"command {hook}", {"fanout.client": str(client_id), "fanout.topic": topic or ""}):
                    await answered()
        finally:
            identity.hook_calls -= 1
        if topic is not None:
            try:
                _resume(hub, identity, topic)
            except Exception:
                _failed(hub, client_id, f"a command waiting behind a {hook} call")

    async def answered() -> None:
        try:
            try:
                got = await hooks.call(hook, hooks.body(identity, **extra), answer)
            except Refused as exc:
                if hook == "rpc":
                    code = "" if exc.code is None else f"{exc.code}: "
                    raise RpcError(f"{code}{exc.message}") from None
                raise Forbidden(exc.message or f"{hook} refused by the backend") from None
            if client_id in hub.clients.conns:
                then(got)
        except RequestError as exc:
            if client_id in hub.clients.conns:
                _refused(hub, client_id, exc, request_id)
        except Exception:
            _failed(hub, client_id, f"{hook} through the backend")

    hooks.spawn(ask())


def _failed(hub: "Hub", client_id: str, what: str) -> None:
    """A bug in a command run after its hook answered: logged, and the client closed (1011)."""
    log.exception("%s of %s failed", what, client_id)
    if client_id in hub.clients.conns:
        hub.clients.kick(client_id, close_codes.INTERNAL_ERROR, "internal error", "error")


def _hold(hub: "Hub", identity: ClientIdentity) -> None:
    """Count one more command of the connection waiting for the backend, or raise TooManyCalls: a connection
    holds at most `proxy.max_calls_per_connection` hook slots and queued commands (and their memory)."""
    bound = hub.config.proxy.max_calls_per_connection
    if identity.hook_calls >= bound:
        raise TooManyCalls(f"{bound} commands of this connection already wait for the backend"
                           " (proxy.max_calls_per_connection)")
    identity.hook_calls += 1


def _wait_behind(hub: "Hub", identity: ClientIdentity, command: schema.Command) -> bool:
    """Whether `command` names a topic on which a hooked command of the connection is pending: it is then
    queued behind it (and counted in the connection's bound), so it takes effect after it."""
    waiting = identity.waiting
    if not waiting or not isinstance(command, TOPIC_COMMANDS):
        return False
    queue = waiting.get(command.topic)
    if queue is None:
        return False
    _hold(hub, identity)
    queue.append(command)
    return True


def _resume(hub: "Hub", identity: ClientIdentity, topic: str) -> None:
    """The hooked command on `topic` is answered: run the commands that waited behind it, in order, until
    one of them waits for the backend in turn (the rest then wait behind that one)."""
    waiting = identity.waiting
    assert waiting is not None
    queue = waiting.pop(topic)
    client_id = identity.client_id
    while queue and client_id in hub.clients.conns:  # else gone, or cut by one of them
        command = queue.popleft()
        identity.hook_calls -= 1  # its place in the bound goes to the call it may make now
        try:
            _run(hub, identity, command)
        except RequestError as exc:
            _refused(hub, client_id, exc, command.id)
        if topic in waiting:
            waiting[topic].extend(queue)
            return


def _count_subscribe(hub: "Hub", identity: ClientIdentity) -> None:
    """A subscribe or unsubscribe takes a token of the connection's bucket (`limits.subscribe_rate`,
    `subscribe_burst`): each may cost every member of a topic a join or leave entry; RateLimited past it."""
    bucket = identity.subscribe_bucket
    if bucket is None:
        limits = hub.config.limits
        bucket = identity.subscribe_bucket = TokenBucket(limits.subscribe_rate, limits.subscribe_burst)
    if not bucket.take():
        raise RateLimited(f"subscribe/unsubscribe above {hub.config.limits.subscribe_rate:g}/s on this connection"
                          " (limits.subscribe_rate)")


def _costly(hub: "Hub", identity: ClientIdentity, what: str) -> None:
    """A command that costs CPU (`auth`: a signature check; `rpc topics`: a walk of the topics) takes a token
    of the connection's bucket (`auth.rate_per_connection`, `burst_per_connection`); RateLimited past it."""
    auth = hub.config.auth
    if auth.rate_per_connection <= 0:
        return
    bucket = identity.costly_bucket
    if bucket is None:
        bucket = identity.costly_bucket = TokenBucket(auth.rate_per_connection, auth.burst_per_connection)
    if not bucket.take():
        raise RateLimited(f"`{what}` above {auth.rate_per_connection:g}/s on this connection"
                          " (auth.rate_per_connection)")


def _presence_topic(hub: "Hub", identity: ClientIdentity, name: str) -> None:
    """Who may ask a topic's presence: whoever may subscribe to it, on a topic with `presence`."""
    config = _topic_config(hub, name)
    _check_subscribe(hub, identity, name, config)
    if not config.presence:
        raise Forbidden(f"topic {name!r} has no presence (topic setting `presence`)")


def _presence(hub: "Hub", identity: ClientIdentity, command: schema.Presence | schema.PresenceStats) -> None:
    """`presence` (members, counts only above limits.presence_max_members) or `presence_stats` (counts): the
    reply comes now (one process) or once the broker has read Redis."""
    name = command.topic
    _presence_topic(hub, identity, name)
    with_members = isinstance(command, schema.Presence)
    if with_members:
        _costly(hub, identity, "presence")
    client_id, request_id = identity.client_id, command.id
    future = hub.broker.presence.view(name, hub.config.limits.presence_max_members)

    hub.clients.reply_when_done(client_id, request_id, future,
                                lambda view: view.as_dict(with_members=with_members), "presence")


def _rpc(hub: "Hub", identity: ClientIdentity, method: str, params: Any) -> Any:
    if method == "echo":
        try:
            orjson.dumps(params)
        except TypeError as exc:  # nested deeper than the encoder writes
            raise BadCommand(f"`params` cannot be encoded: {exc}") from None
        return params
    if method == "time":
        return time.time_ns()
    if method == "whoami":
        return {"client_id": identity.client_id, "transport": identity.transport, "user": identity.user}
    if method == "topics":
        _costly(hub, identity, "rpc topics")
        listed = []
        for t in hub.topics.topics():
            if identity.may_subscribe(t.name, t.config):
                listed.append({"name": t.name, "kind": t.kind, "epoch": t.epoch})
                if len(listed) == RPC_TOPICS_MAX:
                    break
        return listed
    raise UnknownMethod(f"no rpc method {method[:64]!r}")


def _run(hub: "Hub", identity: ClientIdentity, command: schema.Command) -> None:
    client_id = identity.client_id
    if isinstance(command, schema.Subscribe):
        _subscribe(hub, identity, command)
    elif isinstance(command, schema.Ack):
        _ack(hub, identity, command)
    elif isinstance(command, schema.Unsubscribe):
        hub.catalog.unsubscribe(client_id, command.topic, request_id=command.id)
    elif isinstance(command, schema.Publish):
        _publish(hub, identity, command)
    elif isinstance(command, schema.Auth):
        _costly(hub, identity, "auth")
        hub.clients.tokens.admit(identity.ip)  # per address, whatever carries the token (gateway/auth/tokens.py)
        principal = hub.clients.authenticate(client_id, command.token)
        hub.clients.send_direct(client_id, encode_reply(command.id, {"user": principal.user,
                                                             "expires_at": principal.expires_at}))
    elif isinstance(command, (schema.Presence, schema.PresenceStats)):
        _presence(hub, identity, command)
    elif isinstance(command, schema.Rpc):
        if hub.hooks.answers_rpc and command.method not in BUILTIN_METHODS:
            def reply(answer: RpcAnswer) -> None:
                hub.clients.send_direct(client_id, encode_reply(command.id, answer.result))
            _ask_backend(hub, identity, "rpc", {"method": command.method, "params": command.params}, RpcAnswer,
                         command.id, reply)
            return
        hub.clients.send_direct(client_id, encode_reply(command.id, _rpc(hub, identity, command.method, command.params)))
    else:  # schema.Ping: the union is closed
        hub.clients.send_direct(client_id, encode_reply(command.id, "pong"))


def run_command(session: CommandSession, value: Any, *, sent: bool = False) -> None:
    """Convert one parsed command of `session`'s client and run it, or queue it behind a hooked command on
    its topic; any refusal is answered with an `error` entry. `sent`: the client sent it (a frame, a body),
    so a subscribe counts against `limits.subscribe_rate`; the topics an SSE stream opens with come in one
    request, bounded by `scheduler.max_subscriptions`, and are not counted."""
    _run_value(session.hub, session.identity, value, sent)


def _run_value(hub: "Hub", identity: ClientIdentity, value: Any, sent: bool) -> None:
    client_id = identity.client_id
    identity.last_command = time.monotonic()
    request_id = schema.request_id_of(value)
    try:
        command = schema.command(value)
        if sent and isinstance(command, (schema.Subscribe, schema.Unsubscribe)):
            if isinstance(command, schema.Subscribe):  # at its cap: that is the answer, and it costs no token
                hub.catalog.check_room(client_id, command.topic)
            _count_subscribe(hub, identity)
        if not _wait_behind(hub, identity, command):
            _run(hub, identity, command)
    except RequestError as exc:
        _refused(hub, client_id, exc, request_id)


def _refused(hub: "Hub", client_id: str, exc: RequestError, request_id: Any) -> None:
    if isinstance(exc, DirectQueueFull):  # the client does not read its replies
        hub.clients.kick(client_id, close_codes.DIRECT_OVERFLOW, "direct queue overflow", exc.code)
    else:
        hub.clients.send_error(client_id, exc, request_id)


def handle(session: CommandSession, payload: bytes | str) -> int:
    """Run every command of one message of `session`'s client (a frame, a body: our JSON protocol, one
    object or an array). Returns how many were run."""
    return _handle(session.hub, session.identity, payload)


def handle_payload(hub: "Hub", client_id: str, payload: bytes | str) -> int:
    """`handle` for a registered client named by its id (0 when it is not registered)."""
    conn = hub.clients.conns.get(client_id)
    return 0 if conn is None else _handle(hub, conn.identity, payload)


def _handle(hub: "Hub", identity: ClientIdentity, payload: bytes | str) -> int:
    client_id = identity.client_id
    try:
        values = parse_commands(payload)
    except RequestError as exc:
        hub.clients.send_error(client_id, exc)
        return 0
    for value in values:
        if client_id not in hub.clients.conns:
            break  # kicked by an earlier command of the same frame
        _run_value(hub, identity, value, True)
    return len(values)

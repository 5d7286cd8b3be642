"""Client commands, whichever protocol read them (gateway/client_protocol.py): check, and act, over the
client's session (gateway/session.py), as centrifuge's `Client` methods.

A protocol decodes a message into the typed commands of gateway/schema.py; `run(session, command)` runs one.
Every answer (ack, reply, error) goes through the client's direct queue (`session.reply`, `session.refuse`),
so it is ordered with the data and batched like it. A bad command gets an `error` entry; the connection and
every other client go on. What a client may do is asked of its `ClientIdentity` (gateway/auth/identity.py),
the one place permissions live; what it spent (its rate buckets, its hook calls) is its session's state.

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
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import orjson

from core import TopicConfig, TopicKind
from core.config import MAX_SEQ
from core.errors import RequestError, UnknownTopic

from . import close_codes, schema
from .client_protocol import Decoded, Subscribing, Unread
from .edge.ratelog import TokenBucket
from .errors import BadCommand, Forbidden, RateLimited, RpcError, TooManyCalls, UnknownMethod
from .hooks.base import Allowed, PublishAnswer, Refused, RpcAnswer

if TYPE_CHECKING:
    from .session import ClientSession
    from .session_services import SessionServices

log = logging.getLogger("gateway.commands")

#: `rpc topics` lists at most this many topics (the first created the caller may subscribe to): its reply,
#: and the work of one call, stay bounded however many topics there are (the admin API lists them all)
RPC_TOPICS_MAX = 1000
#: the rpc methods the gateway answers itself; others go to the backend's rpc hook when one is set
BUILTIN_METHODS = frozenset(("echo", "time", "whoami", "topics"))
#: the commands that name a topic: one waits while a hooked command of its connection on that topic is pending
TOPIC_COMMANDS = (schema.Subscribe, schema.Unsubscribe, schema.Publish, schema.Ack, schema.Presence, schema.PresenceStats)

T = TypeVar("T")


# -- running ---------------------------------------------------------------------------------------------------


def handle(session: ClientSession, payload: bytes | str) -> int:
    """Run every command of one message of `session`'s client, as its protocol reads it (ours: JSON, one
    object or an array). Returns how many it held."""
    try:
        decoded = session.protocol.decode(payload)
    except RequestError as exc:
        session.send_error(exc)
        return 0
    for command in decoded:
        if not session.live:
            break  # kicked by an earlier command of the same message
        run_decoded(session, command, sent=True)
    return len(decoded)


def run_decoded(session: ClientSession, command: Decoded, *, sent: bool = False) -> None:
    """`run` for a command as a protocol read it: one it could not read is answered with its error entry."""
    if isinstance(command, Unread):
        session.state.last_command = time.monotonic()
        session.refuse(command.error, command.request_id)
    else:
        run(session, command, sent=sent)


def run(session: ClientSession, command: schema.Command, *, sent: bool = False) -> None:
    """Run one command of `session`'s client, or queue it behind a hooked command on its topic; any refusal
    is answered with an `error` entry. `sent`: the client sent it (a frame, a body), so a subscribe counts
    against `limits.subscribe_rate`; the topics an SSE stream opens with come in one request, bounded by
    `scheduler.max_subscriptions`, and are not counted."""
    session.state.last_command = time.monotonic()
    try:
        if sent and isinstance(command, (schema.Subscribe, schema.Unsubscribe)):
            if isinstance(command, schema.Subscribe):  # at its cap: that is the answer, and it costs no token
                session.services.catalog.check_room(session.identity.client_id, command.topic)
            _count_subscribe(session)
        if not _wait_behind(session, command):
            _run(session, command)
    except RequestError as exc:
        session.refuse(exc, command.id)


def _run(session: ClientSession, command: schema.Command) -> None:
    services = session.services
    if isinstance(command, schema.Subscribe):
        _subscribe(session, command)
    elif isinstance(command, schema.Ack):
        _ack(session, command)
    elif isinstance(command, schema.Unsubscribe):
        services.catalog.unsubscribe(session.identity.client_id, command.topic, request_id=command.id)
    elif isinstance(command, schema.Publish):
        _publish(session, command)
    elif isinstance(command, schema.Auth):
        _costly(session, "auth")
        tokens = services.clients.tokens
        tokens.admit(session.identity.ip)  # per address, whatever carries the token (gateway/auth/tokens.py)
        principal = session.authenticate(tokens.verify(command.token))
        session.reply(command.id, {"user": principal.user, "expires_at": principal.expires_at})
    elif isinstance(command, (schema.Presence, schema.PresenceStats)):
        _presence(session, command)
    elif isinstance(command, schema.Rpc):
        if services.hooks.answers_rpc and command.method not in BUILTIN_METHODS:
            _ask_backend(
                session,
                "rpc",
                {"method": command.method, "params": command.params},
                RpcAnswer,
                command.id,
                lambda answer: session.reply(command.id, answer.result),
            )
            return
        session.reply(command.id, _rpc(session, command.method, command.params))
    else:  # schema.Ping: the union is closed
        session.reply(command.id, "pong")


# -- checks ------------------------------------------------------------------------------------------------------


def _topic_config(services: SessionServices, name: str) -> TopicConfig:
    config = services.topics.topic_config(name)
    if config is None:
        raise UnknownTopic(f"no topic {name!r} and no rule creates it")
    return config


def _rule_of(services: SessionServices, name: str, config: TopicConfig) -> str:
    """Where a refused topic's settings come from, for the refusal's message: its rule, or its own settings
    (a topic created through the admin API with settings of its own)."""
    for rule in services.topics.config.rules:
        if rule.matches(name):
            if rule.config == config:
                return f"topic rule {rule.pattern!r}"
            break
    return f"topic {name!r} (created with its own settings)"


def _check_subscribe(session: ClientSession, name: str, config: TopicConfig) -> None:
    """Forbidden, saying which rule and which patterns refused, when the client may not subscribe."""
    reason = session.identity.subscribe_refusal(name, config)
    if reason is not None:
        raise Forbidden(f"not allowed to subscribe to {name!r}: {_rule_of(session.services, name, config)} {reason}")


def _check_publish(session: ClientSession, name: str, config: TopicConfig) -> None:
    reason = session.identity.publish_refusal(name, config)
    if reason is not None:
        raise Forbidden(f"not allowed to publish to {name!r}: {_rule_of(session.services, name, config)} {reason}")


def _count_subscribe(session: ClientSession) -> None:
    """A subscribe or unsubscribe takes a token of the connection's bucket (`limits.subscribe_rate`,
    `subscribe_burst`): each may cost every member of a topic a join or leave entry; RateLimited past it."""
    state = session.state
    bucket = state.subscribe_bucket
    limits = session.services.config.limits
    if bucket is None:
        bucket = state.subscribe_bucket = TokenBucket(limits.subscribe_rate, limits.subscribe_burst)
    if not bucket.take():
        raise RateLimited(f"subscribe/unsubscribe above {limits.subscribe_rate:g}/s on this connection (limits.subscribe_rate)")


def _costly(session: ClientSession, what: str) -> None:
    """A command that costs CPU (`auth`: a signature check; `rpc topics`: a walk of the topics) takes a token
    of the connection's bucket (`auth.rate_per_connection`, `burst_per_connection`); RateLimited past it."""
    auth = session.services.config.auth
    if auth.rate_per_connection <= 0:
        return
    state = session.state
    bucket = state.costly_bucket
    if bucket is None:
        bucket = state.costly_bucket = TokenBucket(auth.rate_per_connection, auth.burst_per_connection)
    if not bucket.take():
        raise RateLimited(f"`{what}` above {auth.rate_per_connection:g}/s on this connection (auth.rate_per_connection)")


# -- the commands ------------------------------------------------------------------------------------------------


def _subscribe(session: ClientSession, command: schema.Subscribe) -> None:
    services = session.services
    name = command.topic
    since = None
    if command.since is not None:
        if not 0 <= command.since.seq < MAX_SEQ:
            raise BadCommand("`since.seq` must be in [0, 2**53)")
        since = (command.since.epoch, command.since.seq)
    config = _topic_config(services, name)
    _check_subscribe(session, name, config)
    if isinstance(command, Subscribing):
        _choose_join_leave(session, name, config.join_leave and not command.join_leave)
    ack = command.ack and config.kind is TopicKind.PRIVATE  # shared kinds have no queue to keep: ignored
    delta = None if command.delta is None else True  # granted where the topic allows (`subscribed` says)
    if config.proxy_subscribe and services.hooks.asks_subscribe:
        asked = {"topic": name} if command.data is msgspec.UNSET else {"topic": name, "data": command.data}
        _ask_backend(
            session,
            "subscribe",
            asked,
            Allowed,
            command.id,
            lambda _: _subscribe_now(session, name, since, command.id, ack, delta),
            topic=name,
        )
        return
    _subscribe_now(session, name, since, command.id, ack, delta)


def _choose_join_leave(session: ClientSession, name: str, declined: bool) -> None:
    """A subscription that declines join/leave entries (`Subscribing.join_leave`) is told so where they are
    queued (gateway/presence.py); the choice is made again by each subscribe, not for a topic it holds."""
    services, client_id = session.services, session.identity.client_id
    if name not in services.topics.client(client_id).subs:
        services.members.decline_join_leave(client_id, name, declined, services.config.scheduler.max_subscriptions)


def _subscribe_now(
    session: ClientSession,
    name: str,
    since: tuple[str, int] | None,
    request_id: Any,
    ack: bool = False,
    delta: bool | None = None,
) -> None:
    session.services.catalog.subscribe(session.identity.client_id, name, since=since, request_id=request_id, ack=ack, delta=delta)


def _ack(session: ClientSession, command: schema.Ack) -> None:
    """Commit the entries of an acknowledged private subscription up to `seq` (docs/design/private-queues.md
    §9). No answer unless the command has an `id`: then a reply with the first seq still queued."""
    if not 0 <= command.seq < MAX_SEQ:
        raise BadCommand("`seq` must be in [0, 2**53)")
    head = session.services.catalog.ack(session.identity.client_id, command.topic, command.seq)
    if command.id is not None:
        session.reply(command.id, {"topic": command.topic, "head": head})


def _publish(session: ClientSession, command: schema.Publish) -> None:
    services = session.services
    name = command.topic
    config = _topic_config(services, name)
    _check_publish(session, name, config)
    state = session.state
    bucket = state.publish_bucket
    limits = services.config.limits
    if bucket is None:
        bucket = state.publish_bucket = TokenBucket(limits.publish_rate, limits.publish_burst)
    if not bucket.take():
        raise RateLimited(f"publish rate above {limits.publish_rate:g}/s")
    if config.proxy_publish and services.hooks.asks_publish:

        def publish(answer: PublishAnswer) -> None:
            data = command.data if answer.data is msgspec.UNSET else answer.data
            _publish_now(session, name, data, command.id)

        _ask_backend(session, "publish", {"topic": name, "data": command.data}, PublishAnswer, command.id, publish, topic=name)
        return
    _publish_now(session, name, command.data, command.id)


def _publish_now(session: ClientSession, name: str, data: Any, request_id: Any) -> None:
    # the reply, now or from the broker
    session.services.catalog.publish_reply(session.identity.client_id, name, data, request_id)


def _presence_topic(session: ClientSession, name: str) -> None:
    """Who may ask a topic's presence: whoever may subscribe to it, on a topic with `presence`."""
    config = _topic_config(session.services, name)
    _check_subscribe(session, name, config)
    if not config.presence:
        raise Forbidden(f"topic {name!r} has no presence (topic setting `presence`)")


def _presence(session: ClientSession, command: schema.Presence | schema.PresenceStats) -> None:
    """`presence` (members, counts only above limits.presence_max_members) or `presence_stats` (counts): the
    reply comes now (one process) or once the broker has read Redis."""
    name = command.topic
    _presence_topic(session, name)
    with_members = isinstance(command, schema.Presence)
    if with_members:
        _costly(session, "presence")
    services = session.services
    future = services.presence.view(name, services.config.limits.presence_max_members)
    session.reply_when_done(command.id, future, lambda view: view.as_dict(with_members=with_members), "presence")


def _rpc(session: ClientSession, method: str, params: Any) -> Any:
    identity = session.identity
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
        _costly(session, "rpc topics")
        listed = []
        for t in session.services.topics.topics():
            if identity.may_subscribe(t.name, t.config):
                listed.append({"name": t.name, "kind": t.kind, "epoch": t.epoch})
                if len(listed) == RPC_TOPICS_MAX:
                    break
        return listed
    raise UnknownMethod(f"no rpc method {method[:64]!r}")


# -- hooked commands ---------------------------------------------------------------------------------------------


def _ask_backend(
    session: ClientSession,
    hook: str,
    extra: dict[str, Any],
    answer: type[T],
    request_id: Any,
    then: Callable[[T], None],
    *,
    topic: str | None = None,
) -> None:
    """A command that waits for a backend hook (gateway/hooks/base.py): `then(answer)` runs once the backend
    allowed it, if the client is still connected. A refusal is the command's `forbidden` error entry (rpc:
    `rpc_error`), no answer `backend_unavailable`. Answers of later commands may come first (match the ids),
    except those on the same `topic`: they wait behind this one (`_wait_behind`). Raises TooManyCalls when
    the connection is at `proxy.max_calls_per_connection`."""
    services = session.services
    hooks = services.hooks
    state = session.state
    client_id = session.identity.client_id
    _hold(session)
    if topic is not None:
        if state.waiting is None:
            state.waiting = {}
        state.waiting[topic] = deque()

    async def ask() -> None:
        try:
            # the command is a trace of its own, its hook call beneath (gateway/ops/tracing.py)
            with services.tracing.root_span(f"command {hook}", {"fanout.client": str(client_id), "fanout.topic": topic or ""}):
                await answered()
        finally:
            state.hook_calls -= 1
        if topic is not None:
            try:
                _resume(session, topic)
            except Exception:
                _failed(session, f"a command waiting behind a {hook} call")

    async def answered() -> None:
        try:
            try:
                got = await hooks.call(hook, hooks.body(session.identity, **extra), answer)
            except Refused as exc:
                if hook == "rpc":
                    code = "" if exc.code is None else f"{exc.code}: "
                    raise RpcError(f"{code}{exc.message}") from None
                raise Forbidden(exc.message or f"{hook} refused by the backend") from None
            if session.live:
                then(got)
        except RequestError as exc:
            if session.live:
                session.refuse(exc, request_id)
        except Exception:
            _failed(session, f"{hook} through the backend")

    hooks.spawn(ask())


def _failed(session: ClientSession, what: str) -> None:
    """A bug in a command run after its hook answered: logged, and the client closed (1011)."""
    log.exception("%s of %s failed", what, session.identity.client_id)
    session.close(close_codes.INTERNAL_ERROR, "internal error", "error")


def _hold(session: ClientSession) -> None:
    """Count one more command of the connection waiting for the backend, or raise TooManyCalls: a connection
    holds at most `proxy.max_calls_per_connection` hook slots and queued commands (and their memory)."""
    bound = session.services.config.proxy.max_calls_per_connection
    state = session.state
    if state.hook_calls >= bound:
        raise TooManyCalls(f"{bound} commands of this connection already wait for the backend (proxy.max_calls_per_connection)")
    state.hook_calls += 1


def _wait_behind(session: ClientSession, command: schema.Command) -> bool:
    """Whether `command` names a topic on which a hooked command of the connection is pending: it is then
    queued behind it (and counted in the connection's bound), so it takes effect after it."""
    waiting = session.state.waiting
    if not waiting or not isinstance(command, TOPIC_COMMANDS):
        return False
    queue = waiting.get(command.topic)
    if queue is None:
        return False
    _hold(session)
    queue.append(command)
    return True


def _resume(session: ClientSession, topic: str) -> None:
    """The hooked command on `topic` is answered: run the commands that waited behind it, in order, until
    one of them waits for the backend in turn (the rest then wait behind that one)."""
    state = session.state
    waiting = state.waiting
    assert waiting is not None
    queue = waiting.pop(topic)
    while queue and session.live:  # else gone, or cut by one of them
        command = queue.popleft()
        state.hook_calls -= 1  # its place in the bound goes to the call it may make now
        try:
            _run(session, command)
        except RequestError as exc:
            session.refuse(exc, command.id)
        if topic in waiting:
            waiting[topic].extend(queue)
            return

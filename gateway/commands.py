"""Client commands (WebSocket frames, long-poll POST bodies): parse, check, and call the hub.

Every answer (ack, reply, error) goes through the client's direct queue, so it is ordered with the data and
batched like it. A bad command gets an `error` entry; the connection and every other client go on. What a
client may do is asked of its `ClientIdentity` (gateway/identity.py), the one place permissions live.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from core import RequestError, TopicConfig
from core.config import MAX_SEQ
from core.entries import encode_reply

from . import close_codes
from .auth import TokenError
from .identity import ClientIdentity, TokenBucket

if TYPE_CHECKING:
    from .hub import Hub

MAX_COMMANDS_PER_FRAME = 100
#: A request id is echoed in replies: a string up to this length, an integer, or null.
MAX_REQUEST_ID_CHARS = 128


def parse_commands(payload: bytes | str) -> list[dict]:
    """One JSON object, or an array of them. Raises RequestError(bad_json / bad_command)."""
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"not JSON: {exc}", code="bad_json") from None
    commands = doc if isinstance(doc, list) else [doc]
    if len(commands) > MAX_COMMANDS_PER_FRAME:
        raise RequestError(f"at most {MAX_COMMANDS_PER_FRAME} commands per frame", code="bad_command")
    for command in commands:
        if not isinstance(command, dict):
            raise RequestError("a command is a JSON object", code="bad_command")
    return commands


def _topic_name(command: dict) -> str:
    topic = command.get("topic")
    if not isinstance(topic, str) or not topic:
        raise RequestError("`topic` must be a non-empty string", code="bad_command")
    return topic


def _since(command: dict) -> tuple[str, int] | None:
    since = command.get("since")
    if since is None:
        return None
    if (
        not isinstance(since, dict)
        or not isinstance(since.get("epoch"), str)
        or not isinstance(since.get("seq"), int)
        or isinstance(since.get("seq"), bool)
        or not 0 <= since["seq"] < MAX_SEQ
    ):
        raise RequestError("`since` must be {\"epoch\": string, \"seq\": integer in [0, 2**53)}", code="bad_command")
    return since["epoch"], since["seq"]


def _shown(value: Any) -> str:
    """A peer's value for an error message: short strings quoted, anything else by type (a repr of an
    arbitrarily nested value could recurse past Python's limit)."""
    if isinstance(value, str):
        return repr(value if len(value) <= 64 else value[:64] + "...")
    return f"a JSON {type(value).__name__}" if value is not None else "none"


def _request_id(command: dict) -> Any:
    request_id = command.get("id")
    if request_id is None or (isinstance(request_id, int) and not isinstance(request_id, bool)):
        return request_id
    if isinstance(request_id, str) and len(request_id) <= MAX_REQUEST_ID_CHARS:
        return request_id
    raise RequestError(f"`id` must be an integer, a string of at most {MAX_REQUEST_ID_CHARS} characters, "
                       "or null", code="bad_command")


def _topic_config(hub: "Hub", name: str) -> TopicConfig:
    config = hub.engine.topic_config(name)
    if config is None:
        raise RequestError(f"no topic {name!r} and no rule creates it", code="unknown_topic")
    return config


def _creating(hub: "Hub", identity: ClientIdentity, name: str) -> bool:
    """Whether acting on `name` creates it; refuses when this connection used up its creations."""
    if hub.engine.has_topic(name):
        return False
    limit = hub.config.limits.max_created_topics
    if identity.created_topics >= limit:
        raise RequestError(f"this connection may create at most {limit} topics", code="too_many_topics")
    return True


def _subscribe(hub: "Hub", identity: ClientIdentity, command: dict, request_id: Any) -> None:
    name = _topic_name(command)
    since = _since(command)
    if not identity.may_subscribe(name, _topic_config(hub, name)):
        raise RequestError(f"not allowed to subscribe to {name!r}", code="forbidden")
    creating = _creating(hub, identity, name)
    hub.engine.subscribe(identity.client_id, name, since=since, request_id=request_id)
    identity.created_topics += creating
    hub.wake()


def _publish(hub: "Hub", identity: ClientIdentity, command: dict, request_id: Any) -> None:
    name = _topic_name(command)
    if "data" not in command:
        raise RequestError("`data` is missing", code="bad_command")
    if not identity.may_publish(name, _topic_config(hub, name)):
        raise RequestError(f"not allowed to publish to {name!r}", code="forbidden")
    bucket = identity.publish_bucket
    if bucket is None:
        limits = hub.config.limits
        bucket = identity.publish_bucket = TokenBucket(limits.publish_rate, limits.publish_burst)
    if not bucket.take():
        raise RequestError(f"publish rate above {hub.config.limits.publish_rate:g}/s", code="rate_limited")
    creating = _creating(hub, identity, name)
    result = hub.publish(name, command["data"])
    identity.created_topics += creating
    hub.send_direct(identity.client_id, encode_reply(request_id, {"seq": result.seq}))


def _auth(hub: "Hub", identity: ClientIdentity, command: dict) -> dict:
    try:
        principal = hub.authenticate(identity.client_id, command.get("token"))
    except TokenError as exc:
        raise RequestError(str(exc), code=exc.code) from None
    return {"user": principal.user, "expires_at": principal.expires_at}


def _rpc(hub: "Hub", identity: ClientIdentity, method: Any, params: Any) -> Any:
    if method == "echo":
        try:
            orjson.dumps(params)
        except TypeError as exc:  # nested deeper than the encoder writes
            raise RequestError(f"`params` cannot be encoded: {exc}", code="bad_command") from None
        return params
    if method == "time":
        return time.time_ns()
    if method == "whoami":
        return {"client_id": identity.client_id, "transport": identity.transport, "user": identity.user}
    if method == "topics":
        return [{"name": t.name, "kind": t.kind, "epoch": t.epoch} for t in hub.engine.topics()
                if identity.may_subscribe(t.name, t.config)]
    raise RequestError(f"no rpc method {_shown(method)}", code="unknown_method")


def run_command(hub: "Hub", client_id: str, command: dict) -> None:
    identity = hub.conns[client_id].identity
    identity.last_command = time.monotonic()
    request_id = None
    try:
        request_id = _request_id(command)
        op = command.get("op")
        if op == "subscribe":
            _subscribe(hub, identity, command, request_id)
        elif op == "unsubscribe":
            hub.engine.unsubscribe(client_id, _topic_name(command), request_id=request_id)
            hub.wake()
        elif op == "publish":
            _publish(hub, identity, command, request_id)
        elif op == "auth":
            hub.send_direct(client_id, encode_reply(request_id, _auth(hub, identity, command)))
        elif op == "rpc":
            result = _rpc(hub, identity, command.get("method"), command.get("params"))
            hub.send_direct(client_id, encode_reply(request_id, result))
        elif op == "ping":
            hub.send_direct(client_id, encode_reply(request_id, "pong"))
        else:
            raise RequestError(f"unknown op {_shown(op)}", code="bad_command")
    except RequestError as exc:
        if exc.code == "direct_queue_full":
            hub.kick(client_id, close_codes.DIRECT_OVERFLOW, "direct queue overflow", "direct_queue_full")
        else:
            hub.send_error(client_id, exc, request_id)


def handle_payload(hub: "Hub", client_id: str, payload: bytes | str) -> int:
    """Run every command of one frame or body. Returns how many were run."""
    try:
        commands = parse_commands(payload)
    except RequestError as exc:
        hub.send_error(client_id, exc)
        return 0
    for command in commands:
        if client_id not in hub.conns:
            break  # kicked by an earlier command of the same frame
        run_command(hub, client_id, command)
    return len(commands)

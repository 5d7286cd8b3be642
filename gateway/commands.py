"""Client commands (WebSocket frames, long-poll POST bodies): parse, check, and call the hub.

Every answer (ack, reply, error) goes through the client's direct queue, so it is ordered with the data and
batched like it. A bad command gets an `error` entry; the connection and every other client go on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from core import RequestError, TopicKind
from core.entries import encode_reply

from . import close_codes

if TYPE_CHECKING:
    from .hub import Hub

MAX_COMMANDS_PER_FRAME = 100


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
        or since["seq"] < 0
    ):
        raise RequestError("`since` must be {\"epoch\": string, \"seq\": integer >= 0}", code="bad_command")
    return since["epoch"], since["seq"]


def _may_publish(hub: "Hub", topic: str) -> bool:
    config = hub.engine.topic_config(topic)
    return config is not None and config.client_publish and config.kind is not TopicKind.PRIVATE


def _rpc(hub: "Hub", client_id: str, method: Any, params: Any) -> Any:
    if method == "echo":
        return params
    if method == "time":
        return time.time_ns()
    if method == "whoami":
        return {"client_id": client_id, "transport": hub.conns[client_id].identity.transport}
    if method == "topics":
        return [{"name": t.name, "kind": t.kind, "epoch": t.epoch} for t in hub.engine.topics()]
    raise RequestError(f"no rpc method {method!r}", code="unknown_method")


def run_command(hub: "Hub", client_id: str, command: dict) -> None:
    op = command.get("op")
    request_id = command.get("id")
    engine = hub.engine
    try:
        if op == "subscribe":
            engine.subscribe(client_id, _topic_name(command), since=_since(command), request_id=request_id)
            hub.wake()
        elif op == "unsubscribe":
            engine.unsubscribe(client_id, _topic_name(command), request_id=request_id)
            hub.wake()
        elif op == "publish":
            topic = _topic_name(command)
            if "data" not in command:
                raise RequestError("`data` is missing", code="bad_command")
            if not _may_publish(hub, topic):
                raise RequestError(f"clients may not publish to {topic!r}", code="forbidden")
            result = hub.publish(topic, command["data"])
            hub.send_direct(client_id, encode_reply(request_id, {"seq": result.seq}))
        elif op == "rpc":
            hub.send_direct(client_id, encode_reply(request_id, _rpc(hub, client_id, command.get("method"), command.get("params"))))
        elif op == "ping":
            hub.send_direct(client_id, encode_reply(request_id, "pong"))
        else:
            raise RequestError(f"unknown op {op!r}", code="bad_command")
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

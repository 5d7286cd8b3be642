"""The Centrifugo server API's methods on a user's connections (docs/centrifugo.md, "Server API"): subscribe,
unsubscribe, disconnect, refresh, each through the operators' control commands (gateway/control_commands.py),
so with a broker on every node. Each answers `{}`."""

from __future__ import annotations

from typing import Any

from core import UnknownTopic
from core.config import MAX_SEQ

from ..errors import BrokerUnavailable
from . import api_requests as req
from .api_errors import INTERNAL, ApiError, bad_request, unsupported
from .context import ApiContext

#: the only `disconnect.code` we send: Centrifugo's force disconnect (no reconnect), our 4005 on /ws, SSE and
#: long-poll
FORCE_DISCONNECT = 3503
#: a close frame's reason is at most 123 bytes
MAX_REASON_BYTES = 120


def _user(user: str, session: str | None) -> str:
    if not user:
        raise bad_request(
            "`user` is required: anonymous connections have no user to name (close one with DELETE /api/clients/ID)"
        )
    if session is not None:
        raise unsupported("session", "connections have no session id; name one with `client`")
    return user


async def _control(ctx: ApiContext, command: dict[str, Any]) -> dict[str, Any]:
    try:
        await ctx.hub.broker.control(command)
    except BrokerUnavailable as exc:
        raise ApiError(INTERNAL, f"broker_unavailable: {exc.message}") from None
    return {}


async def subscribe(ctx: ApiContext, request: req.Subscribe) -> dict[str, Any]:
    """Like the connect hook's server-side subscriptions: no permission check; `recover_since` is `since`."""
    user = _user(request.user, request.session)
    for name, value in (
        ("info", request.info),
        ("b64info", request.b64info),
        ("data", request.data),
        ("b64data", request.b64data),
        ("override", request.override),
    ):
        if value is not None:
            raise unsupported(name, "a subscription carries no data of its own and its topic's settings are its own")
    if ctx.hub.topics.topic_config(request.channel) is None:
        raise UnknownTopic(f"no topic {request.channel[:256]!r} and no rule creates it")
    since = request.recover_since
    if since is not None and not 0 <= since.offset < MAX_SEQ:  # as the client protocol's subscribe refuses it
        raise bad_request(f"recover_since.offset is an integer in [0, 2**53), not {since.offset}")
    command = {
        "op": "subscribe",
        "user": user,
        "topic": request.channel,
        "client": request.client,
        "since": None if since is None else [since.epoch, since.offset],
    }
    return await _control(ctx, command)


async def unsubscribe(ctx: ApiContext, request: req.Unsubscribe) -> dict[str, Any]:
    user = _user(request.user, request.session)
    return await _control(ctx, {"op": "unsubscribe", "user": user, "topic": request.channel, "client": request.client})


async def disconnect(ctx: ApiContext, request: req.Disconnect) -> dict[str, Any]:
    """Closed with 4005 (Centrifugo's 3503, force disconnect: no reconnect); `disconnect.reason` is the close
    reason; no other code has an equivalent here."""
    user = _user(request.user, request.session)
    spec = request.disconnect
    reason = "disconnected by admin"
    if spec is not None:
        if spec.code not in (0, FORCE_DISCONNECT):
            raise unsupported(
                "disconnect.code",
                f"connections are closed with {FORCE_DISCONNECT} (force disconnect, no reconnect: 4005 on /ws), not another code",
            )
        if len(spec.reason.encode()) > MAX_REASON_BYTES or not spec.reason.isprintable():
            raise bad_request(f"disconnect.reason must be printable text of at most {MAX_REASON_BYTES} bytes")
        reason = spec.reason or reason
    return await _control(
        ctx, {"op": "disconnect", "user": user, "client": request.client, "keep": list(request.whitelist or ()), "reason": reason}
    )


async def refresh(ctx: ApiContext, request: req.Refresh) -> dict[str, Any]:
    """`expired`: closed as expired (4011); else the connections' expiry becomes `expire_at` (absent: none)."""
    user = _user(request.user, request.session)
    return await _control(
        ctx,
        {
            "op": "refresh",
            "user": user,
            "client": request.client,
            "expired": bool(request.expired),
            "expire_at": request.expire_at,
        },
    )

"""WebSocket close codes the gateway uses (docs/protocol.md). 4000-4999 are for applications (RFC 6455)."""

KICKED = 4000  # an operator disconnected the client (admin API)
DISCONNECTED = 4005  # an operator disconnected every connection of the client's user (DELETE /api/users/U)
BAD_TOKEN = 4001  # ?token= refused: invalid signature, audience, issuer, claims, or auth not configured
BAD_CLIENT_ID = 4006  # ?id= is refused: identity comes from a token's `sub`, never from a chosen name
SLOW_CONSUMER = 4008  # write-blocked longer than websocket.blocked_timeout_s
DIRECT_OVERFLOW = 4009  # the direct queue (replies, acks) hit scheduler.direct_queue_max
TOO_MANY_TOKEN_CHECKS = 4029  # ?token= not checked: this address is past auth.rate_per_ip
TOKEN_REVOKED = 4010  # the token was revoked (POST /api/revocations): refused at connect, or closed
TOKEN_EXPIRED = 4011  # the token expired and no fresh one came within auth.expired_grace_s
CONNECT_REFUSED = 4003  # the backend's connect hook refused the connection ([proxy] connect_url); the reason is its message
IDLE = 4012  # no subscription and no command for limits.idle_timeout_s
REPLACED = 4013  # the user opened more than limits.max_connections_per_user: the oldest gives way
GOING_AWAY = 1001  # server shutting down
SERVICE_RESTART = 1012  # draining (SIGTERM): reconnect elsewhere after the reason's hint, "restarting: reconnect in N ms"
INTERNAL_ERROR = 1011
TRY_AGAIN_LATER = 1013  # the backend's connect hook did not answer (down, timed out): "backend unavailable"
# Sent on a peer's error by the WebSocket protocol (gateway/transports/ws.py, with websockets' parser):
PROTOCOL_ERROR = 1002  # a malformed frame (e.g. an unmasked client frame)
POLICY_VIOLATION = 1008  # a message in more than websocket.max_fragments frames
INVALID_DATA = 1007  # a text frame that is not valid UTF-8
MESSAGE_TOO_BIG = 1009  # a frame larger than websocket.max_frame_bytes

"""WebSocket close codes the gateway uses (docs/protocol.md). 4000-4999 are for applications (RFC 6455)."""

KICKED = 4000  # an operator disconnected the client (admin API)
BAD_CLIENT_ID = 4006  # ?id= invalid, in use, or not allowed
SLOW_CONSUMER = 4008  # write-blocked longer than websocket.blocked_timeout_s
DIRECT_OVERFLOW = 4009  # the direct queue (replies, acks) hit scheduler.direct_queue_max
GOING_AWAY = 1001  # server shutting down
INTERNAL_ERROR = 1011

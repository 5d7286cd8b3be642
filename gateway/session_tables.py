"""Tables of the session transports that outlive a session, held by the hub's session store (`Hub.sessions`,
gateway/session_store.py: `closed`, `checkpoints`): the final body of long-poll sessions closed between
two polls (gateway/transports/longpoll.py), and the checkpoints of SSE's compact `id:` form
(gateway/transports/sse.py). Each is bounded in count and time."""

from __future__ import annotations

import time

#: seconds an ended stream's checkpoints are kept for a reconnect (EventSource retries after ~3 s)
CHECKPOINT_TTL_S = 60.0


class ClosedSessions:
    """The final body of sessions closed while no poll waited (a kick, a token expiry, idle), kept for the
    next poll for `longpoll.session_ttl_s` so the client learns why (docs/protocol.md), at most
    `longpoll.max_sessions` of them (oldest dropped first). Each is answered once, then forgotten."""

    def __init__(self, ttl: float, limit: int) -> None:
        self.ttl = ttl
        self.limit = max(1, limit)
        self._bodies: dict[str, tuple[float, bytes]] = {}  # secret -> (deadline, body), oldest first

    def keep(self, secret: str, body: bytes) -> None:
        now = time.monotonic()
        bodies = self._bodies
        while bodies:  # the oldest first: stops at the first one still kept (no copy of the table)
            old = next(iter(bodies))
            if bodies[old][0] > now and len(bodies) < self.limit:
                break
            del bodies[old]
        bodies[secret] = (now + self.ttl, body)

    def take(self, secret: str) -> bytes | None:
        kept = self._bodies.pop(secret, None)
        if kept is None or kept[0] < time.monotonic():
            return None
        return kept[1]

    def __len__(self) -> int:
        return len(self._bodies)

    def __contains__(self, secret: object) -> bool:
        """A body is kept for `secret` and not yet taken (nor expired)."""
        kept = self._bodies.get(secret)  # type: ignore[call-overload]
        return kept is not None and kept[0] >= time.monotonic()


class Checkpoints:
    """Full recovery points kept by the gateway for the compact `id:` form (`IdLine`): per stream key its
    last `KEPT` checkpoints (number -> POSITIONS text); a stream's are kept `ttl` seconds after it ends, and
    at most `MAX_ENDED` ended streams' (oldest dropped first). Lost with the process: a compact id is only
    understood by the gateway process that wrote it (a full id, by any)."""

    KEPT = 2
    MAX_ENDED = 4096

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._points: dict[str, dict[int, str]] = {}
        self._ended: dict[str, float] = {}  # key -> when its points are dropped, oldest first

    def put(self, key: str, number: int, text: str) -> None:
        points = self._points.setdefault(key, {})
        points[number] = text
        while len(points) > self.KEPT:
            del points[next(iter(points))]

    def ended(self, key: str) -> None:
        if key not in self._points:
            return
        now = time.monotonic()
        ended = self._ended
        while ended:  # the oldest first, as in `ClosedSessions.keep`
            old = next(iter(ended))
            if ended[old] > now and len(ended) < self.MAX_ENDED:
                break
            del ended[old]
            self._points.pop(old, None)
        ended[key] = now + self.ttl

    def get(self, key: str, number: int) -> str | None:
        deadline = self._ended.get(key)
        if deadline is not None and deadline < time.monotonic():
            return None
        return self._points.get(key, {}).get(number)
